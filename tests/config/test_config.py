"""Configuration: YAML + STOKER_* overrides, validation messages that name the key, and the
conversion into domain objects."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from stoker.config import (
    DEMO_COMMAND,
    KubernetesRuntimeConfig,
    StokerConfig,
    is_label_value,
    load_config,
    to_domain,
)
from stoker.domain.errors import ConfigError
from stoker.domain.specs import Activation, PlaneSettings, PodTemplate, ProcessTemplate
from stoker.domain.states import Reuse

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stoker.yaml"
    path.write_text(text)
    return path


def errors_of(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> list[str]:
    """The error lines of `text` as a config file, the file named `stoker.yaml`."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env or {})
    return str(info.value).replace(str(path), "stoker.yaml").splitlines()


def test_defaults_are_the_embedded_ones() -> None:
    loaded = load_config(None, {})
    config = loaded.config
    assert loaded.source == "built-in defaults"
    assert config.store == "sqlite:///./stoker.db"
    assert config.runtime.kind == "local"
    assert (config.api.host, config.api.port) == ("127.0.0.1", 8080)
    assert not config.api.has_tokens
    assert config.api.max_body_bytes == 65536
    assert (config.api.max_header_bytes, config.api.max_connections) == (32768, 1024)
    assert (config.api.header_timeout_s, config.api.body_timeout_s) == (10.0, 30.0)
    assert config.api.keep_alive_s == 5.0
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
        (
            "pools:\n  - {name: p, command: [x], max_claim_s: -5}\n",
            "config error: pools[0].max_claim_s: must be >= 0",
        ),
        (
            "orgs:\n  - {name: acme, max_claim_s: forever}\n",
            "config error: orgs[0].max_claim_s: must be a number",
        ),
        (
            "pools:\n  - {name: p, command: [x], spawn_backoff: {factor: 0.5}}\n",
            "config error: pools[0].spawn_backoff.factor: must be >= 1",
        ),
        (
            "pools:\n  - {name: p, command: [x], spawn_backoff: {initial_s: 0}}\n",
            "config error: pools[0].spawn_backoff.initial_s: must be > 0",
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
            "config error: pools[1].name: duplicate pool name 'p' (also pools[0])",
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
        # An endpoint the OTLP exporter could not use fails here, not when serve starts.
        (
            "tracing: {endpoint: 'http://[::1'}\n",
            "config error: tracing.endpoint: 'http://[::1' is not a URL: Invalid IPv6 URL",
        ),
        (
            "tracing: {endpoint: 'http://collector:otlp'}\n",
            "config error: tracing.endpoint: 'http://collector:otlp' is not a URL: Port could "
            "not be cast to integer value as 'otlp'",
        ),
        (
            "tracing: {endpoint: 'https://'}\n",
            "config error: tracing.endpoint: 'https://' names no host",
        ),
    ],
)
def test_a_wrong_key_or_value_names_the_key(tmp_path: Path, text: str, expected: str) -> None:
    assert f"{expected} (from stoker.yaml)" in errors_of(tmp_path, text)


def test_a_duplicate_name_is_reported_at_the_later_item(tmp_path: Path) -> None:
    text = (
        "pools:\n  - {name: a, command: [x]}\n  - {name: b, command: [x]}\n"
        "  - {name: a, command: [y]}\norgs:\n  - {name: acme}\n  - {name: acme}\n"
    )
    assert errors_of(tmp_path, text) == [
        "config error: pools[2].name: duplicate pool name 'a' (also pools[0]) (from stoker.yaml)",
        "config error: orgs[1].name: duplicate org name 'acme' (also orgs[0]) (from stoker.yaml)",
    ]
    # Made a duplicate by an override: the variable that set the name is named.
    two = "pools:\n  - {name: a, command: [x]}\n  - {name: b, command: [x]}\n"
    [line] = errors_of(tmp_path, two, {"STOKER_POOLS__1__NAME": "a"})
    assert line.startswith("config error: pools[1].name: duplicate pool name 'a' (also pools[0])")
    assert line.endswith("(from STOKER_POOLS__1__NAME)")


def test_unknown_runtime_kind(tmp_path: Path) -> None:
    [line] = errors_of(tmp_path, "runtime: {kind: nomad}\n")
    assert line == (
        "config error: runtime.kind: unknown kind 'nomad'; supported: kubernetes, local "
        "(from stoker.yaml)"
    )
    # Found by the config fuzz: under `runtime`, the variable that set the kind went unnamed.
    [line] = errors_of(tmp_path, "{}\n", {"STOKER_RUNTIME__KIND": "nomad"})
    assert line.endswith("supported: kubernetes, local (from STOKER_RUNTIME__KIND)")


