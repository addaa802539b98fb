"""Composition root: builds a `ControlPlane` from a validated config, and sets up logging.

The one module that imports adapters and control together. It picks the store adapter
from the store URL, the runtime from `runtime.kind` (local processes, or pods through a
lightkube client), the HTTP activator for either (both given the fleet activation key:
the runtime hands each worker its secret, the activator signs with it), and the elector
from `leader_election`
(none, a lease row in the store, or a Kubernetes Lease). The plane, its runtime and its
elector share one instance id, and every cluster client built here is closed when the
plane stops.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypedDict

import yaml

from stoker.adapters._election import ElectorOptions
from stoker.adapters._logs import kv_line
from stoker.adapters.activator_http import HttpActivator
from stoker.adapters.elector_store import StoreLeaseElector
from stoker.adapters.runtime_local import LocalProcessRuntime, LogRetention
from stoker.adapters.sqlite import SqliteStore
from stoker.config import (
    ConfigKeyError,
    KubernetesRuntimeConfig,
    StokerConfig,
    load_activation_key,
    to_domain,
)
from stoker.control.ids import Ids
from stoker.control.plane import ControlPlane
from stoker.control.rollouts import Planner
from stoker.control.scaler import DemandSource
from stoker.domain.activation import ActivationKey
from stoker.domain.errors import ConfigError
from stoker.domain.rollouts import Strategy
from stoker.domain.specs import OrgSpec, PlaneSettings, PodTemplate, PoolSpec
from stoker.extras import missing_extra
from stoker.ports.activator import Activator
from stoker.ports.clock import Clock, LoopClock
from stoker.ports.elector import Elector
from stoker.ports.runtime import Runtime
from stoker.ports.store import Store
from stoker.ports.tracer import NO_TRACER, Tracer

if TYPE_CHECKING:
    from stoker.adapters.cluster_lightkube import LightkubeCluster
    from stoker.ports.cluster import Pod

#: Where a pod finds its own namespace (mounted with its service account token).
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
#: The namespace of a server outside a cluster when `runtime.namespace` is null.
DEFAULT_NAMESPACE = "default"
#: Request budget of the elector's own cluster client. The elector makes about one request
#: a second; on the runtime's client it would queue behind a spawn burst that uses the
#: whole budget, miss its renew deadline and step down in the middle of the burst.
ELECTOR_QPS = 5.0
ELECTOR_BURST = 10
#: Pause between activation attempts that found a pod's port closed: a pod can report
#: Ready a moment before its server listens.
POD_ACTIVATION_RETRY_S = 0.2

#: Seconds `config check --connect` waits for the store to answer.
CONNECT_TIMEOUT_S = 10

#: Run at the end of `ControlPlane.stop`: closes what the plane's adapters do not own.
Closer = Callable[[], Awaitable[None]]


def check_extras(config: StokerConfig) -> None:
    """Raise `ConfigKeyError` naming the extra to install, under the key that selected the
    part, when a part that `config` names needs one that is missing (before anything is
    built: no traceback from an import)."""
    if config.is_postgres:
        _require("postgres", "the postgres store", ("store",))
    # The Kubernetes Lease elector needs the Kubernetes runtime (the config says so).
    if isinstance(config.runtime, KubernetesRuntimeConfig):
        _require("kubernetes", "the kubernetes runtime", ("runtime", "kind"))
    if config.tracing.mode(os.environ) == "on":
        _require("tracing", "tracing", ("tracing", "enabled"))


def build_tracer(config: StokerConfig, environ: Mapping[str, str] | None = None) -> Tracer:
    """The tracer `tracing` asks for: OpenTelemetry over OTLP, or `NO_TRACER`.

    Tracing the config turns on needs the `tracing` extra (`ConfigError` naming it); when
    only the environment implies it (an OTLP endpoint variable) and the extra is missing,
    one warning says so and the server runs without.
    """
    environ = os.environ if environ is None else environ
    tracing = config.tracing
    mode = tracing.mode(environ)
    if mode == "off":
        return NO_TRACER
    if mode == "on":
        _require("tracing", "tracing", ("tracing", "enabled"))
    else:
        problem = missing_extra("tracing", "tracing (implied by an OTEL_EXPORTER_OTLP_* endpoint)")
        if problem is not None:
            logging.getLogger("stoker").warning("event=tracing_off reason=%s", json.dumps(problem))
            return NO_TRACER
    # Imported here: OpenTelemetry's SDK is the `tracing` extra.
    from stoker.adapters.tracing_otel import otlp_tracer

    return otlp_tracer(
        endpoint=tracing.endpoint,
        service_name=tracing.service_name,
        sample_ratio=tracing.sample_ratio,
        environ=environ,
    )


def _require(extra: str, feature: str, loc: tuple[str, ...]) -> None:
    """`ConfigKeyError` under `loc`, the key that selected `feature`, when `extra` is
    missing: `LoadedConfig.checking` adds where that key was set."""
    problem = missing_extra(extra, feature)
    if problem is not None:
        raise ConfigKeyError(loc, problem)


def build_store(config: StokerConfig) -> Store:
    """SqliteStore for `sqlite:///...`, PostgresStore for `postgresql://...`.

    Raises `ConfigError` naming the `postgres` extra when psycopg is not installed.
    """
    if config.is_postgres:
        _require("postgres", "the postgres store", ("store",))
        # Imported here: psycopg is heavy, and most servers run on SQLite.
        from stoker.adapters.postgres import PostgresStore

        opts = config.store_options
        return PostgresStore(
            config.store,
            schema=opts.db_schema,
            min_size=opts.min_pool_size,
            max_size=opts.max_pool_size,
            prepare_threshold=opts.prepare_threshold,
            synchronous_commit=opts.synchronous_commit,
        )
    return SqliteStore(config.sqlite_path())


def kubernetes_namespace(
    runtime: KubernetesRuntimeConfig, *, account_file: Path = SERVICE_ACCOUNT_NAMESPACE
) -> str:
    """`runtime.namespace`, else the pod's own namespace, else "default"."""
    if runtime.namespace:
        return runtime.namespace
    try:
        own = account_file.read_text(encoding="utf-8").strip()
    except OSError:
        return DEFAULT_NAMESPACE
    return own or DEFAULT_NAMESPACE


