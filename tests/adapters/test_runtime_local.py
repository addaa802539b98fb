"""The local-process runtime against real worker processes.

These tests wait on real processes, so they run on real time; every wait is an awaited
event (a runtime event or a pidfd becoming readable) with a bound.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from fakes import TEST_ACTIVATION_KEY
from runtime_contract import EVENT_TIMEOUT_S, Recorder, RuntimeContract
from stoker.adapters.runtime_local import LocalProcessRuntime
from stoker.adapters.runtime_local import _runtime as runtime_module
from stoker.domain.errors import RuntimeFailure, SpawnWithdrawn
from stoker.domain.records import Worker
from stoker.domain.specs import PodTemplate, PoolSpec, ProcessTemplate, Timeouts
from stoker.domain.states import WorkerState
from stoker.ports.clock import LoopClock
from stoker.ports.runtime import Runtime
from stoker.worker import SECRET_ENV

pytestmark = pytest.mark.processes

DEMO_ARGV = (
    "{python}",
    "-m",
    "stoker.demo_worker",
    "--port",
    "{port}",
    "--worker-id",
    "{worker_id}",
)

#: Serves /healthz like a worker but ignores SIGTERM: only SIGKILL ends it.
STUBBORN_WORKER = """
import signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

signal.signal(signal.SIGTERM, signal.SIG_IGN)

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def make_pool(
    argv: tuple[str, ...] = DEMO_ARGV, *, spawn_s: float = 10.0, name: str = "demo"
) -> PoolSpec:
    return PoolSpec(
        name=name,
        template=ProcessTemplate(argv=argv, memory_mb=32),
        timeouts=Timeouts(spawn_s=spawn_s),
    )


def make_worker(prefix: str = "w") -> Worker:
    return Worker(
        id=f"{prefix}-{uuid.uuid4().hex[:8]}",
        pool="demo",
        revision="r1",
        state=WorkerState.SPAWNING,
        epoch=0,
        owner="cp-test",
        created_at=0.0,
        updated_at=0.0,
    )


@contextmanager
def exit_watch(pid: int) -> Iterator[asyncio.Event]:
    """An event set when process `pid` ends (its pidfd becomes readable)."""
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(pid)
    exited = asyncio.Event()

    def on_exit() -> None:
        loop.remove_reader(pidfd)
        exited.set()

    loop.add_reader(pidfd, on_exit)
    try:
        yield exited
    finally:
        if not exited.is_set():
            loop.remove_reader(pidfd)
        os.close(pidfd)