def test_short_tokens_are_rejected_without_printing_them(tmp_path: Path) -> None:
    lines = errors_of(tmp_path, "api:\n  org_tokens: {short: acme}\n")
    assert lines == [
        "config error: api.org_tokens.<token>: string should have at least 16 characters "
        "(from stoker.yaml)"
    ]
    lines = errors_of(tmp_path, "api:\n  admin_tokens: [tiny]\n")
    assert lines == [
        "config error: api.admin_tokens[0]: string should have at least 16 characters "
        "(from stoker.yaml)"
    ]


def test_a_token_may_not_be_admin_and_org(tmp_path: Path) -> None:
    text = (
        "api:\n  admin_tokens: [same-token-0123456789]\n  org_tokens: {same-token-0123456789: a}\n"
    )
    [line] = errors_of(tmp_path, text)
    assert line == (
        "config error: api: a token is both an admin token and an org token (from stoker.yaml)"
    )


def test_errors_from_the_file_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "api: {port: -1}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, {"STOKER_INTERVALS__JANITOR_INTERVAL_S": "0"})
    assert str(info.value).splitlines() == [
        f"config error: api.port: must be >= 0 (from {path})",
        "config error: intervals.janitor_interval_s: must be > 0 "
        "(from STOKER_INTERVALS__JANITOR_INTERVAL_S)",
    ]
    # A problem that spans sections, and a key YAML reads as a number, are the file's too.
    [line] = errors_of(tmp_path, "pools:\n  - {name: p, pod: {image: x}}\n")
    assert line == (
        "config error: pools[0].pod: needs runtime.kind kubernetes; the local runtime runs a "
        "command (from stoker.yaml)"
    )
    [line] = errors_of(tmp_path, "api: {1: x}\n")
    assert line == "config error: api.1: a key must be a string; quote it (from stoker.yaml)"


def test_a_rollout_error_names_its_own_key(tmp_path: Path) -> None:
    text = (
        "pools:\n"
        "  - {name: a, command: [x], rollout: {steps: [10, 5, 100]}}\n"
        "  - {name: b, command: [x], rollout: {steps: [0, 50, 101]}}\n"
        "  - {name: c, command: [x], rollout: {steps: []}}\n"
        "  - {name: d, command: [x], rollout: {step_interval_s: 0, max_failure_ratio: 2}}\n"
        "  - {name: e, command: [x], rollout: {kind: replace, hold_deadline_s: 5}}\n"
    )
    assert errors_of(tmp_path, text) == [
        "config error: pools[0].rollout.steps[1]: must exceed the step before (10) "
        "(from stoker.yaml)",
        "config error: pools[1].rollout.steps[0]: must lie within 1-100 percent (from stoker.yaml)",
        "config error: pools[1].rollout.steps[2]: must lie within 1-100 percent (from stoker.yaml)",
        "config error: pools[2].rollout.steps: a canary needs at least one step (from stoker.yaml)",
        "config error: pools[3].rollout.step_interval_s: must be > 0 and at most a day "
        "(from stoker.yaml)",
        "config error: pools[3].rollout.max_failure_ratio: must be > 0 and at most 1 "
        "(from stoker.yaml)",
        "config error: pools[4].rollout.hold_deadline_s: is for a canary rollout only "
        "(from stoker.yaml)",
    ]
    env = {"STOKER_POOLS__0__ROLLOUT__STEPS": "[50, 50]"}
    assert errors_of(tmp_path, "{}\n", env) == [
        "config error: pools[0].rollout.steps[1]: must exceed the step before (50) "
        "(from STOKER_POOLS__0__ROLLOUT__STEPS)"
    ]


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


def test_an_env_index_in_other_digits_is_an_index_or_an_error(tmp_path: Path) -> None:
    # Found by the config fuzz: `²` passed isdigit() and int() raised a bare ValueError.
    [line] = errors_of(tmp_path, "{}\n", {"STOKER_POOLS__²__WARM_TARGET": "1"})
    assert line == "config error: STOKER_POOLS__²__WARM_TARGET: pools has no item ² (it has 1)"
    arabic_zero = "STOKER_POOLS__\u0660__WARM_TARGET"
    [line] = errors_of(tmp_path, "{}\n", {arabic_zero: "-1"})
    assert line == f"config error: pools[0].warm_target: must be >= 0 (from {arabic_zero})"