def build_cluster(
    runtime: KubernetesRuntimeConfig,
    *,
    clock: Clock,
    namespace: str,
    qps: float,
    burst: int,
    create_deadline_s: float | None = None,
    max_retries: int = 5,
) -> LightkubeCluster:
    """A lightkube cluster client for `runtime`'s credentials; nothing is sent until used;
    pod creates stop retrying after `create_deadline_s`, other requests after `max_retries`.

    Raises `ConfigError` naming `runtime.kubeconfig` (or `runtime.context`) when the
    credentials cannot be loaded, or the `kubernetes` extra when lightkube is missing.
    """
    _require("kubernetes", "the kubernetes runtime", ("runtime", "kind"))
    # Imported here: a local server never needs the Kubernetes client.
    from stoker.adapters.cluster_lightkube import LightkubeCluster

    try:
        client = LightkubeCluster.build_client(
            kubeconfig=runtime.kubeconfig, context=runtime.context, namespace=namespace
        )
    except (
        ConfigError,
        OSError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,  # a file that is no mapping (a scalar or a list)
        yaml.YAMLError,
    ) as exc:
        if isinstance(exc, ConfigError):
            cause = str(exc.__cause__ or exc)
        else:
            cause = f"{type(exc).__name__}: {exc}"
        # One line, as every config error is (a YAML error spans several).
        cause = " ".join(cause.split())
        key = "kubeconfig"
        if runtime.context is not None and runtime.context in cause:
            key = "context"
        where = runtime.kubeconfig or "in-cluster service account, $KUBECONFIG or ~/.kube/config"
        raise ConfigKeyError(
            ("runtime", key), f"cannot load the Kubernetes credentials ({where}): {cause}"
        ) from None
    return LightkubeCluster(
        namespace=namespace,
        clock=clock,
        qps=qps,
        burst=burst,
        create_deadline_s=create_deadline_s,
        max_retries=max_retries,
        client=client,
    )