def fleet_processes(fleet: str) -> list[psutil.Process]:
    """Live processes labelled with `fleet`, read independently of the runtime."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("STOKER_FLEET") == fleet:
                found.append(process)
        except psutil.Error:
            continue
    return found


MakeRuntime = Callable[..., Awaitable[tuple[LocalProcessRuntime, Recorder]]]


@asynccontextmanager
async def local_runtimes() -> AsyncIterator[MakeRuntime]:
    """Makes started runtimes with a recording listener; afterwards every runtime is
    closed and every process of their fleets is killed and reaped."""
    runtimes: list[LocalProcessRuntime] = []
    fleets: set[str] = set()

    async def make(
        fleet: str | None = None, **options: Any
    ) -> tuple[LocalProcessRuntime, Recorder]:
        fleet = fleet or f"test-{uuid.uuid4().hex[:8]}"
        fleets.add(fleet)
        options.setdefault("instance_id", f"cp-{len(runtimes)}")
        runtime = LocalProcessRuntime(
            clock=LoopClock(), fleet=fleet, activation_key=TEST_ACTIVATION_KEY, **options
        )
        recorder = Recorder()
        runtime.subscribe(recorder)
        await runtime.start()
        runtimes.append(runtime)
        return runtime, recorder

    try:
        yield make
    finally:
        for runtime in runtimes:
            await runtime.close()
        leftovers = [p for fleet in fleets for p in fleet_processes(fleet)]
        for process in leftovers:
            process.kill()
        # Reaps our own children, waits for the others to disappear.
        _gone, alive = psutil.wait_procs(leftovers, timeout=10)
        assert not alive


@pytest.fixture
async def make_runtime() -> AsyncIterator[MakeRuntime]:
    """Started runtimes with a recording listener (see `local_runtimes`)."""
    async with local_runtimes() as make:
        yield make


@pytest.fixture
async def runtime(make_runtime: MakeRuntime) -> tuple[LocalProcessRuntime, Recorder]:
    return await make_runtime()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as c:
        yield c


async def spawn_ready(
    runtime: LocalProcessRuntime, recorder: Recorder, pool: PoolSpec | None = None
) -> Worker:
    """Spawn a worker, wait for its readiness event, return it with ref and endpoint."""
    worker = make_worker()
    ref = await runtime.spawn(worker, pool or make_pool())
    endpoint = await recorder.ready(worker.id)
    return worker.evolve(runtime_ref=dict(ref), endpoint=endpoint)


async def test_the_runtime_satisfies_the_port() -> None:
    runtime: Runtime = LocalProcessRuntime(
        clock=LoopClock(), fleet="f", instance_id="i", activation_key=TEST_ACTIVATION_KEY
    )
    assert runtime.kind == "local"


async def test_spawn_reports_ready_with_a_working_endpoint(
    runtime: tuple[LocalProcessRuntime, Recorder],
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rt, recorder = runtime
    # The control plane's own settings (tokens, the fleet key) must not leak into workers.
    monkeypatch.setenv("STOKER_ADMIN_TOKEN", "secret")
    monkeypatch.setenv("STOKER_ACTIVATION__KEY", "the-fleet-key-of-the-control-plane-0123")
    worker = make_worker()
    loop = asyncio.get_running_loop()
    started = loop.time()
    ref = await rt.spawn(worker, make_pool())
    endpoint = await recorder.ready(worker.id)
    print(f"\nlocal worker start-to-ready: {(loop.time() - started) * 1000:.0f} ms")

    assert set(ref) == {"pid", "start_time", "port", "endpoint"}
    assert endpoint == ref["endpoint"] == f"http://127.0.0.1:{ref['port']}"
    process = psutil.Process(ref["pid"])
    assert process.create_time() == ref["start_time"]
    # A session of its own: a signal to the control plane's group does not reach it.
    assert os.getsid(ref["pid"]) == ref["pid"] != os.getsid(0)
    env = process.environ()
    assert env["STOKER_FLEET"] == rt.fleet
    assert env["STOKER_WORKER_ID"] == worker.id
    assert env["STOKER_POOL"] == "demo"
    assert env["STOKER_INSTANCE"] == rt.instance_id
    assert "STOKER_ADMIN_TOKEN" not in env and "STOKER_ACTIVATION__KEY" not in env
    # Its activation secret is in its environment (readable by its user only), never in
    # its argv, which every local user can read in `ps`.
    secret = TEST_ACTIVATION_KEY.worker_secret(worker.id)
    assert env[SECRET_ENV] == secret
    assert not any(secret in arg for arg in process.cmdline())

    state = await client.get(f"{endpoint}/")
    assert state.status_code == 200
    assert state.json()["worker_id"] == worker.id
    assert recorder.of(worker.id) == [("ready", endpoint)]


async def test_stop_ends_the_worker_with_sigterm_and_reports_nothing(
    runtime: tuple[LocalProcessRuntime, Recorder],
) -> None:
    rt, recorder = runtime
    worker = await spawn_ready(rt, recorder)
    loop = asyncio.get_running_loop()
    with exit_watch(worker.runtime_ref["pid"]) as exited:
        started = loop.time()
        await rt.stop(worker, grace_s=5.0)
        elapsed = loop.time() - started
        await asyncio.wait_for(exited.wait(), EVENT_TIMEOUT_S)
    # Well inside the grace: SIGTERM ended it, not the SIGKILL after the grace.
    assert elapsed < 2.0
    await asyncio.sleep(0.1)
    assert recorder.of(worker.id) == [("ready", worker.endpoint)]
    # Stopping what is already gone is not an error.
    await rt.stop(worker, grace_s=1.0)


async def test_a_worker_ignoring_sigterm_is_killed_after_the_grace(
    runtime: tuple[LocalProcessRuntime, Recorder],
) -> None:
    rt, recorder = runtime
    pool = make_pool(("{python}", "-c", STUBBORN_WORKER, "{port}"))
    worker = await spawn_ready(rt, recorder, pool)
    loop = asyncio.get_running_loop()
    with exit_watch(worker.runtime_ref["pid"]) as exited:
        started = loop.time()
        await rt.stop(worker, grace_s=0.5)
        elapsed = loop.time() - started
        await asyncio.wait_for(exited.wait(), EVENT_TIMEOUT_S)
    assert 0.5 <= elapsed < 3.0
    assert recorder.of(worker.id) == [("ready", worker.endpoint)]


async def test_an_external_kill_is_reported_lost_exactly_once(
    runtime: tuple[LocalProcessRuntime, Recorder],
) -> None:
    rt, recorder = runtime
    victim = await spawn_ready(rt, recorder)
    bystander = await spawn_ready(rt, recorder)
    os.kill(victim.runtime_ref["pid"], signal.SIGKILL)

    assert await recorder.lost(victim.id) == "lost"
    await rt.stop(bystander, grace_s=5.0)
    await asyncio.sleep(0.2)
    assert recorder.of(victim.id) == [("ready", victim.endpoint), ("lost", "lost")]
    assert recorder.of(bystander.id) == [("ready", bystander.endpoint)]
    # The runtime reaped its child: no zombie is left behind.
    assert not psutil.pid_exists(victim.runtime_ref["pid"])


@pytest.mark.parametrize(
    ("argv", "how"),
    [
        # Never listens: killed when the spawn timeout passes.
        (
            ("{python}", "-c", "import time; time.sleep(60)"),
            "not ready within 0.5s (/healthz never answered 200)",
        ),
        # Exits at once: reported as soon as it is gone, with its exit code.
        (("{python}", "-c", "raise SystemExit(3)"), "exited with code 3"),
        # Ended by a signal before it listened.
        (("{python}", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"), None),
    ],
)
async def test_a_worker_that_never_becomes_ready_is_a_spawn_failure(
    runtime: tuple[LocalProcessRuntime, Recorder], argv: tuple[str, ...], how: str | None
) -> None:
    rt, recorder = runtime
    worker = make_worker()
    ref = await rt.spawn(worker, make_pool(argv, spawn_s=0.5))
    with exit_watch(ref["pid"]) as exited:
        assert await recorder.lost(worker.id, timeout=3.0) == "spawn_failure"
        await asyncio.wait_for(exited.wait(), EVENT_TIMEOUT_S)
    await asyncio.sleep(0.1)
    assert recorder.of(worker.id) == [("lost", "spawn_failure")]
    # How it ended, for the pool's `last_spawn_error`.
    assert recorder.details[worker.id] == (how or "killed by SIGTERM")


async def test_a_failed_spawn_names_its_log_never_its_output(
    make_runtime: MakeRuntime, tmp_path: Path
) -> None:
    rt, recorder = await make_runtime(log_dir=str(tmp_path / "logs"))
    worker = make_worker()
    code = f"import os, sys; print(os.environ[{SECRET_ENV!r}], file=sys.stderr); sys.exit(2)"
    await rt.spawn(worker, make_pool(("{python}", "-c", code)))
    assert await recorder.lost(worker.id) == "spawn_failure"
    said = recorder.details[worker.id]
    assert said == f"exited with code 2; its output: {worker.id}.log in runtime.log_dir"
    # The output is in the log, for the operator; the secret it printed is nowhere else.
    secret = TEST_ACTIVATION_KEY.worker_secret(worker.id)
    assert secret in (tmp_path / "logs" / f"{worker.id}.log").read_text()


async def test_stopping_a_spawning_worker_reports_nothing(
    runtime: tuple[LocalProcessRuntime, Recorder],
) -> None:
    rt, recorder = runtime
    worker = make_worker()
    ref = await rt.spawn(worker, make_pool(("{python}", "-c", "import time; time.sleep(60)")))
    with exit_watch(ref["pid"]) as exited:
        # No ref in the record yet: the runtime still knows the process it started.
        await rt.stop(worker, grace_s=2.0)
        await asyncio.wait_for(exited.wait(), EVENT_TIMEOUT_S)
    await asyncio.sleep(0.1)
    assert recorder.of(worker.id) == []


async def test_a_restarted_control_plane_adopts_a_live_worker(
    make_runtime: MakeRuntime, client: httpx.AsyncClient
) -> None:
    first, first_events = await make_runtime()
    worker = await spawn_ready(first, first_events)
    await first.close()
    # Closing the runtime leaves the worker running.
    assert (await client.get(f"{worker.endpoint}/healthz")).status_code == 200

    second, second_events = await make_runtime(fleet=first.fleet)
    assert await second.adopt(worker)
    assert await second.adopt(worker)  # adopting twice is harmless
    assert second_events.of(worker.id) == []  # readiness is not announced again
    (listed,) = await second.list_objects()
    assert listed.worker_id == worker.id

    os.kill(worker.runtime_ref["pid"], signal.SIGKILL)
    assert await second_events.lost(worker.id) == "lost"
    assert first_events.of(worker.id) == [("ready", worker.endpoint)]
    # Once gone, it cannot be adopted again.
    assert not await second.adopt(worker)


async def test_adoption_and_stop_never_trust_a_reused_pid(
    runtime: tuple[LocalProcessRuntime, Recorder], client: httpx.AsyncClient
) -> None:
    rt, recorder = runtime
    worker = await spawn_ready(rt, recorder)
    ref = worker.runtime_ref
    impostor = worker.evolve(runtime_ref={**ref, "start_time": ref["start_time"] - 100.0})
    assert not await rt.adopt(impostor)
    await rt.stop(impostor, grace_s=0.0)
    # The live process with that pid was not signalled.
    assert (await client.get(f"{worker.endpoint}/healthz")).status_code == 200
    assert psutil.Process(ref["pid"]).is_running()

    unrelated = worker.evolve(runtime_ref={"pid": os.getpid(), "start_time": 1.0})
    assert not await rt.adopt(unrelated)
    assert not await rt.adopt(worker.evolve(runtime_ref={}))


async def test_adopt_reports_false_for_a_dead_pid(
    make_runtime: MakeRuntime,
) -> None:
    first, first_events = await make_runtime()
    worker = await spawn_ready(first, first_events)
    await first.close()
    with exit_watch(worker.runtime_ref["pid"]) as exited:
        os.kill(worker.runtime_ref["pid"], signal.SIGKILL)
        await asyncio.wait_for(exited.wait(), EVENT_TIMEOUT_S)
    second, second_events = await make_runtime(fleet=first.fleet)
    # Dead but not yet reaped (a zombie child of this test process) counts as gone.
    assert not await second.adopt(worker)
    assert not psutil.pid_exists(worker.runtime_ref["pid"])
    assert second_events.events == []


async def test_list_objects_finds_exactly_this_fleets_processes(
    make_runtime: MakeRuntime,
) -> None:
    ours, our_events = await make_runtime()
    theirs, their_events = await make_runtime()
    mine = [await spawn_ready(ours, our_events) for _ in range(2)]
    other = await spawn_ready(theirs, their_events)

    listed = {obj.worker_id: obj for obj in await ours.list_objects()}
    assert set(listed) == {w.id for w in mine}
    for worker in mine:
        obj = listed[worker.id]
        assert obj.ref["pid"] == worker.runtime_ref["pid"]
        assert obj.ref["start_time"] == worker.runtime_ref["start_time"]
        assert obj.created_at == worker.runtime_ref["start_time"]
        assert (obj.pool, obj.alive, obj.ready) == ("demo", True, True)
        assert obj.endpoint == worker.endpoint
        assert obj.instance == ours.instance_id
    assert [obj.worker_id for obj in await theirs.list_objects()] == [other.id]

    await ours.stop(mine[0], grace_s=5.0)
    assert [obj.worker_id for obj in await ours.list_objects()] == [mine[1].id]


async def test_list_objects_names_the_processes_it_started_that_the_scan_missed(
    make_runtime: MakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For an instant after `exec` a new process's environment reads empty, so a scan of
    /proc right after a spawn misses it (seen on a loaded machine: a shutdown's last sweep
    left a process running). The scan is made to miss here; the listing still names every
    process the runtime started, as the scan would."""
    rt, recorder = await make_runtime()
    mine = [await spawn_ready(rt, recorder) for _ in range(2)]
    scanned = {obj.worker_id: obj for obj in await rt.list_objects()}

    monkeypatch.setattr(runtime_module, "scan_fleet", lambda _fleet, _own: [])
    assert {obj.worker_id: obj for obj in await rt.list_objects()} == scanned
    assert set(scanned) == {w.id for w in mine}

    await rt.stop(mine[0], grace_s=5.0)
    assert [obj.worker_id for obj in await rt.list_objects()] == [mine[1].id]