def test_a_key_yaml_reads_as_another_type_is_named_as_written(tmp_path: Path) -> None:
    # Found by the config fuzz: `false:` was named `[0]`, the name of a list's first item.
    lines = errors_of(tmp_path, "false: 1\napi: {1.5: x, on: 2}\n")
    assert lines == [
        "config error: false: a key must be a string; quote it (from stoker.yaml)",
        "config error: api.1.5: a key must be a string; quote it (from stoker.yaml)",
        "config error: api.true: a key must be a string; quote it (from stoker.yaml)",
    ]
    # A token that YAML reads as a number is still never printed.
    [line] = errors_of(tmp_path, "api:\n  org_tokens: {12345678901234567890: acme}\n")
    assert line == (
        "config error: api.org_tokens.<token>: a key must be a string; quote it (from stoker.yaml)"
    )


def test_a_line_break_in_a_key_or_a_variable_stays_on_its_line(tmp_path: Path) -> None:
    # Found by the config fuzz: a key or variable with `\r` split its error line in two.
    [line] = errors_of(tmp_path, 'api: {"a\\rb": 1}\n')
    assert line == "config error: api.'a\\rb': unknown key (from stoker.yaml)"
    text = "api: {admin_tokens: [aaaaaaaaaaaaaaaa1]}\n"
    [line] = errors_of(tmp_path, text, {"STOKER_API__ADMIN_TOKENS__\r": "x"})
    assert line == "config error: 'STOKER_API__ADMIN_TOKENS__\\r': no item '\\r' to override"
    [line] = errors_of(tmp_path, "{}\n", {"STOKER_API__X\x1eY": "1"})
    assert line == "config error: api.'x\\x1ey': unknown key (from 'STOKER_API__X\\x1eY')"


def test_a_key_an_override_makes_names_the_variable(tmp_path: Path) -> None:
    # Found by the config fuzz: the variable was named only for the key it set itself.
    [line] = errors_of(tmp_path, "{}\n", {"STOKER_API__PROT__X": "80"})
    assert line == "config error: api.prot: unknown key (from STOKER_API__PROT__X)"


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
    timeouts: {spawn_s: 9, pending_s: 900, activation_s: 2}
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
    assert pool.timeouts.pending_s == 900
    assert pool.revision
    [org] = domain.orgs
    assert (org.name, org.hot_idle_ttl, org.max_workers, org.min_hot_idle) == ("acme", 30, 4, None)
    assert domain.settings.janitor_interval_s == 1 and domain.settings.spawn_burst == 7
    assert domain.settings.reaper_interval_s == PlaneSettings().reaper_interval_s


def test_intervals_cover_every_plane_setting(tmp_path: Path) -> None:
    """The `intervals` section must offer every field of PlaneSettings, with its default."""
    defaults = PlaneSettings()
    assert StokerConfig().intervals == defaults
    every = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(PlaneSettings)}
    config = load_config(write(tmp_path, yaml.safe_dump({"intervals": every})), {}).config
    assert config.intervals == defaults
    assert config.intervals_given() == set(every)


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


# -- the kubernetes runtime, pod templates and leader election -------------------------------

K8S_POOL = "pools:\n  - {name: db, pod: {image: 'ghcr.io/acme/db-worker:1.2'}}\n"
K8S = "runtime: {kind: kubernetes}\n" + K8S_POOL

FULL_KUBERNETES = """
fleet: acme-prod
store: postgresql://stoker@db/stoker
leader_election:
  kind: kubernetes
  lease_name: acme-janitor
  lease_duration_s: 30
  renew_deadline_s: 20
  retry_period_s: 4
runtime:
  kind: kubernetes
  namespace: workers
  kubeconfig: /etc/stoker/kubeconfig
  context: prod
  qps: 20
  burst: 40
  resync_s: 120
  create_deadline_s: 8
  placeholder_priority_class: stoker-placeholder
  placeholder_image: registry.example/pause:3.10
  placeholder_size: {cpu: 8, memory: 32Gi}
pools:
  - name: db
    pod:
      image: ghcr.io/acme/db-worker:1.2
      command: [/bin/engine]
      args: [--port, "{port}"]
      env: {MODE: fast}
      cpu: "2"
      memory: 4Gi
      port: 9000
      node_selector: {node.kubernetes.io/instance-type: m7i.2xlarge}
      tolerations:
        - {key: dedicated, operator: Equal, value: db, effect: NoSchedule}
        - {key: spot, operator: Exists, effect: NoExecute, tolerationSeconds: 30}
      priority_class: stoker-worker
      service_account: db-worker
      labels: {team: data}
      annotations: {example.com/owner: data-team}
    warm_target: 4
    headroom_nodes: 2
"""


