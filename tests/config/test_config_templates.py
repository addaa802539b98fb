"""The one template model from the config file's side: the file builds its templates
through it, reads its text overrides leniently, and knows `command` only."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from stoker.config import load_config
from stoker.config.changes import SettingsChange, changed_template, template_fields
from stoker.config.convert import to_domain
from stoker.domain.errors import ConfigError
from stoker.domain.specs import PodTemplate, ProcessTemplate


def load(tmp_path: Path, pool: str, env: dict[str, str] | None = None) -> ProcessTemplate:
    path = tmp_path / "stoker.yaml"
    path.write_text(f"pools:\n  - {pool}\n", encoding="utf-8")
    spec = to_domain(load_config(path, env or {}).config).pools[0]
    assert isinstance(spec.template, ProcessTemplate)
    return spec.template


def test_the_file_s_template_is_the_model_s(tmp_path: Path) -> None:
    template = load(tmp_path, "{name: p, command: [w, '{port}'], env: {A: b}, memory_mb: 32}")
    assert template == ProcessTemplate(argv=("w", "{port}"), env={"A": "b"}, memory_mb=32)
    # What the API lays a change over is this template in the file's words.
    assert template_fields(template)["command"] == ["w", "{port}"]
    assert changed_template(template, {}) == template


def test_the_file_and_its_text_overrides_are_read_leniently(tmp_path: Path) -> None:
    # STOKER_* overrides are text: a number in quotes is that number in the file.
    env = {"STOKER_POOLS__0__MEMORY_MB": "128", "STOKER_POOLS__0__LEASE_S": "30"}
    assert load(tmp_path, "{name: p, command: [w], memory_mb: '64'}", env).memory_mb == 128


@pytest.mark.parametrize(
    ("pool", "words"),
    [
        ("{name: p, argv: [w]}", "argv"),
        ("{name: p, command: []}", "command"),
        ("{name: p, command: [w, '']}", "command.1"),
        ("{name: p, command: w}", "command"),
        ("{name: p, command: [w], env: {A: 1}}", "env.A"),
        ("{name: p, command: [w], env: {'A=B': x}}", "env"),
        ("{name: p, command: [w], memory_mb: 0}", "memory_mb"),
        ("{name: p, command: [w], lease_s: 0.5}", "lease_s"),
        ("{name: p, command: [w], rollout: {kind: replace, steps: [50, 100]}}", "rollout"),
        ("{name: p, command: [w], rollout: {kind: canary, step: [50, 100]}}", "rollout.step"),
    ],
)
def test_the_file_refuses_what_the_api_refuses(tmp_path: Path, pool: str, words: str) -> None:
    path = tmp_path / "stoker.yaml"
    path.write_text(f"pools:\n  - {pool}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"pools\\[?\\.?0\\]?\\.{words}"):
        load_config(path, {})


def test_argv_in_the_file_names_command(tmp_path: Path) -> None:
    path = tmp_path / "stoker.yaml"
    path.write_text("pools:\n  - {name: p, argv: [w]}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"pools\[0\]\.argv: .*command line is `command`"):
        load_config(path, {})


def test_a_pod_template_goes_through_the_same_model() -> None:
    stable = PodTemplate(image="worker:1", tolerations=({"key": "k", "operator": "Exists"},))
    changed = changed_template(stable, {"image": "worker:2", "port": 9000})
    assert (changed.image, changed.port) == ("worker:2", 9000)  # type: ignore[union-attr]
    assert changed.tolerations == stable.tolerations  # type: ignore[union-attr]
    for bad in ({"port": "9000"}, {"port": True}, {"image": ""}, {"memory_mb": 64}):
        with pytest.raises(ValidationError):
            changed_template(stable, bad)


def test_settings_changes_are_strict_and_bounded_like_the_file() -> None:
    assert SettingsChange.model_validate({"lease_s": 1, "warm_target": 0}).lease_s == 1
    for bad in ({"warm_target": True}, {"warm_target": "3"}, {"lease_s": 0.5}, {"image": "x"}):
        with pytest.raises(ValidationError):
            SettingsChange.model_validate(bad)