async def test_worker_output_goes_to_the_log_dir(make_runtime: MakeRuntime, tmp_path: Path) -> None:
    rt, recorder = await make_runtime(log_dir=str(tmp_path / "logs"))
    worker = await spawn_ready(rt, recorder)
    await rt.stop(worker, grace_s=5.0)
    log = (tmp_path / "logs" / f"{worker.id}.log").read_text()
    assert f"worker_id={worker.id}" in log


async def test_spawn_refuses_what_it_cannot_start(
    runtime: tuple[LocalProcessRuntime, Recorder],
) -> None:
    rt, recorder = runtime
    pod_pool = PoolSpec(name="pods", template=PodTemplate(image="busybox"))
    with pytest.raises(RuntimeFailure):
        await rt.spawn(make_worker(), pod_pool)
    with pytest.raises(RuntimeFailure):
        await rt.spawn(make_worker(), make_pool(("/nonexistent/worker-binary", "{port}")))
    assert recorder.events == []
    unstarted = LocalProcessRuntime(
        clock=LoopClock(), fleet=rt.fleet, instance_id="x", activation_key=TEST_ACTIVATION_KEY
    )
    with pytest.raises(RuntimeFailure):
        await unstarted.spawn(make_worker(), make_pool())


async def test_derived_cap_is_the_memory_budget_over_the_worker_size() -> None:
    def cap(budget_mb: int | None, memory_mb: int) -> int:
        rt = LocalProcessRuntime(
            clock=LoopClock(),
            fleet="f",
            instance_id="i",
            activation_key=TEST_ACTIVATION_KEY,
            memory_budget_mb=budget_mb,
        )
        pool = PoolSpec(name="p", template=ProcessTemplate(argv=("x",), memory_mb=memory_mb))
        return rt.derived_cap(pool)

    assert cap(1000, 64) == 15
    assert cap(1024, 64) == 16
    assert cap(100, 4000) == 1  # never 0: local mode always has a cap
    total_mb = psutil.virtual_memory().total // 2**20
    assert cap(None, 64) == total_mb // 2 // 64
    pods = PoolSpec(name="pods", template=PodTemplate(image="busybox"))
    rt = LocalProcessRuntime(
        clock=LoopClock(),
        fleet="f",
        instance_id="i",
        activation_key=TEST_ACTIVATION_KEY,
        memory_budget_mb=512,
    )
    assert rt.derived_cap(pods) == 1