def test_the_kubernetes_runtime_takes_every_key(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL_KUBERNETES), {}).config
    runtime = config.runtime
    assert isinstance(runtime, KubernetesRuntimeConfig)
    assert (runtime.namespace, runtime.kubeconfig, runtime.context) == (
        "workers",
        "/etc/stoker/kubeconfig",
        "prod",
    )
    assert (runtime.qps, runtime.burst, runtime.resync_s) == (20, 40, 120)
    assert runtime.create_deadline_s == 8
    assert runtime.placeholder_priority_class == "stoker-placeholder"
    assert runtime.placeholder_image == "registry.example/pause:3.10"
    assert runtime.placeholder_size is not None
    assert (runtime.placeholder_size.cpu, runtime.placeholder_size.memory) == ("8", "32Gi")
    assert config.elector_kind() == "kubernetes"
    assert config.janitor_lease_name() == "acme-janitor"
    election = config.leader_election
    assert (election.lease_duration_s, election.renew_deadline_s, election.retry_period_s) == (
        30,
        20,
        4,
    )


def test_kubernetes_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, K8S), {}).config
    runtime = config.runtime
    assert isinstance(runtime, KubernetesRuntimeConfig)
    assert (runtime.namespace, runtime.kubeconfig, runtime.context) == (None, None, None)
    assert (runtime.qps, runtime.burst, runtime.resync_s) == (50, 100, 300)
    assert runtime.create_deadline_s == 5
    assert runtime.placeholder_priority_class is None
    assert runtime.placeholder_image == "registry.k8s.io/pause:3.10"
    assert runtime.placeholder_size is None
    assert runtime.prefer_session_nodes == "forecast"
    assert config.pools[0].headroom_nodes == 0
    # SQLite: one replica, no elector.
    assert (config.elector_kind(), config.janitor_lease_name()) == ("none", None)


@pytest.mark.parametrize(
    ("given", "taken"),
    [("true", True), ("false", False), ("forecast", "forecast"), ('"false"', False)],
)
def test_sessions_gather_always_never_or_as_the_forecast_says(
    tmp_path: Path, given: str, taken: bool | str
) -> None:
    text = f"runtime: {{kind: kubernetes, prefer_session_nodes: {given}}}\n" + K8S_POOL
    runtime = load_config(write(tmp_path, text), {}).config.runtime
    assert isinstance(runtime, KubernetesRuntimeConfig)
    assert runtime.prefer_session_nodes == taken


@pytest.mark.parametrize("given", ["forcast", "sometimes", "2", "[forecast]", "null"])
def test_a_mistyped_way_of_gathering_sessions_is_named_once(tmp_path: Path, given: str) -> None:
    """One line for the key, in the words of its three values: not one per kind of the
    union (`bool` and the literal) that it accepts."""
    text = f"runtime: {{kind: kubernetes, prefer_session_nodes: {given}}}\n" + K8S_POOL
    assert errors_of(tmp_path, text) == [
        "config error: runtime.prefer_session_nodes: must be true, false or forecast"
        " (from stoker.yaml)"
    ]


