"""The fleet activation key: where it comes from, how its file is created, and the errors."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stoker.bootstrap import build_activation_key
from stoker.config import StokerConfig, load_config
from stoker.domain.errors import ConfigError


def test_the_embedded_default_creates_a_private_key_next_to_the_database(
    tmp_path: Path,
) -> None:
    """First start: a random key in `<db>.activation-key`, mode 0600; later starts (and
    other replicas on the file) read the same key, so they derive the same secrets."""
    config = StokerConfig(store=f"sqlite:///{tmp_path}/stoker.db")
    first = build_activation_key(config)
    path = tmp_path / "stoker.db.activation-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text().strip()) == 64
    again = build_activation_key(config)
    assert first.worker_secret("w-1") == again.worker_secret("w-1")
    assert first.worker_secret("w-1") != first.worker_secret("w-2")
    assert [p.name for p in tmp_path.iterdir()] == ["stoker.db.activation-key"]
    assert "w-1" not in repr(first) and path.read_text().strip() not in repr(first)


def test_a_configured_key_file_or_key_is_used(tmp_path: Path) -> None:
    key_file = tmp_path / "fleet.key"
    key_file.write_text("k" * 40 + "\n")
    from_file = build_activation_key(
        StokerConfig.model_validate(
            {"store": f"sqlite:///{tmp_path}/s.db", "activation": {"key_file": str(key_file)}}
        )
    )
    loaded = load_config(
        None,
        environ={
            "STOKER_STORE": "postgresql://stoker@db/stoker",
            "STOKER_ACTIVATION__KEY": "k" * 40,
        },
    )
    from_env = build_activation_key(loaded.config)
    assert from_file.worker_secret("w-1") == from_env.worker_secret("w-1")
    # The key is a secret: the config's own text never shows it.
    assert "k" * 40 not in repr(loaded.config) and "k" * 40 not in str(loaded.config)
    assert not (tmp_path / "s.db.activation-key").exists()


def test_postgresql_needs_a_shared_key() -> None:
    """Replicas each generating a key would refuse each other's activations: no default."""
    config = StokerConfig(store="postgresql://stoker@db/stoker")
    with pytest.raises(ConfigError, match=r"activation.key_file: .*STOKER_ACTIVATION__KEY"):
        build_activation_key(config)


@pytest.mark.parametrize("key", ["short", " " + "k" * 40, "k" * 40 + "\n" + "k"])
def test_a_weak_or_malformed_key_is_a_config_error(key: str) -> None:
    with pytest.raises(ConfigError, match=r"activation\.key: must be") as error:
        load_config(None, environ={"STOKER_ACTIVATION__KEY": key})
    assert key.strip() not in str(error.value)


def test_an_unreadable_or_short_key_file_is_a_config_error(tmp_path: Path) -> None:
    short = tmp_path / "short.key"
    short.write_text("abc\n")
    config = StokerConfig.model_validate({"activation": {"key_file": str(short)}})
    with pytest.raises(ConfigError, match="holds 3 bytes"):
        build_activation_key(config)
    missing_dir = tmp_path / "nope" / "fleet.key"
    config = StokerConfig.model_validate({"activation": {"key_file": str(missing_dir)}})
    with pytest.raises(ConfigError, match="cannot create"):
        build_activation_key(config)
    if os.geteuid() != 0:
        unreadable = tmp_path / "unreadable.key"
        unreadable.write_text("k" * 40)
        unreadable.chmod(0)
        config = StokerConfig.model_validate({"activation": {"key_file": str(unreadable)}})
        with pytest.raises(ConfigError, match="cannot read"):
            build_activation_key(config)