# -- the Runtime contract ----------------------------------------------------------------------


class LocalHarness:
    """The contract's harness on real demo-worker processes of one fleet."""

    pool = make_pool()

    def __init__(self, make: MakeRuntime) -> None:
        self._make = make
        self._fleet = f"test-{uuid.uuid4().hex[:8]}"

    async def start(self, instance_id: str) -> tuple[Runtime, Recorder]:
        return await self._make(self._fleet, instance_id=instance_id)

    async def kill(self, worker: Worker) -> None:
        os.kill(worker.runtime_ref["pid"], signal.SIGKILL)

    async def settle(self) -> None:
        await asyncio.sleep(0.2)


class TestLocalRuntimeContract(RuntimeContract):
    """The shared contract, on real worker processes."""

    @pytest.fixture
    def harness(self, make_runtime: MakeRuntime) -> LocalHarness:
        return LocalHarness(make_runtime)


#: Computes (as a worker importing its code does) until the file `argv[2]` exists, then
#: serves /healthz like a worker: the test decides when each start-up ends.
GATED_WORKER = """
import os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

while not os.path.exists(sys.argv[2]):
    sum(range(20000))

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


async def wait_started(fleet: str, worker_ids: set[str]) -> None:
    """Until exactly the processes of `worker_ids` exist in `fleet` (bounded)."""
    async with asyncio.timeout(EVENT_TIMEOUT_S):
        while {p.environ()["STOKER_WORKER_ID"] for p in fleet_processes(fleet)} != worker_ids:
            await asyncio.sleep(0.02)


async def test_start_ups_beyond_the_limit_queue_and_their_timeout_runs_from_their_start(
    make_runtime: MakeRuntime, tmp_path: Path
) -> None:
    """One start-up at a time: the others wait (cold first) and none fails for waiting
    longer than the spawn timeout, since its start-up had not begun."""
    rt, recorder = await make_runtime(start_limit=1)
    pool = make_pool(
        ("{python}", "-c", GATED_WORKER, "{port}", f"{tmp_path}/{{worker_id}}"), spawn_s=2.5
    )
    first, warm, cold = make_worker("first"), make_worker("warm"), make_worker("cold")
    cold = cold.evolve(org="acme")
    spawns = {w.id: asyncio.create_task(rt.spawn(w, pool)) for w in (first, warm)}
    await wait_started(rt.fleet, {first.id})
    spawns[cold.id] = asyncio.create_task(rt.spawn(cold, pool))
    await asyncio.sleep(2.0)
    # Only one process started; the warm spawn waits two seconds already, the cold one too.
    assert {p.environ()["STOKER_WORKER_ID"] for p in fleet_processes(rt.fleet)} == {first.id}
    assert (rt.startups.starting, rt.startups.queued) == (1, 2)
    (tmp_path / first.id).touch()
    await recorder.ready(first.id)
    # The cold spawn (a claim waits for it) goes before the warm one that came earlier.
    await wait_started(rt.fleet, {first.id, cold.id})
    (tmp_path / cold.id).touch()
    await recorder.ready(cold.id)
    await wait_started(rt.fleet, {first.id, cold.id, warm.id})
    # Queued for more than the spawn timeout already; its own start-up is young.
    await asyncio.sleep(1.0)
    (tmp_path / warm.id).touch()
    await recorder.ready(warm.id)
    for task in spawns.values():
        assert "pid" in await task
    assert not [event for event in recorder.events if event[0] == "lost"]
    assert rt.startups.peak == 1


async def test_a_worker_stopped_while_queued_never_starts(
    make_runtime: MakeRuntime, tmp_path: Path
) -> None:
    rt, recorder = await make_runtime(start_limit=1)
    pool = make_pool(("{python}", "-c", GATED_WORKER, "{port}", f"{tmp_path}/{{worker_id}}"))
    first, queued = make_worker("first"), make_worker("queued")
    started = asyncio.create_task(rt.spawn(first, pool))
    await wait_started(rt.fleet, {first.id})
    waiting = asyncio.create_task(rt.spawn(queued, pool))
    await asyncio.sleep(0.1)
    await rt.stop(queued, grace_s=1.0)
    with pytest.raises(SpawnWithdrawn):
        await waiting
    (tmp_path / first.id).touch()
    await started
    await recorder.ready(first.id)
    assert [p.environ()["STOKER_WORKER_ID"] for p in fleet_processes(rt.fleet)] == [first.id]
    assert recorder.of(queued.id) == []
    assert (rt.startups.starting, rt.startups.queued) == (0, 0)


def autogroup_nice(pid: str) -> int | None:
    """The nice value of a process's autogroup (None without autogroups, or where the
    kernel shows the file empty, as some container runtimes do)."""
    path = Path(f"/proc/{pid}/autogroup")
    fields = path.read_text().split() if path.exists() else []
    return int(fields[-1]) if fields else None


async def test_a_starting_worker_runs_nicer_than_the_control_plane(
    make_runtime: MakeRuntime, tmp_path: Path
) -> None:
    rt, _recorder = await make_runtime(start_nice=7)
    pool = make_pool(("{python}", "-c", GATED_WORKER, "{port}", f"{tmp_path}/{{worker_id}}"))
    ref = await rt.spawn(make_worker(), pool)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert psutil.Process(ref["pid"]).nice() == min(19, ours + 7)
    # Its session is its own autogroup: the group is made nicer too, else the process's
    # nice would count only against itself.
    own = autogroup_nice("self")
    if own is not None:
        assert autogroup_nice(str(ref["pid"])) == min(19, own + 7)


async def test_a_start_up_that_waits_rather_than_computes_gives_its_slot_on(
    make_runtime: MakeRuntime, tmp_path: Path
) -> None:
    rt, recorder = await make_runtime(start_limit=1)
    sleeper = ("{python}", "-c", "import time; time.sleep(60)")
    slow, next_one = make_worker("slow"), make_worker("next")
    await rt.spawn(slow, make_pool(sleeper, spawn_s=60))
    # Idle for a second, the sleeper lets the next start-up begin before it is ready.
    await asyncio.wait_for(rt.spawn(next_one, make_pool()), EVENT_TIMEOUT_S)
    await recorder.ready(next_one.id)
    assert recorder.of(slow.id) == []