def test_a_pod_maps_onto_the_domain_pod_template(tmp_path: Path) -> None:
    domain = to_domain(load_config(write(tmp_path, FULL_KUBERNETES), {}).config)
    [pool] = domain.pools
    assert pool.template == PodTemplate(
        image="ghcr.io/acme/db-worker:1.2",
        command=("/bin/engine",),
        args=("--port", "{port}"),
        env={"MODE": "fast"},
        cpu="2",
        memory="4Gi",
        port=9000,
        node_selector={"node.kubernetes.io/instance-type": "m7i.2xlarge"},
        tolerations=(
            {"key": "dedicated", "operator": "Equal", "value": "db", "effect": "NoSchedule"},
            {"key": "spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
        ),
        priority_class="stoker-worker",
        service_account="db-worker",
        labels={"team": "data"},
        annotations={"example.com/owner": "data-team"},
    )
    assert (pool.headroom_nodes, pool.warm_target) == (2, 4)


def test_a_minimal_pod_gets_the_domain_defaults(tmp_path: Path) -> None:
    [pool] = to_domain(load_config(write(tmp_path, K8S), {}).config).pools
    assert pool.template == PodTemplate(image="ghcr.io/acme/db-worker:1.2")


def test_numbers_are_quantities(tmp_path: Path) -> None:
    text = (
        "runtime: {kind: kubernetes}\npools:\n"
        "  - {name: db, pod: {image: i, cpu: 0.5, memory: 4294967296}}\n"
        "  - {name: web, pod: {image: i, cpu: 2.0, memory: 512Mi}}\n"
    )
    db, web = to_domain(load_config(write(tmp_path, text), {}).config).pools
    assert isinstance(db.template, PodTemplate) and isinstance(web.template, PodTemplate)
    assert (db.template.cpu, db.template.memory) == ("0.5", "4294967296")
    assert (web.template.cpu, web.template.memory) == ("2", "512Mi")


@pytest.mark.parametrize(
    ("text", "kind", "lease"),
    [
        ("{}\n", "none", None),
        ("store: postgresql://u@db/s\n", "store", "janitor"),
        ("store: postgresql://u@db/s\nleader_election: none\n", "none", None),
        ("leader_election: store\n", "store", "janitor"),
        ("leader_election: {kind: store, lease_name: jan-2}\n", "store", "jan-2"),
        ("leader_election: auto\n", "none", None),
        ("fleet: blue\nleader_election: kubernetes\n" + K8S, "kubernetes", "blue-janitor"),
        ("fleet: blue\nleader_election: {kind: kubernetes}\n" + K8S, "kubernetes", "blue-janitor"),
    ],
)
def test_leader_election_kind_and_lease_name(
    tmp_path: Path, text: str, kind: str, lease: str | None
) -> None:
    config = load_config(write(tmp_path, text), {}).config
    assert (config.elector_kind(), config.janitor_lease_name()) == (kind, lease)


def test_leader_election_timings_default_to_client_go() -> None:
    election = StokerConfig().leader_election
    assert election.kind == "auto" and election.lease_name is None
    assert (election.lease_duration_s, election.renew_deadline_s, election.retry_period_s) == (
        15,
        10,
        2,
    )


def test_leader_election_from_the_environment(tmp_path: Path) -> None:
    # The shorthand in the file, one of its keys from the environment.
    path = write(tmp_path, "leader_election: store\n")
    config = load_config(path, {"STOKER_LEADER_ELECTION__LEASE_NAME": "j2"}).config
    assert (config.elector_kind(), config.janitor_lease_name()) == ("store", "j2")
    config = load_config(None, {"STOKER_LEADER_ELECTION": "store"}).config
    assert config.elector_kind() == "store"
    config = load_config(None, {"STOKER_LEADER_ELECTION__RETRY_PERIOD_S": "1"}).config
    assert config.leader_election.retry_period_s == 1


def test_kubernetes_lease_name_follows_the_fleet() -> None:
    config = StokerConfig.model_validate(
        {
            "runtime": {"kind": "kubernetes"},
            "leader_election": "kubernetes",
            "pools": [{"name": "db", "pod": {"image": "i"}}],
        }
    )
    assert config.janitor_lease_name() == f"{config.fleet_name()}-janitor"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # The template must match the runtime: pod with kubernetes, command with local.
        (
            "pools:\n  - {name: p, pod: {image: i}}\n",
            [
                "config error: pools[0].pod: needs runtime.kind kubernetes; the local runtime "
                "runs a command"
            ],
        ),
        (
            "runtime: {kind: kubernetes}\npools:\n  - {name: p, command: [x]}\n",
            [
                "config error: pools[0].command: runs a local process, but runtime.kind is "
                "kubernetes: give the pool a pod instead"
            ],
        ),
        (
            "pools:\n  - {name: p, command: [x], pod: {image: i}}\n",
            [
                "config error: pools[0]: set command (runtime.kind local) or pod "
                "(runtime.kind kubernetes), not both"
            ],
        ),
        (
            "runtime: {kind: kubernetes}\npools:\n  - {name: p}\n",
            ["config error: pools[0].pod: required"],
        ),
        (
            "runtime: {kind: kubernetes}\n",
            [
                "config error: pools: required with runtime.kind kubernetes (the built-in demo "
                "pool runs a local process): give each pool a pod"
            ],
        ),
        (
            "runtime: {kind: kubernetes}\npools:\n"
            "  - {name: p, pod: {image: i}, env: {A: b}, memory_mb: 128}\n",
            [
                "config error: pools[0].env: is for the local runtime only (set pod.env)",
                "config error: pools[0].memory_mb: is for the local runtime only (set pod.memory)",
            ],
        ),
        # Headroom: kubernetes only, and only with a placeholder priority class.
        (
            "pools:\n  - {name: p, command: [x], headroom_nodes: 1}\n",
            [
                "config error: pools[0].headroom_nodes: needs runtime.kind kubernetes "
                "(placeholder pods hold spare nodes)"
            ],
        ),
        (
            "runtime: {kind: kubernetes}\npools:\n  - {name: db, pod: {image: i}, "
            "headroom_nodes: 2}\n  - {name: web, pod: {image: i}, headroom_nodes: 1}\n",
            [
                "config error: runtime.placeholder_priority_class: required when a pool has "
                "headroom_nodes > 0 (db, web): without a class below the workers', no worker "
                "could preempt a placeholder"
            ],
        ),
        # Leader election where it cannot work, and timings that cannot hold.
        (
            "leader_election: kubernetes\n",
            [
                "config error: leader_election.kind: kubernetes needs runtime.kind kubernetes "
                "(the Lease lives in the runtime's namespace and is reached with its "
                "credentials); with local workers use store, on a PostgreSQL store"
            ],
        ),
        (
            "fleet: Blue_Fleet\nleader_election: kubernetes\n" + K8S,
            [
                "config error: leader_election.lease_name: 'Blue_Fleet-janitor' is not a valid "
                "Kubernetes object name: at most 253 lowercase letters, digits, '-' or '.', "
                "beginning and ending with a letter or digit (derived from fleet; set "
                "leader_election.lease_name)"
            ],
        ),
        (
            "leader_election: {kind: store, lease_duration_s: 10}\n",
            ["config error: leader_election.lease_duration_s: must exceed renew_deadline_s (10)"],
        ),
        (
            "leader_election: {kind: store, renew_deadline_s: 2, lease_duration_s: 3}\n",
            [
                "config error: leader_election.renew_deadline_s: must exceed 1.2 x "
                "retry_period_s (2), i.e. 2.4"
            ],
        ),
        (
            "leader_election: {retry_period_s: 0}\n",
            ["config error: leader_election.retry_period_s: must be > 0"],
        ),
        (
            "leader_election: zookeeper\n",
            [
                "config error: leader_election.kind: input should be 'auto', 'none', 'store' "
                "or 'kubernetes'"
            ],
        ),
        (
            "leader_election: [store]\n",
            [
                "config error: leader_election: must be a mapping or one of none, store, "
                "kubernetes, auto"
            ],
        ),
        # Kubernetes names.
        (
            "fleet: blue-\n",
            [
                "config error: fleet: must be a valid Kubernetes label value: at most 63 "
                "letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"
            ],
        ),
        (
            f"fleet: {'f' * 64}\n",
            [
                "config error: fleet: must be a valid Kubernetes label value: at most 63 "
                "letters, digits, '-', '_' or '.', beginning and ending with a letter or digit"
            ],
        ),
        (
            "runtime: {kind: kubernetes}\npools:\n  - {name: db., pod: {image: i}}\n",
            [
                "config error: pools[0].name: with runtime.kind kubernetes, must be a valid "
                "Kubernetes label value: at most 63 letters, digits, '-', '_' or '.', "
                "beginning and ending with a letter or digit"
            ],
        ),
        (
            "runtime: {kind: kubernetes, namespace: Workers}\n" + K8S_POOL,
            [
                "config error: runtime.namespace: 'Workers' is not a valid namespace: at most "
                "63 lowercase letters, digits or '-', beginning and ending with a letter or digit"
            ],
        ),
        # Keys of the other runtime, and bounds, name the key without the union's tag.
        (
            "runtime: {kind: kubernetes, memory_budget_mb: 100}\n" + K8S_POOL,
            ["config error: runtime.memory_budget_mb: unknown key"],
        ),
        ("runtime: {kind: local, qps: 5}\n", ["config error: runtime.qps: unknown key"]),
        (
            "runtime: {kind: kubernetes, qps: 0, burst: 0}\n" + K8S_POOL,
            ["config error: runtime.qps: must be > 0", "config error: runtime.burst: must be >= 1"],
        ),
        (
            "runtime: {kind: kubernetes, placeholder_size: {cpu: 8}}\n" + K8S_POOL,
            ["config error: runtime.placeholder_size.memory: required"],
        ),
        # What the API server would refuse at every spawn is refused at start-up.
        (
            "runtime: {kind: kubernetes}\npools:\n  - {name: p, pod: {image: i, cpu: 0, "
            "memory: lots}}\n",
            [
                "config error: pools[0].pod.cpu: '0' must be more than 0",
                "config error: pools[0].pod.memory: 'lots' is not a Kubernetes quantity such "
                "as 500m, 2, 512Mi or 4Gi",
            ],
        ),
        (
            "runtime: {kind: kubernetes}\npools:\n  - {name: p, pod: {image: i, tolerations: "
            "[{operator: Equal}, {key: k, operator: Exists, value: v}, "
            "{key: k, effect: NoSchedule, tolerationSeconds: 5}]}}\n",
            [
                "config error: pools[0].pod.tolerations[0]: a toleration without a key must "
                "use operator Exists",
                "config error: pools[0].pod.tolerations[1]: a toleration with operator Exists "
                "takes no value",
                "config error: pools[0].pod.tolerations[2]: tolerationSeconds needs effect "
                "NoExecute",
            ],
        ),
        (
            "runtime: {kind: kubernetes}\npools:\n  - {name: p, pod: {image: 'i:1 ', "
            "tolerations: [{key: 'gpu type', operator: Exists}, {key: k, value: 'a b'}]}}\n",
            [
                "config error: pools[0].pod.image: 'i:1 ' must not begin or end with whitespace",
                "config error: pools[0].pod.tolerations[0].key: 'gpu type' is not a valid "
                "Kubernetes key: an optional DNS prefix and '/', then at most 63 letters, "
                "digits, '-', '_' or '.', beginning and ending with a letter or digit",
                "config error: pools[0].pod.tolerations[1].value: 'a b' is not a valid "
                "Kubernetes label value: at most 63 letters, digits, '-', '_' or '.', "
                "beginning and ending with a letter or digit",
            ],
        ),
        (
            "runtime: {kind: kubernetes}\npools:\n  - {name: p, pod: {image: i, "
            f"annotations: {{note: {'x' * 262_141}}}}}}}\n",
            [
                "config error: pools[0].pod.annotations: total 262,145 bytes (keys and "
                "values), more than the API server's 262,144 (256 KiB)",
            ],
        ),
        (
            "runtime: {kind: kubernetes}\npools:\n  - {name: p, pod: {image: i, labels: "
            "{stoker.dev/pool: x, team: data}, annotations: "
            "{karpenter.sh/do-not-disrupt: 'false'}}}\n",
            [
                "config error: pools[0].pod.labels.stoker.dev/pool: is set by stoker itself",
                "config error: pools[0].pod.annotations.karpenter.sh/do-not-disrupt: is set by "
                "stoker itself",
            ],
        ),
        (
            "runtime: {kind: kubernetes}\npools:\n  - {name: p, pod: {image: i, port: 0, "
            "labels: {team: data-}}}\n",
            [
                "config error: pools[0].pod.port: must be >= 1",
                "config error: pools[0].pod.labels.team: 'data-' is not a valid Kubernetes "
                "label value: at most 63 letters, digits, '-', '_' or '.', beginning and "
                "ending with a letter or digit",
            ],
        ),
    ],
)
def test_kubernetes_and_election_errors_name_the_key(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    assert errors_of(tmp_path, text) == [f"{line} (from stoker.yaml)" for line in expected]


def test_cross_section_errors_from_the_environment_name_the_variable(tmp_path: Path) -> None:
    # The key to change was left to its default: the variable that made it wrong is named.
    lines = errors_of(tmp_path, "{}\n", {"STOKER_LEADER_ELECTION__RENEW_DEADLINE_S": "16"})
    assert lines == [
        "config error: leader_election.lease_duration_s: must exceed renew_deadline_s (16) "
        "(from STOKER_LEADER_ELECTION__RENEW_DEADLINE_S)",
    ]
    lines = errors_of(tmp_path, "{}\n", {"STOKER_POOLS__0__HEADROOM_NODES": "1"})
    assert lines == [
        "config error: pools[0].headroom_nodes: needs runtime.kind kubernetes (placeholder "
        "pods hold spare nodes) (from STOKER_POOLS__0__HEADROOM_NODES)"
    ]


def test_a_rule_across_sections_names_the_override_that_broke_a_defaulted_key(
    tmp_path: Path,
) -> None:
    kind = {"STOKER_RUNTIME__KIND": "kubernetes"}
    # `pools` is the built-in one: the variable that set the runtime is named, not the file.
    [line] = errors_of(tmp_path, "api: {port: 8080}\n", kind)
    assert line == (
        "config error: pools: required with runtime.kind kubernetes (the built-in demo pool "
        "runs a local process): give each pool a pod (from STOKER_RUNTIME__KIND)"
    )
    with pytest.raises(ConfigError) as info:
        load_config(None, kind)
    assert str(info.value).endswith("give each pool a pod (from STOKER_RUNTIME__KIND)")
    [line] = errors_of(tmp_path, K8S, {"STOKER_POOLS__0__HEADROOM_NODES": "1"})
    assert line.startswith("config error: runtime.placeholder_priority_class: required when")
    assert line.endswith(" (from STOKER_POOLS__0__HEADROOM_NODES)")
    [line] = errors_of(tmp_path, "leader_election: kubernetes\n" + K8S, {"STOKER_FLEET": "B_F"})
    assert line.startswith("config error: leader_election.lease_name: 'B_F-janitor' is not")
    assert line.endswith(" (from STOKER_FLEET)")
    # Set in the file, the file is named.
    [line] = errors_of(tmp_path, "leader_election: {renew_deadline_s: 16}\n")
    assert line.endswith("must exceed renew_deadline_s (16) (from stoker.yaml)")


def test_the_derived_fleet_is_a_label_value(tmp_path: Path) -> None:
    long_path = tmp_path / ("d" * 200) / "stoker.db"
    for store in (
        f"sqlite:///{long_path}",
        "sqlite:///:memory:",
        "postgresql://user:pw@db.example:5432/stoker",
    ):
        fleet = StokerConfig(store=store).fleet_name()
        assert is_label_value(fleet) and len(fleet) <= 63, fleet


@pytest.mark.parametrize(
    ("intervals", "rate", "burst"),
    [
        ("{}", 20, 40),  # unset: the client's budget
        ("{spawn_rate: 100, spawn_burst: 500}", 20, 40),  # larger: the budget wins
        ("{spawn_rate: 5, spawn_burst: 8}", 5, 8),  # smaller: the explicit value wins
        ("{spawn_burst: 8}", 20, 8),
    ],
)
def test_the_spawn_budget_is_the_kubernetes_client_budget(
    tmp_path: Path, intervals: str, rate: float, burst: int
) -> None:
    text = f"runtime: {{kind: kubernetes, qps: 20, burst: 40}}\nintervals: {intervals}\n"
    settings = to_domain(load_config(write(tmp_path, text + K8S_POOL), {}).config).settings
    assert (settings.spawn_rate, settings.spawn_burst) == (rate, burst)


def test_the_local_spawn_budget_is_the_intervals(tmp_path: Path) -> None:
    settings = to_domain(load_config(write(tmp_path, "{}\n"), {}).config).settings
    assert (settings.spawn_rate, settings.spawn_burst) == (50, 100)
    text = "intervals: {spawn_rate: 500, spawn_burst: 900}\n"
    settings = to_domain(load_config(write(tmp_path, text), {}).config).settings
    assert (settings.spawn_rate, settings.spawn_burst) == (500, 900)


def test_the_store_url_is_shown_without_its_password() -> None:
    config = StokerConfig(store="postgresql://stoker:s3cret@db:5432/stoker")
    assert config.store_display() == "postgresql://stoker@db:5432/stoker"
    assert StokerConfig().store_display() == "sqlite:///./stoker.db"


# -- the examples and the Kubernetes manifest ----------------------------------------------


def test_the_kubernetes_example_is_the_deployed_configuration() -> None:
    example = ROOT / "examples" / "kubernetes.yaml"
    deployed = (ROOT / "deploy" / "kubernetes" / "base" / "stoker.yaml").read_text()
    assert yaml.safe_load(example.read_text()) == yaml.safe_load(deployed)
    # As deployed: the store and the tokens come from the Secret.
    env = {
        "STOKER_STORE": "postgresql://stoker:pw@postgres:5432/stoker",
        "STOKER_API__ADMIN_TOKENS": "admin-token-0123456789",
    }
    config = load_config(example, env).config
    assert isinstance(config.runtime, KubernetesRuntimeConfig)
    assert config.elector_kind() == "kubernetes"
    assert config.janitor_lease_name() == "stoker-janitor"
    [pool] = to_domain(config).pools
    assert isinstance(pool.template, PodTemplate) and pool.headroom_nodes == 1


def test_the_replicas_example_elects_on_the_store() -> None:
    example = ROOT / "examples" / "replicas.yaml"
    loaded = load_config(example, {"STOKER_API__PORT": "8082"})
    config = loaded.config
    assert config.is_postgres and config.runtime.kind == "local"
    assert (config.elector_kind(), config.janitor_lease_name()) == ("store", "janitor")
    assert config.api.port == 8082
    [pool] = to_domain(config).pools
    assert isinstance(pool.template, ProcessTemplate)
    assert pool.template.argv == tuple(DEMO_COMMAND)
