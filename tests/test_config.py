"""Configuration: YAML + STOKER_* overrides, validation messages that name the key, and the
conversion into domain objects."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from stoker.config import (
    DEMO_COMMAND,
    IntervalsConfig,
    StokerConfig,
    load_config,
    to_domain,
)
from stoker.domain.errors import ConfigError
from stoker.domain.specs import Activation, PlaneSettings, ProcessTemplate
from stoker.domain.states import Reuse

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stoker.yaml"
    path.write_text(text)
    return path


def errors_of(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env or {})
    return str(info.value).splitlines()


def test_defaults_are_the_embedded_ones() -> None:
    loaded = load_config(None, {})
    config = loaded.config
    assert loaded.source == "built-in defaults"
    assert config.store == "sqlite:///./stoker.db"
    assert config.runtime.kind == "local"
    assert (config.api.host, config.api.port) == ("127.0.0.1", 8080)
    assert not config.api.has_tokens
    assert config.api.max_body_bytes == 65536
    [demo] = config.pools
    assert demo.name == "demo" and demo.warm_target == 2
    assert demo.command == DEMO_COMMAND


def test_example_config_loads_with_two_pools() -> None:
    config = load_config(ROOT / "examples" / "local.yaml", {}).config
    assert [p.name for p in config.pools] == ["demo", "sandbox"]
    assert config.pools[1].reuse is Reuse.NEVER
    assert config.orgs[0].name == "acme"


def test_env_overrides_nested_keys_and_lists(tmp_path: Path) -> None:
    env = {
        "STOKER_API__PORT": "9000",
        "STOKER_STORE": "sqlite:////var/lib/stoker/state.db",
        "STOKER_POOLS__0__WARM_TARGET": "5",
        "STOKER_API__ADMIN_TOKENS": "aaaaaaaaaaaaaaaa1,bbbbbbbbbbbbbbbb2",
        "STOKER_API__ORG_TOKENS": '{"cccccccccccccccc3": "acme"}',
        "STOKER_INTERVALS__JANITOR_INTERVAL_S": "0.5",
        # Client settings share the prefix but are not config keys: ignored here.
        "STOKER_URL": "http://elsewhere:1",
        "STOKER_TOKEN": "x",
    }
    loaded = load_config(None, env)
    config = loaded.config
    assert config.api.port == 9000
    assert config.store == "sqlite:////var/lib/stoker/state.db"
    assert config.pools[0].warm_target == 5
    assert config.pools[0].name == "demo"
    assert config.api.admin_tokens == ["aaaaaaaaaaaaaaaa1", "bbbbbbbbbbbbbbbb2"]
    assert config.api.org_tokens == {"cccccccccccccccc3": "acme"}
    assert config.intervals.janitor_interval_s == 0.5
    assert "STOKER_API__PORT" in loaded.overrides and "STOKER_URL" not in loaded.overrides


def test_env_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "api: {port: 7000, host: 127.0.0.1}\n")
    config = load_config(path, {"STOKER_API__PORT": "7001"}).config
    assert config.api.port == 7001
    assert config.api.host == "127.0.0.1"


def test_org_tokens_accept_the_list_form(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "api:\n  org_tokens:\n    - {org: acme, token: tttttttttttttttt1}\n"
        "    - {org: globex, token: tttttttttttttttt2}\n",
    )
    config = load_config(path, {}).config
    assert config.api.org_tokens == {"tttttttttttttttt1": "acme", "tttttttttttttttt2": "globex"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "pools:\n  - {name: p, command: [x], warm_target: -1}\n",
            "config error: pools[0].warm_target: must be >= 0",
        ),
        ("api: {prot: 80}\n", "config error: api.prot: unknown key"),
        ("api: {port: 70000}\n", "config error: api.port: must be <= 65535"),
        ("api: {port: eighty}\n", "config error: api.port: must be an integer"),
        (
            "pools: []\n",
            "config error: pools: list should have at least 1 item after validation, not 0",
        ),
        ("pools:\n  - {name: p}\n", "config error: pools[0].command: required"),
        (
            "pools:\n  - {name: p, command: [x], warm_target: 5, max_workers: 2}\n",
            "config error: pools[0]: warm_target (5) exceeds max_workers (2)",
        ),
        (
            "pools:\n  - {name: p, command: [x]}\n  - {name: p, command: [y]}\n",
            "config error: (top level): pools: name 'p' appears twice",
        ),
        ("store: mysql://x\n", "config error: store: must start with sqlite:/// or postgresql://"),
        ("log_format: xml\n", "config error: log_format: input should be 'kv' or 'json'"),
        (
            "intervals: {janitor_interval_s: 0}\n",
            "config error: intervals.janitor_interval_s: must be > 0",
        ),
        (
            "pools:\n  - {name: p, command: [x], reuse: sometimes}\n",
            "config error: pools[0].reuse: input should be 'same_org' or 'never'",
        ),
    ],
)
def test_a_wrong_key_or_value_names_the_key(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in errors_of(tmp_path, text)


def test_kubernetes_runtime_is_refused_until_it_exists(tmp_path: Path) -> None:
    [line] = errors_of(tmp_path, "runtime: {kind: kubernetes, namespace: workers}\n")
    assert line.startswith("config error: runtime: ")
    assert "'kubernetes' is not available in this version" in line
    assert "supported: local" in line


def test_unknown_runtime_kind(tmp_path: Path) -> None:
    [line] = errors_of(tmp_path, "runtime: {kind: nomad}\n")
    assert "unknown kind 'nomad'" in line


def test_short_tokens_are_rejected_without_printing_them(tmp_path: Path) -> None:
    lines = errors_of(tmp_path, "api:\n  org_tokens: {short: acme}\n")
    assert lines == [
        "config error: api.org_tokens.<token>: string should have at least 16 characters"
    ]
    lines = errors_of(tmp_path, "api:\n  admin_tokens: [tiny]\n")
    assert lines == ["config error: api.admin_tokens[0]: string should have at least 16 characters"]


def test_a_token_may_not_be_admin_and_org(tmp_path: Path) -> None:
    text = (
        "api:\n  admin_tokens: [same-token-0123456789]\n  org_tokens: {same-token-0123456789: a}\n"
    )
    [line] = errors_of(tmp_path, text)
    assert line == "config error: api: a token is both an admin token and an org token"


def test_errors_from_the_environment_name_the_variable(tmp_path: Path) -> None:
    lines = errors_of(tmp_path, "{}\n", {"STOKER_API__PORT": "-3"})
    assert lines == ["config error: api.port: must be >= 0 (from STOKER_API__PORT)"]
    lines = errors_of(tmp_path, "{}\n", {"STOKER_API__PROT": "80"})
    assert lines == ["config error: api.prot: unknown key (from STOKER_API__PROT)"]


def test_env_index_past_the_list_is_an_error(tmp_path: Path) -> None:
    [line] = errors_of(tmp_path, "{}\n", {"STOKER_POOLS__3__WARM_TARGET": "1"})
    assert line.startswith("config error: STOKER_POOLS__3__WARM_TARGET: pools has no item 3")


def test_env_json_that_does_not_parse(tmp_path: Path) -> None:
    [line] = errors_of(tmp_path, "{}\n", {"STOKER_POOLS": "[{"})
    assert line.startswith("config error: STOKER_POOLS: not valid JSON")


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read .*missing.yaml: No such file"):
        load_config(tmp_path / "missing.yaml", {})
    [line] = errors_of(tmp_path, "pools: [\n")
    assert line.startswith("config error: ") and "line 2" in line
    [line] = errors_of(tmp_path, "- just\n- a list\n")
    assert line.endswith("the top level must be a mapping of keys")


def test_an_empty_file_means_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, ""), {}).config
    assert config == StokerConfig()


def test_to_domain_builds_pool_org_and_settings(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
pools:
  - name: db
    command: ["{python}", "-m", "engine", "--port", "{port}"]
    env: {MODE: fast}
    memory_mb: 256
    warm_target: 3
    max_workers: 10
    max_workers_per_org: 2
    reuse: never
    activation: none
    lease_s: 15
    claim_timeout_s: 4
    timeouts: {spawn_s: 9, activation_s: 2}
orgs:
  - {name: acme, hot_idle_ttl: 30, max_workers: 4}
intervals: {janitor_interval_s: 1, spawn_burst: 7}
""",
    )
    domain = to_domain(load_config(path, {}).config)
    [pool] = domain.pools
    assert isinstance(pool.template, ProcessTemplate)
    assert pool.template.argv == ("{python}", "-m", "engine", "--port", "{port}")
    assert pool.template.env == {"MODE": "fast"} and pool.template.memory_mb == 256
    assert (pool.warm_target, pool.max_workers, pool.max_workers_per_org) == (3, 10, 2)
    assert pool.reuse is Reuse.NEVER and pool.activation is Activation.NONE
    assert (pool.lease_s, pool.claim_timeout_s) == (15, 4)
    assert (pool.timeouts.spawn_s, pool.timeouts.activation_s) == (9, 2)
    assert pool.revision
    [org] = domain.orgs
    assert (org.name, org.hot_idle_ttl, org.max_workers, org.min_hot_idle) == ("acme", 30, 4, None)
    assert domain.settings.janitor_interval_s == 1 and domain.settings.spawn_burst == 7
    assert domain.settings.reaper_interval_s == PlaneSettings().reaper_interval_s


def test_intervals_cover_every_plane_setting() -> None:
    """The `intervals` section must offer every field of PlaneSettings, with its default."""
    defaults = PlaneSettings()
    assert set(IntervalsConfig.model_fields) == {f.name for f in dataclasses.fields(PlaneSettings)}
    for name, value in IntervalsConfig().model_dump().items():
        assert getattr(defaults, name) == value, name


def test_fleet_name_follows_the_store(tmp_path: Path) -> None:
    a = StokerConfig(store=f"sqlite:///{tmp_path}/a.db")
    b = StokerConfig(store=f"sqlite:///{tmp_path}/b.db")
    assert a.fleet_name() != b.fleet_name()
    assert a.fleet_name() == StokerConfig(store=f"sqlite:///{tmp_path}/a.db").fleet_name()
    assert StokerConfig(fleet="prod").fleet_name() == "prod"
    pg1 = StokerConfig(store="postgresql://u:secret1@db/stoker")
    pg2 = StokerConfig(store="postgresql://u:secret2@db/stoker")
    # A rotated password is the same fleet.
    assert pg1.fleet_name() == pg2.fleet_name()