class ConnectError(ConfigError):
    """A part the config names did not answer as `serve` needs: one `connect error: <key>:
    <problem>` line."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        super().__init__(f"connect error: {key}: {problem}")


async def check_connections(config: StokerConfig) -> list[str]:
    """Reach what `config` names with its credentials, changing nothing: the store, and
    on Kubernetes the API server, asked whether these credentials may do what stoker does
    in its namespace, and whether it admits each pool's worker pod (a dry run). One line
    per part that answered; `ConnectError` naming the key of the first part that did not
    (unreachable, refused credentials, missing access, a pod the API server refuses)."""
    said = [await _check_postgres(config) if config.is_postgres else _check_sqlite(config)]
    runtime = config.runtime
    if isinstance(runtime, KubernetesRuntimeConfig):
        said.extend(await _check_kubernetes(config, runtime))
    return said


def _check_sqlite(config: StokerConfig) -> str:
    path = config.sqlite_path()
    if path == ":memory:":
        return "store: SQLite in memory (nothing to reach)"
    folder = Path(path).parent
    if not folder.is_dir():
        raise ConnectError("store", f"the SQLite file's folder {folder} does not exist")
    state = "exists" if Path(path).exists() else "is created at the first serve"
    return f"store: SQLite file {path} ({state})"


async def _check_postgres(config: StokerConfig) -> str:
    _require("postgres", "the postgres store", ("store",))
    import psycopg

    schema = config.store_options.db_schema
    try:
        async with await psycopg.AsyncConnection.connect(
            config.store, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True
        ) as conn:
            cursor = await conn.execute(
                "SELECT current_setting('server_version'), current_user,"
                " EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s),"
                " CASE WHEN EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s)"
                "  THEN has_schema_privilege(%s, 'USAGE,CREATE')"
                "  ELSE has_database_privilege(current_database(), 'CREATE') END",
                (schema, schema, schema),
            )
            version, user, exists, allowed = await cursor.fetchone() or (None,) * 4
    except psycopg.Error as exc:
        cause = " ".join(str(exc).split())
        raise ConnectError("store", f"cannot connect to PostgreSQL: {cause}") from None
    if not allowed:
        needs = "USAGE and CREATE on the schema" if exists else "CREATE on the database"
        raise ConnectError(
            "store_options.schema",
            f"PostgreSQL user {user} lacks {needs} (schema {schema!r}; serve creates its tables)",
        )
    where = "exists" if exists else "is created at the first serve"
    return f"store: PostgreSQL {version} as {user}; schema {schema!r} {where}"


async def _check_kubernetes(config: StokerConfig, runtime: KubernetesRuntimeConfig) -> list[str]:
    from stoker.adapters.cluster_lightkube import LEASE_ACCESS, POD_ACCESS
    from stoker.ports.cluster import ClusterError

    namespace = kubernetes_namespace(runtime)
    cluster = build_cluster(
        runtime,
        clock=LoopClock(),
        namespace=namespace,
        qps=runtime.qps,
        burst=runtime.burst,
        max_retries=1,
    )
    wanted = [*POD_ACCESS, *(LEASE_ACCESS if config.elector_kind() == "kubernetes" else ())]
    try:
        refused = await cluster.denied(wanted)
        if refused:
            named = ", ".join(f"{verb} {resource}" for _, resource, verb in refused)
            raise ConnectError(
                "runtime.namespace",
                f"these credentials may not {named} in namespace {namespace!r}"
                " (deploy/kubernetes/base/rbac.yaml's Role grants what stoker needs)",
            )
        granted = " and ".join(sorted({resource for _, resource, _ in wanted}))
        said = [
            f"runtime: Kubernetes namespace {namespace!r}: may do what stoker does to {granted}"
        ]
        said.extend(await _admit_worker_pods(config, runtime, cluster))
    except ClusterError as exc:
        cause = " ".join(str(exc).split())
        raise ConnectError(
            "runtime.kubeconfig", f"the Kubernetes API did not answer as expected: {cause}"
        ) from None
    finally:
        await cluster.close()
    return said


async def _admit_worker_pods(
    config: StokerConfig, runtime: KubernetesRuntimeConfig, cluster: LightkubeCluster
) -> list[str]:
    """Ask the API server to admit each pool's worker pod, and its headroom placeholder
    when it has `headroom_nodes`, in a dry run (validated and admitted, never stored): a
    pod it refuses (a field it finds invalid, a PriorityClass that does not exist, a
    LimitRange's maximum) is a `ConnectError` naming the pool's `pod` (`headroom_nodes`)
    with the API server's words. A ResourceQuota that has no room now is said, not an
    error: the fleet's own workers may fill it."""
    from stoker.adapters.runtime_kubernetes import placeholder_pods, probe_pod

    size = runtime.placeholder_size
    said = []
    for i, pool in enumerate(to_domain(config).pools):
        template = pool.template
        if not isinstance(template, PodTemplate):
            continue
        pods = [("pod", "worker pod", probe_pod(pool, template, fleet=config.fleet_name()))]
        if pool.headroom_nodes and runtime.placeholder_priority_class is not None:
            placeholder = next(
                placeholder_pods(
                    pool,
                    template,
                    fleet=config.fleet_name(),
                    image=runtime.placeholder_image,
                    priority_class=runtime.placeholder_priority_class,
                    size=(size.cpu, size.memory) if size is not None else None,
                )
            )
            pods.append(("headroom_nodes", "headroom placeholder", placeholder))
        for key, what, pod in pods:
            full = await _admitted(cluster, pod, template, f"pools[{i}].{key}", pool.name, what)
            admits = f"runtime: pool {pool.name!r}: the API server admits its {what}"
            if full is None:
                said.append(f"{admits} (dry run)")
            else:
                said.append(f"{admits}, but the namespace's quota has no room for one now ({full})")
    return said


async def _admitted(
    cluster: LightkubeCluster, pod: Pod, template: PodTemplate, key: str, pool: str, what: str
) -> str | None:
    """Have the API server admit `pod` in a dry run: None when it does, the quota's words
    when only a ResourceQuota without room refuses it; `ConnectError` naming `key` when it
    refuses the pod itself."""
    from stoker.adapters.runtime_kubernetes import refusal
    from stoker.ports.cluster import Forbidden, Invalid

    try:
        await cluster.admit_pod(pod)
    except (Invalid, Forbidden) as exc:
        # As a spawn says it: the API server's words, the template's env values masked.
        cause = " ".join(refusal(exc, pod, template).split())
        if isinstance(exc, Forbidden) and "exceeded quota" in cause:
            return cause
        raise ConnectError(
            key, f"the API server refuses the {what} of pool {pool!r}: {cause}"
        ) from None
    return None


def build_activation_key(config: StokerConfig) -> ActivationKey:
    """The fleet activation key `activation` names (a file next to SQLite by default).

    Raises `ConfigError` naming the key to set (see `stoker.config.activation`).
    """
    sqlite_path = None if config.is_postgres else config.sqlite_path()
    return load_activation_key(config.activation, sqlite_path=sqlite_path)


class _RuntimeIdentity(TypedDict):
    """What every runtime is told about whose workers it runs."""

    clock: Clock
    fleet: str
    instance_id: str
    activation_key: ActivationKey


def build_runtime(
    config: StokerConfig,
    *,
    clock: Clock,
    instance_id: str,
    closers: list[Closer],
    activation_key: ActivationKey,
    activator: Activator | None = None,
) -> Runtime:
    """The runtime `runtime.kind` names; a cluster client it needs is added to `closers`.

    Local workers are probed on the HTTP `activator`'s session, when it is one: a worker's
    first activation then reuses the connection of its readiness probe. Each worker gets
    the activation secret `activation_key` derives for it.
    """
    runtime = config.runtime
    identity = _RuntimeIdentity(
        clock=clock,
        fleet=config.fleet_name(),
        instance_id=instance_id,
        activation_key=activation_key,
    )
    if not isinstance(runtime, KubernetesRuntimeConfig):
        return LocalProcessRuntime(
            **identity,
            memory_budget_mb=runtime.memory_budget_mb,
            log_dir=runtime.log_dir,
            log_retention=LogRetention(keep=runtime.log_keep, keep_s=runtime.log_keep_s),
            start_limit=runtime.start_limit,
            start_nice=runtime.start_nice,
            probe_session=activator.session if isinstance(activator, HttpActivator) else None,
        )
    from stoker.adapters.runtime_kubernetes import KubernetesRuntime

    cluster = build_cluster(
        runtime,
        clock=clock,
        namespace=kubernetes_namespace(runtime),
        qps=runtime.qps,
        burst=runtime.burst,
        create_deadline_s=runtime.create_deadline_s,
    )
    # The runtime stops its informer on close but leaves the client to its owner.
    closers.append(cluster.close)
    size = runtime.placeholder_size
    return KubernetesRuntime(
        cluster=cluster,
        **identity,
        resync_s=runtime.resync_s,
        placeholder_priority_class=runtime.placeholder_priority_class,
        placeholder_image=runtime.placeholder_image,
        placeholder_size=(size.cpu, size.memory) if size is not None else None,
        prefer_session_nodes=runtime.prefer_session_nodes,
    )


def build_activator(
    config: StokerConfig, activation_key: ActivationKey, tracer: Tracer = NO_TRACER
) -> Activator:
    """The HTTP activator signing with `activation_key`, retrying a refused connection for
    pods (see `HttpActivator`), passing `tracer`'s trace context to the workers."""
    if isinstance(config.runtime, KubernetesRuntimeConfig):
        return HttpActivator(
            activation_key=activation_key, refused_retry_s=POD_ACTIVATION_RETRY_S, tracer=tracer
        )
    return HttpActivator(activation_key=activation_key, tracer=tracer)


def build_elector(
    config: StokerConfig, *, store: Store, clock: Clock, instance_id: str, closers: list[Closer]
) -> Elector | None:
    """The elector `leader_election` names (None: the plane's `SoleLeader`).

    `kubernetes` gets a cluster client of its own (see `ELECTOR_QPS`), added to `closers`.
    """
    kind = config.elector_kind()
    lease_name = config.janitor_lease_name()
    if kind == "none" or lease_name is None:
        return None
    election = config.leader_election
    timings = ElectorOptions(
        lease_duration_s=election.lease_duration_s,
        renew_deadline_s=election.renew_deadline_s,
        retry_period_s=election.retry_period_s,
    )
    if kind == "store":
        return StoreLeaseElector(
            store, clock=clock, identity=instance_id, name=lease_name, **timings
        )
    runtime = config.runtime
    if not isinstance(runtime, KubernetesRuntimeConfig):
        # The config refuses this combination; a config built without validation may not.
        raise ConfigError(
            "config error: leader_election.kind: kubernetes needs runtime.kind kubernetes"
        )
    from stoker.adapters.elector_k8s import KubernetesLeaseElector

    cluster = build_cluster(
        runtime,
        clock=clock,
        namespace=kubernetes_namespace(runtime),
        qps=ELECTOR_QPS,
        burst=ELECTOR_BURST,
    )
    closers.append(cluster.close)
    return KubernetesLeaseElector(
        cluster=cluster, clock=clock, identity=instance_id, lease_name=lease_name, **timings
    )


#: Builds one part of a replica for its instance id; a client it opens that the part does
#: not own goes on the closers (run when the plane stops).
RuntimeFactory = Callable[[str, list[Closer]], Runtime]
ElectorFactory = Callable[[str, list[Closer]], Elector | None]


def build_plane(
    *,
    pools: Iterable[PoolSpec],
    orgs: Iterable[OrgSpec],
    settings: PlaneSettings,
    clock: Clock,
    ids: Ids,
    store: Store,
    runtime: RuntimeFactory,
    activator: Activator,
    elector: ElectorFactory,
    demand: DemandSource | None = None,
    tracer: Tracer = NO_TRACER,
    planner: Planner | None = None,
    strategies: Mapping[str, Strategy] | None = None,
    views: bool = True,
) -> ControlPlane:
    """One control-plane replica (not started) on `store`, and the one way to build one.

    It mints the replica's instance id, builds its runtime, then its elector (None: the
    plane's `SoleLeader`), and the plane around them and `activator`: its claim path,
    janitor and fallback reaper. `stoker serve` builds its replica here from the config
    (`build_control_plane`); the simulator builds each of its replicas here too, on its
    own clock, cluster and store. `demand` replaces the janitor's demand source,
    `planner` the rollout plan (the simulator's baselines), and `strategies` are the
    pools' default rollout strategies. `views` off (the simulator), the replica keeps no
    dashboard samples and publishes no sizing (`ControlPlane`).
    """
    # One id for the replica's row, its runtime objects' labels and its lease holder.
    instance_id = ids.instance()
    closers: list[Closer] = []
    built_runtime = runtime(instance_id, closers)
    built_elector = elector(instance_id, closers)
    return ControlPlane(
        store=store,
        runtime=built_runtime,
        activator=activator,
        pools=pools,
        orgs=orgs,
        settings=settings,
        clock=clock,
        elector=built_elector,
        ids=ids,
        instance_id=instance_id,
        closers=closers,
        demand=demand,
        tracer=tracer,
        planner=planner,
        strategies=strategies,
        views=views,
    )


def build_control_plane(
    config: StokerConfig,
    *,
    clock: Clock | None = None,
    ids: Ids | None = None,
    store: Store | None = None,
    runtime: Runtime | None = None,
    activator: Activator | None = None,
    tracer: Tracer | None = None,
) -> ControlPlane:
    """A control plane (not started) for `config`.

    `store`, `runtime` and `activator` replace the ones the config names (tests use an
    in-memory runtime, which is its workers' activator too), and `tracer` the one
    `tracing` asks for (`build_tracer`); the elector is always the
    config's, on `store` when it is a store lease. The fleet activation key is loaded (or
    created) when the config's runtime or activator is built.
    Raises `ConfigError` when the activation key or the Kubernetes credentials cannot be
    loaded, or an extra the config needs is not installed (see `check_extras`).
    """
    check_extras(config)
    domain = to_domain(config)
    clock = clock or LoopClock()
    # Loaded only when a part of the config's needs it, and before the store is opened.
    key = build_activation_key(config) if runtime is None or activator is None else None
    shared = store or build_store(config)
    tracer = build_tracer(config) if tracer is None else tracer
    if activator is None:
        activator = build_activator(config, _loaded(key), tracer)

    def config_runtime(instance_id: str, closers: list[Closer]) -> Runtime:
        if runtime is not None:
            return runtime
        return build_runtime(
            config,
            clock=clock,
            instance_id=instance_id,
            closers=closers,
            activation_key=_loaded(key),
            activator=activator,
        )

    def config_elector(instance_id: str, closers: list[Closer]) -> Elector | None:
        return build_elector(
            config, store=shared, clock=clock, instance_id=instance_id, closers=closers
        )

    return build_plane(
        pools=domain.pools,
        orgs=domain.orgs,
        settings=domain.settings,
        clock=clock,
        ids=ids or Ids(),
        store=shared,
        runtime=config_runtime,
        activator=activator,
        elector=config_elector,
        tracer=tracer,
        strategies=domain.strategies,
    )


def _loaded(key: ActivationKey | None) -> ActivationKey:
    """`key`, loaded by `build_control_plane` whenever a part it builds needs one."""
    if key is None:
        raise ConfigError("config error: activation: the fleet activation key was not loaded")
    return key


# -- logging --------------------------------------------------------------------------------


def parse_kv(message: str) -> dict[str, str]:
    """The fields of a `key=value` log line (values quoted as `stoker.control.logs` quotes them)."""
    fields: dict[str, str] = {}
    i, n = 0, len(message)
    while i < n:
        while i < n and message[i] == " ":
            i += 1
        eq = message.find("=", i)
        if eq < 0:
            break
        key = message[i:eq]
        i = eq + 1
        if i < n and message[i] == '"':
            i += 1
            chars = []
            while i < n and message[i] != '"':
                if message[i] == "\\" and i + 1 < n:
                    i += 1
                chars.append(message[i])
                i += 1
            i += 1
            fields[key] = "".join(chars)
        else:
            end = message.find(" ", i)
            end = n if end < 0 else end
            fields[key] = message[i:end]
            i = end
    return fields


class _Timestamps(logging.Formatter):
    """`formatTime` to the second, formatted once per second (every state change logs a
    line: `strftime` for each was a measurable part of a claim)."""

    _second = -1
    _text = ""

    def stamp(self, record: logging.LogRecord) -> str:
        """`%Y-%m-%dT%H:%M:%S.mmm` of the record's local time."""
        second = int(record.created)
        if second != self._second:
            self._text = self.formatTime(record, "%Y-%m-%dT%H:%M:%S")
            self._second = second
        return f"{self._text}.{int(record.msecs):03d}"


class KvFormatter(_Timestamps):
    """`ts=... level=... logger=... <message>`: stoker's messages already are key=value."""

    def format(self, record: logging.LogRecord) -> str:
        """One line per record."""
        text = record.getMessage()
        if "=" not in text.split(" ", 1)[0]:
            text = "msg=" + json.dumps(text, ensure_ascii=False)
        line = f"ts={self.stamp(record)} level={record.levelname.lower()} "
        line += f"logger={record.name} {text}"
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(_Timestamps):
    """One JSON object per record, with the event's fields as members: typed (numbers as
    numbers, flags as booleans) as stoker logged them, and the time in UTC (`...Z`)."""

    converter = staticmethod(time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        """One line per record."""
        body: dict[str, Any] = {
            "ts": self.stamp(record) + "Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "stoker_fields", None)
        text = record.getMessage()
        if isinstance(fields, dict):
            body["event"] = getattr(record, "stoker_event", "")
            body.update({k: _json_value(v) for k, v in fields.items() if v is not None})
        elif text.startswith("event="):
            body.update(parse_kv(text))
        else:
            body["msg"] = text
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False)


def _json_value(value: Any) -> Any:
    """A log field as JSON holds it: numbers, booleans and text as they are, enums by
    value, anything else as its text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return _json_value(value.value)
    return str(value)


#: The loggers of the HTTP clients' request lines: lightkube's client (httpx2) and the
#: activation client's (httpx).
HTTP_CLIENT_LOGGERS = ("httpx", "httpx2")


class HttpClientLines(logging.Filter):
    """An HTTP client's request lines as stoker events at debug level.

    The clients log every request at info (`HTTP Request: POST https://... "HTTP/1.1 201
    Created"`): one line per pod create, patch and Lease renewal. Their loggers sit at
    warning unless stoker logs at debug; there, each request becomes
    `event=http_request method=... url=... status=...` at debug, and any other line of
    theirs `event=http_client msg=...` at its own level (debug for info).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite `record` in place; never drops it."""
        args = record.args
        if (
            isinstance(args, tuple)
            and len(args) == 5
            and str(record.msg).startswith("HTTP Request:")
        ):
            method, url, version, status, phrase = args
            fields: dict[str, Any] = {
                "method": method,
                "url": str(url),
                "status": status,
                "reason": phrase,
                "http_version": version,
            }
            name = "http_request"
        else:
            fields = {"msg": record.getMessage()}
            name = "http_client"
        record.msg, record.args = kv_line(name, fields), None
        record.stoker_event, record.stoker_fields = name, fields
        if record.levelno <= logging.INFO:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


class _DropStartupNoise(logging.Filter):
    """uvicorn's own startup-failure line repeats what stoker already says in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Application startup failed")


def configure_logging(level: str = "info", fmt: str = "kv", stream: TextIO | None = None) -> None:
    """Send every log line to `stream` (stderr) in the `kv` or `json` format."""
    # No log line names its caller's source file: skip the stack walk each record would
    # make to find it (the logging docs' own optimisation; it matters on the claim path).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KvFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Per-request lines of the HTTP server would drown the state-change events, and the
    # clients' transports trace every connection at debug: too much even there.
    for name in ("uvicorn", "uvicorn.error", "httpcore", "httpcore2"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    # The HTTP clients' request lines (the Kubernetes API's, the activations') are debug
    # events: dropped by their logger's level unless stoker logs at debug.
    for name in HTTP_CLIENT_LOGGERS:
        client = logging.getLogger(name)
        client.setLevel(
            logging.DEBUG if root.level <= logging.DEBUG else max(logging.WARNING, root.level)
        )
        if not any(isinstance(f, HttpClientLines) for f in client.filters):
            client.addFilter(HttpClientLines())
    logging.getLogger("uvicorn.access").disabled = True
    uvicorn_error = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropStartupNoise) for f in uvicorn_error.filters):
        uvicorn_error.addFilter(_DropStartupNoise())
