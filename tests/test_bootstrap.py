"""The composition root: which adapters a config builds, and what the plane closes on stop.

The Kubernetes cases point a kubeconfig at a small HTTP server of the test's own that
records every request and answers 404: building the plane must not send anything, and
what stopping it sends (the elector giving its Lease up) is asserted exactly.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fakes import TEST_ACTIVATION_KEY, MemoryRuntime
from stoker.adapters._logs import EventLog
from stoker.adapters.activator_http import HttpActivator
from stoker.adapters.cluster_lightkube import LightkubeCluster
from stoker.adapters.elector_k8s import KubernetesLeaseElector
from stoker.adapters.elector_store import StoreLeaseElector
from stoker.adapters.postgres import PostgresStore
from stoker.adapters.runtime_kubernetes import KubernetesRuntime
from stoker.adapters.runtime_local import LocalProcessRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.bootstrap import (
    ELECTOR_BURST,
    ELECTOR_QPS,
    POD_ACTIVATION_RETRY_S,
    Closer,
    JsonFormatter,
    KvFormatter,
    build_activator,
    build_control_plane,
    build_plane,
    build_store,
    kubernetes_namespace,
)
from stoker.config import KubernetesRuntimeConfig, StokerConfig
from stoker.control import logs
from stoker.control.ids import Ids
from stoker.control.plane import ControlPlane
from stoker.domain.errors import ConfigError
from stoker.domain.specs import PlaneSettings, PodTemplate, PoolSpec, ProcessTemplate
from stoker.domain.states import WorkerState
from stoker.ports.clock import LoopClock
from stoker.ports.elector import SoleLeader

LEASES = "/apis/coordination.k8s.io/v1/namespaces"


class RecordingApiServer:
    """An HTTP server that answers every request with a Kubernetes 404 and records it."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._answer, "127.0.0.1", 0)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, path, _ = head.decode().split("\r\n", 1)[0].split(" ", 2)
        self.requests.append(f"{method} {path.split('?', 1)[0]}")
        body = json.dumps(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "code": 404,
                "reason": "NotFound",
                "message": "not found",
            }
        ).encode()
        writer.write(
            b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()


@pytest.fixture
async def api_server() -> AsyncIterator[RecordingApiServer]:
    server = RecordingApiServer()
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def kubeconfig(tmp_path: Path, server: str) -> Path:
    """A kubeconfig with the current context `test` on `server` (and `other` on port 9)."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        f"clusters:\n- {{name: test, cluster: {{server: '{server}'}}}}\n"
        "- {name: other, cluster: {server: 'http://127.0.0.1:9'}}\n"
        "users:\n- {name: u, user: {token: t}}\n"
        "contexts:\n- {name: test, context: {cluster: test, user: u}}\n"
        "- {name: other, context: {cluster: other, user: u}}\n"
    )
    return path


def kubernetes_config(tmp_path: Path, path: Path, **extra: Any) -> StokerConfig:
    runtime = {
        "kind": "kubernetes",
        "namespace": "workers",
        "kubeconfig": str(path),
        "qps": 20,
        "burst": 40,
        "resync_s": 120,
        "placeholder_priority_class": "stoker-placeholder",
        "placeholder_image": "registry.example/pause:3.10",
        "placeholder_size": {"cpu": "8", "memory": "32Gi"},
        **extra.pop("runtime", {}),
    }
    return StokerConfig.model_validate(
        {
            "store": f"sqlite:///{tmp_path}/stoker.db",
            "fleet": "blue",
            "runtime": runtime,
            "leader_election": {
                "kind": "kubernetes",
                "lease_duration_s": 30,
                "renew_deadline_s": 20,
                "retry_period_s": 4,
            },
            "pools": [{"name": "db", "pod": {"image": "worker:1"}, "headroom_nodes": 1}],
            **extra,
        }
    )


def clusters_of(plane: ControlPlane) -> list[LightkubeCluster]:
    """The cluster clients the plane closes on stop."""
    owners = [getattr(close, "__self__", None) for close in plane.closers]
    clusters = [owner for owner in owners if isinstance(owner, LightkubeCluster)]
    assert clusters == owners, owners
    return clusters


async def refuses_requests(cluster: LightkubeCluster) -> bool:
    """True once the cluster's client is closed (a request fails before it is sent)."""
    try:
        await cluster.get_lease("any")
    except RuntimeError as exc:
        return "closed" in str(exc)
    return False


# -- which adapters -------------------------------------------------------------------------


async def test_sqlite_builds_local_processes_and_a_sole_leader(tmp_path: Path) -> None:
    config = StokerConfig(store=f"sqlite:///{tmp_path}/stoker.db")
    plane = build_control_plane(config)
    assert isinstance(plane.store, SqliteStore)
    assert isinstance(plane.runtime, LocalProcessRuntime)
    assert plane.runtime.instance_id == plane.instance_id
    assert plane.runtime.fleet == config.fleet_name()
    assert isinstance(plane.elector, SoleLeader)
    assert plane.closers == ()
    [pool] = plane.catalog.pools.values()
    assert isinstance(pool.template, ProcessTemplate)


async def test_build_plane_gives_one_instance_id_to_every_part_and_keeps_their_closers(
    tmp_path: Path,
) -> None:
    """The builder both `stoker serve` and the simulator build their replicas with."""
    store = SqliteStore(str(tmp_path / "stoker.db"))
    seen: list[tuple[str, str]] = []

    async def close_client() -> None:
        pass

    def runtime(instance_id: str, closers: list[Closer]) -> MemoryRuntime:
        seen.append(("runtime", instance_id))
        closers.append(close_client)
        return MemoryRuntime()

    def elector(instance_id: str, closers: list[Closer]) -> StoreLeaseElector:
        seen.append(("elector", instance_id))
        return StoreLeaseElector(store, clock=LoopClock(), identity=instance_id, name="lease")

    pool = PoolSpec(name="demo", template=ProcessTemplate(argv=("worker",)))
    plane = build_plane(
        pools=[pool],
        orgs=(),
        settings=PlaneSettings(),
        clock=LoopClock(),
        ids=Ids(7),
        store=store,
        runtime=runtime,
        activator=HttpActivator(activation_key=TEST_ACTIVATION_KEY),
        elector=elector,
    )
    assert plane.instance_id == Ids(7).instance()
    assert seen == [("runtime", plane.instance_id), ("elector", plane.instance_id)]
    assert plane.store is store and isinstance(plane.runtime, MemoryRuntime)
    assert isinstance(plane.elector, StoreLeaseElector)
    assert plane.elector.identity == plane.instance_id
    assert plane.closers == (close_client,)
    assert list(plane.catalog.pools) == ["demo"]


def test_processes_and_pods_are_activated_over_http(tmp_path: Path) -> None:
    """One HTTP activator for both runtimes; for pods it retries a port not yet open."""
    local = build_activator(
        StokerConfig(store=f"sqlite:///{tmp_path}/stoker.db"), TEST_ACTIVATION_KEY
    )
    assert isinstance(local, HttpActivator) and local.refused_retry_s is None
    pods = build_activator(
        kubernetes_config(tmp_path, tmp_path / "kubeconfig"), TEST_ACTIVATION_KEY
    )
    assert isinstance(pods, HttpActivator) and pods.refused_retry_s == POD_ACTIVATION_RETRY_S


async def test_postgres_builds_a_store_lease_elector(tmp_path: Path) -> None:
    config = StokerConfig.model_validate(
        {
            "store": "postgresql://stoker@127.0.0.1:5432/stoker",
            "leader_election": {"lease_duration_s": 30, "renew_deadline_s": 20},
            "activation": {"key_file": str(tmp_path / "activation-key")},
        }
    )
    plane = build_control_plane(config)
    assert isinstance(plane.store, PostgresStore)
    elector = plane.elector
    assert isinstance(elector, StoreLeaseElector)
    assert isinstance(plane.runtime, LocalProcessRuntime)
    assert elector.identity == plane.instance_id == plane.runtime.instance_id
    assert (elector.lease_duration_s, elector.renew_deadline_s, elector.retry_period_s) == (
        30,
        20,
        2,
    )
    assert plane.closers == ()


@pytest.mark.parametrize("synchronous", [True, False])
def test_postgres_store_options_reach_the_store(synchronous: bool) -> None:
    config = StokerConfig.model_validate(
        {
            "store": "postgresql://stoker@127.0.0.1:5432/stoker",
            "store_options": {
                "schema": "fleet_a",
                "max_pool_size": 4,
                "synchronous_commit": synchronous,
            },
        }
    )
    store = build_store(config)
    assert isinstance(store, PostgresStore)
    assert store.schema == "fleet_a"
    options = store._db._options
    assert (options.max_size, options.synchronous_commit) == (4, synchronous)


async def test_the_store_lease_is_held_under_the_configured_name(tmp_path: Path) -> None:
    """The elector contends on the plane's own store, as the plane's instance."""
    store = SqliteStore(str(tmp_path / "stoker.db"))
    config = StokerConfig.model_validate(
        {
            "store": f"sqlite:///{tmp_path}/stoker.db",
            "leader_election": {"kind": "store", "lease_name": "janitor-blue"},
        }
    )
    plane = build_control_plane(config, store=store, runtime=MemoryRuntime())
    assert isinstance(plane.elector, StoreLeaseElector)
    await plane.start(loops=False)
    contending = asyncio.create_task(plane.elector.run())
    try:
        for _ in range(200):
            if plane.elector.is_leader:
                break
            await asyncio.sleep(0.01)
        lease = await store.get_lease("janitor-blue")
        assert lease is not None and lease.holder == plane.instance_id
    finally:
        contending.cancel()
        await asyncio.gather(contending, return_exceptions=True)
        await plane.stop()


async def test_kubernetes_builds_pods_and_a_lease_without_contacting_the_cluster(
    tmp_path: Path, api_server: RecordingApiServer
) -> None:
    config = kubernetes_config(tmp_path, kubeconfig(tmp_path, api_server.url))
    plane = build_control_plane(config, ids=Ids(seed=7))
    try:
        runtime, elector = plane.runtime, plane.elector
        assert isinstance(runtime, KubernetesRuntime)
        assert isinstance(elector, KubernetesLeaseElector)
        # One instance id: the replica's row, its pods' label, the Lease holder.
        assert runtime.instance_id == elector.identity == plane.instance_id
        assert runtime.fleet == "blue"
        assert runtime.informer.resync_s == 120
        assert runtime.headroom.placeholders.priority_class == "stoker-placeholder"
        assert runtime.headroom.placeholders.image == "registry.example/pause:3.10"
        assert runtime.headroom.placeholders.size == ("8", "32Gi")
        assert elector.backend.name == "blue-janitor"
        assert (elector.lease_duration_s, elector.renew_deadline_s, elector.retry_period_s) == (
            30,
            20,
            4,
        )
        # Two clients in the namespace: the runtime's on its budget, the elector's own.
        clusters = clusters_of(plane)
        assert len(clusters) == 2 and runtime.cluster in clusters
        assert {c.namespace for c in clusters} == {"workers"}
        assert [(c._budget.rate, c._budget.burst) for c in clusters] == [
            (20, 40),
            (ELECTOR_QPS, ELECTOR_BURST),
        ]
        # Only the runtime's pod creates have a deadline (the default, 5 s).
        assert [c._create_deadline_s for c in clusters] == [5.0, None]
        # The spawn bucket is the client's budget; the pool is a pod with headroom.
        assert (plane.settings.spawn_rate, plane.settings.spawn_burst) == (20, 40)
        [pool] = plane.catalog.pools.values()
        assert isinstance(pool, PoolSpec) and isinstance(pool.template, PodTemplate)
        assert pool.headroom_nodes == 1
        await asyncio.sleep(0.05)
        assert api_server.requests == []
    finally:
        for close in plane.closers:
            await close()
    assert all([await refuses_requests(c) for c in clusters_of(plane)])
    assert api_server.requests == []


async def test_stop_resigns_the_lease_then_closes_the_cluster(
    tmp_path: Path, api_server: RecordingApiServer
) -> None:
    """With an injected runtime the elector still gets its cluster, closed on stop."""
    config = kubernetes_config(tmp_path, kubeconfig(tmp_path, api_server.url))
    plane = build_control_plane(config, runtime=MemoryRuntime())
    [cluster] = clusters_of(plane)
    await plane.start(loops=False)
    assert api_server.requests == []  # not leading yet: no janitor pass, no request
    await plane.stop()
    # Resigning reads the Lease (404 here: nothing to give up), then the client is closed.
    assert api_server.requests == [f"GET {LEASES}/workers/leases/blue-janitor"]
    assert await refuses_requests(cluster)


async def test_the_context_picks_the_cluster_of_both_clients(
    tmp_path: Path, api_server: RecordingApiServer
) -> None:
    path = kubeconfig(tmp_path, api_server.url)
    config = kubernetes_config(tmp_path, path, runtime={"context": "other"})
    plane = build_control_plane(config)
    try:
        servers = {str(c._client.config.cluster.server) for c in clusters_of(plane)}
        assert servers == {"http://127.0.0.1:9"}
    finally:
        for close in plane.closers:
            await close()


async def test_pods_with_a_store_lease_build_one_cluster_client(tmp_path: Path) -> None:
    """`leader_election: store` with pods (and an unreachable server): the runtime's client."""
    path = kubeconfig(tmp_path, "http://127.0.0.1:9")
    config = kubernetes_config(tmp_path, path, leader_election="store")
    plane = build_control_plane(config)
    try:
        assert isinstance(plane.elector, StoreLeaseElector)
        assert isinstance(plane.runtime, KubernetesRuntime)
        assert clusters_of(plane) == [plane.runtime.cluster]
        assert plane.elector.identity == plane.runtime.instance_id == plane.instance_id
    finally:
        for close in plane.closers:
            await close()


@pytest.mark.parametrize(
    ("runtime", "key", "cause"),
    [
        ({"kubeconfig": "/nonexistent/kubeconfig"}, "kubeconfig", "not found"),
        ({"context": "staging"}, "context", "Context 'staging' not found"),
    ],
)
async def test_credentials_that_cannot_load_are_a_config_error(
    tmp_path: Path, runtime: dict[str, str], key: str, cause: str
) -> None:
    config = kubernetes_config(
        tmp_path, kubeconfig(tmp_path, "http://127.0.0.1:9"), runtime=runtime
    )
    with pytest.raises(ConfigError) as info:
        build_control_plane(config)
    [line] = str(info.value).splitlines()
    assert line.startswith(f"config error: runtime.{key}: cannot load the Kubernetes credentials")
    assert cause in line


@pytest.mark.parametrize(
    ("content", "cause"),
    [
        ("just-a-hostname\n", "AttributeError"),
        ("[1, 2]\n", "AttributeError"),
        ("clusters: [\n", "ParserError: while parsing a flow node"),
    ],
)
async def test_a_kubeconfig_that_is_no_kubeconfig_is_a_config_error(
    tmp_path: Path, content: str, cause: str
) -> None:
    """A file that is not a kubeconfig's mapping (an operator pointed at the wrong file)
    or not YAML at all: one config error line naming the key, not an unexpected error."""
    wrong = tmp_path / "wrong"
    wrong.write_text(content)
    config = kubernetes_config(tmp_path, wrong)
    with pytest.raises(ConfigError) as info:
        build_control_plane(config)
    [line] = str(info.value).splitlines()
    assert line.startswith("config error: runtime.kubeconfig: cannot load the Kubernetes")
    assert cause in line


def test_the_namespace_is_configured_or_the_pods_own(tmp_path: Path) -> None:
    account = tmp_path / "namespace"
    runtime = KubernetesRuntimeConfig(kind="kubernetes")
    assert kubernetes_namespace(runtime, account_file=account) == "default"
    account.write_text("team-a\n")
    assert kubernetes_namespace(runtime, account_file=account) == "team-a"
    account.write_text("")
    assert kubernetes_namespace(runtime, account_file=account) == "default"
    configured = KubernetesRuntimeConfig(kind="kubernetes", namespace="workers")
    account.write_text("team-a")
    assert kubernetes_namespace(configured, account_file=account) == "workers"


# -- closers --------------------------------------------------------------------------------


class ClosingRuntime(MemoryRuntime):
    """A memory runtime that notes when it is closed, to order the closers after it."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    async def close(self) -> None:
        self.events.append("runtime")


async def test_closers_run_in_order_after_the_runtime_even_when_one_fails(
    tmp_path: Path,
) -> None:
    events: list[str] = []

    async def first() -> None:
        events.append("first")
        raise OSError("already gone")

    async def second() -> None:
        events.append("second")

    plane = ControlPlane(
        store=SqliteStore(str(tmp_path / "stoker.db")),
        runtime=ClosingRuntime(events),
        activator=HttpActivator(activation_key=TEST_ACTIVATION_KEY),
        pools=[PoolSpec(name="p", template=ProcessTemplate(argv=("x",)))],
        closers=[first, second],
    )
    await plane.start(loops=False)
    assert events == []
    await plane.stop()
    assert events == ["runtime", "first", "second"]
    assert not plane.started
    await plane.stop()  # stopped already: nothing runs twice
    assert events == ["runtime", "first", "second"]


def _record(created: float, message: str) -> logging.LogRecord:
    record = logging.LogRecord("stoker", logging.INFO, "", 0, message, None, None)
    record.created, record.msecs = created, (created % 1) * 1000
    return record


@pytest.mark.parametrize("formatter", [KvFormatter(), JsonFormatter()], ids=["kv", "json"])
def test_log_lines_carry_the_time_of_their_own_record(formatter: logging.Formatter) -> None:
    """The timestamp is formatted once per second and reused; every line still shows its
    own second and milliseconds."""
    base = 1_790_000_000.0  # a whole second
    stamps = []
    for offset in (0.125, 0.875, 1.5, 0.25, 61.0):
        line = formatter.format(_record(base + offset, "event=claim_bound claim=c-1"))
        as_json = line.startswith("{")
        text = json.loads(line)["ts"] if as_json else line.split()[0][3:]
        stamps.append(text)
        # JSON lines are in UTC, marked `Z`; kv lines in local time, as before.
        when = (time.gmtime if as_json else time.localtime)(base + offset)
        expected = time.strftime("%Y-%m-%dT%H:%M:%S", when)
        assert text == f"{expected}.{int((offset % 1) * 1000):03d}" + ("Z" if as_json else "")
    assert len(set(stamps)) == 5
    assert "c-1" in formatter.format(_record(base, "event=claim_bound claim=c-1"))


def test_json_log_lines_keep_the_types_of_the_fields() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    stoker_logger = logging.getLogger("stoker")
    level = stoker_logger.level
    stoker_logger.addHandler(handler)
    stoker_logger.setLevel(logging.INFO)
    try:
        logs.event(
            "claim_bound",
            claim="c-1",
            org="123",
            epoch=3,
            seconds=0.25,
            activated=True,
            state=WorkerState.HOT,
            reason=None,
        )
        EventLog("stoker.test")("worker_ready", worker="w-1", port=8080)
    finally:
        stoker_logger.removeHandler(handler)
        stoker_logger.setLevel(level)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["ts"].endswith("Z")
    assert {k: first[k] for k in ("event", "claim", "org", "epoch", "seconds", "activated")} == {
        "event": "claim_bound",
        "claim": "c-1",
        "org": "123",  # text stays text, even when it looks like a number
        "epoch": 3,
        "seconds": 0.25,
        "activated": True,
    }
    assert first["state"] == "hot" and "reason" not in first
    assert (second["event"], second["worker"], second["port"]) == ("worker_ready", "w-1", 8080)
