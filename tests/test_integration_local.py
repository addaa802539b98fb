"""The whole core engine with real demo-worker processes and a real SQLite file.

These tests wait on real processes (spawn, readiness, exit), so they run on real time;
TTLs and instance expiry are jumped over with `VirtualClock.advance` instead of waited
for, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from fakes import TEST_ACTIVATION_KEY
from stoker.adapters.activator_http import HttpActivator
from stoker.adapters.runtime_local import LocalProcessRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.domain.errors import CapacityError
from stoker.domain.records import Claim, ClaimRequest, Worker
from stoker.domain.specs import PlaneSettings, PoolSpec, ProcessTemplate
from stoker.domain.states import ClaimSource, ClaimState, WorkerState
from stoker.ports.clock import VirtualClock
from stoker.worker import SECRET_ENV

pytestmark = pytest.mark.processes

S = WorkerState
DEMO = ProcessTemplate(
    argv=("{python}", "-m", "stoker.demo_worker", "--port", "{port}", "--worker-id", "{worker_id}"),
    memory_mb=32,
)


def demo_pool(**kw: Any) -> PoolSpec:
    base: dict[str, Any] = {"name": "demo", "template": DEMO, "warm_target": 2, "hot_idle_ttl": 60}
    base.update(kw)
    return PoolSpec(**base)


@asynccontextmanager
async def plane_on(
    db: Path, fleet: str, clock: VirtualClock, *, stop_workers: bool = True, **pool_kw: Any
) -> AsyncIterator[ControlPlane]:
    """A started plane on the SQLite file `db` whose workers carry the label `fleet`."""
    store = SqliteStore(str(db))
    plane = ControlPlane(
        store=store,
        runtime=LocalProcessRuntime(
            clock=clock, fleet=fleet, instance_id="unused", activation_key=TEST_ACTIVATION_KEY
        ),
        activator=HttpActivator(activation_key=TEST_ACTIVATION_KEY),
        pools=[demo_pool(**pool_kw)],
        settings=PlaneSettings(janitor_interval_s=3600, reaper_interval_s=3600),
        clock=clock,
    )
    await plane.start(loops=False)
    try:
        yield plane
    finally:
        await plane.stop(stop_workers=stop_workers)


async def eventually(check: Callable[[], Any], *, timeout: float = 15.0) -> None:
    """Poll an async predicate until it holds (real processes answer in real time)."""
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)


async def warm_count(plane: ControlPlane) -> int:
    return len(await plane.store.list_workers(states=[S.WARM]))


async def get_worker(plane: ControlPlane, worker_id: str) -> Worker:
    worker = await plane.store.get_worker(worker_id)
    assert worker is not None
    return worker


def pid_of(worker: Worker) -> int:
    return int(worker.runtime_ref["pid"])


def fleet_processes(fleet: str) -> set[int]:
    found = set()
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("STOKER_FLEET") == fleet:
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


async def whoami(client: httpx.AsyncClient, claim: Claim) -> dict[str, Any]:
    response = await client.get(
        claim.endpoint + "/", headers={"Authorization": f"Bearer {claim.token}"}
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.fixture
def fleet() -> str:
    return "test-" + uuid.uuid4().hex[:8]


@pytest.fixture
def no_leftovers(fleet: str) -> Any:
    """Fails the test if any worker process of its fleet outlives it."""
    yield
    leftover = fleet_processes(fleet)
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert leftover == set()


async def test_claim_use_release_reuse_isolate_and_reap(
    tmp_path: Path, fleet: str, no_leftovers: None
) -> None:
    clock = VirtualClock(epoch=None)
    async with plane_on(tmp_path / "s.db", fleet, clock) as plane, httpx.AsyncClient() as http:
        await eventually(lambda: _at_least(plane, 2))

        # Claim a warm worker and talk to it as the session.
        first = await plane.claim(
            ClaimRequest(pool="demo", org="acme", config={"dsn": "x", "role": "ro"})
        )
        assert first.source is ClaimSource.WARM
        seen = await whoami(http, first)
        assert seen == {
            "worker_id": first.worker_id,
            "org": "acme",
            "epoch": first.worker_epoch,
            "config_keys": ["dsn", "role"],
        }
        unauthenticated = await http.get(first.endpoint + "/")
        assert unauthenticated.status_code == 401

        # Release parks it; the same org gets the very same process back, newer epoch.
        await plane.release(first.id)
        parked = await get_worker(plane, first.worker_id)
        assert parked.state is S.HOT_IDLE
        second = await plane.claim(ClaimRequest(pool="demo", org="acme"))
        assert second.source is ClaimSource.REUSE
        assert second.worker_id == first.worker_id
        assert (await whoami(http, second))["epoch"] == second.worker_epoch > first.worker_epoch
        stale = await http.get(
            first.endpoint + "/", headers={"Authorization": f"Bearer {first.token}"}
        )
        assert stale.status_code == 401  # the previous session's token is revoked
        await plane.release(second.id)

        # Another org never gets it.
        others = [await plane.claim(ClaimRequest(pool="demo", org=f"o{i}")) for i in range(3)]
        assert first.worker_id not in {c.worker_id for c in others}
        for claim in others:
            assert (await whoami(http, claim))["org"] == claim.org
            await plane.release(claim.id)

        # Past its TTL the parked worker is reaped and its process is gone.
        reaped_pid = pid_of(await get_worker(plane, first.worker_id))
        clock.advance(61)
        await plane.run_janitor_pass()
        await eventually(lambda: _retired(plane, first.worker_id))
        assert (await get_worker(plane, first.worker_id)).reason == "ttl"
        assert not psutil.pid_exists(reaped_pid) or psutil.Process(reaped_pid).status() == (
            psutil.STATUS_ZOMBIE
        )


async def test_a_template_with_a_number_in_its_env_fails_its_spawns_at_once(
    tmp_path: Path, fleet: str, no_leftovers: None
) -> None:
    """`env: {"A": 1}` (stored before the API checked it) cannot start a process: each
    try retires its slot at once as a counted spawn failure that says why, and the back-off
    holds the pool's other spawns (no row left `spawning` for the spawn timeout, no crash
    loop of tries)."""
    bad = ProcessTemplate(argv=DEMO.argv, env={"A": 1})  # type: ignore[dict-item]
    async with plane_on(tmp_path / "s.db", fleet, VirtualClock(), template=bad) as plane:
        rows = await plane.store.list_workers()
        assert [(w.state, w.reason) for w in rows if w.state is S.RETIRED] == [
            (S.RETIRED, "spawn_failure")
        ]
        # The other slot of the start's pass waits for its turn, created nowhere.
        assert [w.state for w in rows if w.state is not S.RETIRED] == [S.SPAWNING]
        [status] = await plane.pool_status()
        assert status.spawn_failing and status.spawn_failures == 1
        assert "not int" in (status.last_spawn_error or "")


async def test_a_worker_that_exits_before_ready_says_how_in_the_pool_and_the_claim(
    tmp_path: Path, fleet: str, no_leftovers: None
) -> None:
    """A worker command that exits at once: the pool's `last_spawn_error` and the 503 of
    a claim that found no worker say how it ended (its exit code), not only the runtime's
    log, and never what it printed (here, its activation secret)."""
    code = f"import os, sys; print(os.environ[{SECRET_ENV!r}], file=sys.stderr); sys.exit(3)"
    exits = ProcessTemplate(argv=(sys.executable, "-c", code), memory_mb=32)
    # The virtual clock never ends the back-off: the pool stays failing as it first failed.
    async with plane_on(tmp_path / "s.db", fleet, VirtualClock(), template=exits) as plane:
        await eventually(lambda: _spawn_failing(plane))
        [status] = await plane.pool_status()
        error = status.last_spawn_error or ""
        assert error.endswith("spawn_failure before ready: exited with code 3"), error
        with pytest.raises(CapacityError) as refused:
            await plane.claim(ClaimRequest(pool="demo", org="acme", timeout_s=0.2))
        assert refused.value.reason == "spawn_failing"
        assert "exited with code 3" in str(refused.value)
        failed = await plane.store.list_workers(states=[S.RETIRED])
        secrets = [TEST_ACTIVATION_KEY.worker_secret(w.id) for w in failed]
        assert secrets and not any(s in error + str(refused.value) for s in secrets)


async def test_killed_worker_process_is_replaced_to_target(
    tmp_path: Path, fleet: str, no_leftovers: None
) -> None:
    clock = VirtualClock(epoch=None)
    async with plane_on(tmp_path / "s.db", fleet, clock) as plane:
        await eventually(lambda: _at_least(plane, 2))
        victim = (await plane.store.list_workers(states=[S.WARM]))[0]
        os.kill(pid_of(victim), signal.SIGKILL)
        await eventually(lambda: _retired(plane, victim.id))
        assert (await get_worker(plane, victim.id)).reason == "lost"
        await plane.run_janitor_pass()
        await eventually(lambda: _at_least(plane, 2))
        assert victim.id not in {w.id for w in await plane.store.list_workers(states=[S.WARM])}


async def test_killed_hot_worker_fails_its_session(
    tmp_path: Path, fleet: str, no_leftovers: None
) -> None:
    clock = VirtualClock(epoch=None)
    async with plane_on(tmp_path / "s.db", fleet, clock) as plane:
        await eventually(lambda: _at_least(plane, 2))
        claim = await plane.claim(ClaimRequest(pool="demo", org="acme"))
        os.kill(pid_of(await get_worker(plane, claim.worker_id)), signal.SIGKILL)
        await eventually(lambda: _claim_in(plane, claim.id, ClaimState.FAILED))
        failed = await plane.get_claim(claim.id)
        assert failed.reason == "worker_lost"


async def test_restarted_control_plane_adopts_live_workers(
    tmp_path: Path, fleet: str, no_leftovers: None
) -> None:
    clock = VirtualClock(epoch=None)
    db = tmp_path / "s.db"
    async with plane_on(db, fleet, clock, stop_workers=False) as plane:
        await eventually(lambda: _at_least(plane, 2))
        session = await plane.claim(ClaimRequest(pool="demo", org="acme"))
        parked = await plane.claim(ClaimRequest(pool="demo", org="globex"))
        await plane.release(parked.id)
        before = {w.id: pid_of(w) for w in await plane.store.list_workers(states=[S.HOT])}
        before |= {w.id: pid_of(w) for w in await plane.store.list_workers(states=[S.HOT_IDLE])}

    # The processes outlive the control plane...
    assert all(psutil.pid_exists(pid) for pid in before.values())

    async with plane_on(db, fleet, clock) as plane, httpx.AsyncClient() as http:
        # ...and the next start adopts them: same pids, owned by the new instance.
        for worker_id, pid in before.items():
            adopted = await get_worker(plane, worker_id)
            assert adopted.owner == plane.instance_id
            assert pid_of(adopted) == pid
        assert (await whoami(http, session))["org"] == "acme"  # the session kept running
        again = await plane.claim(ClaimRequest(pool="demo", org="globex"))
        assert again.source is ClaimSource.REUSE
        assert again.worker_id == parked.worker_id
        assert (await plane.release(session.id)).state is ClaimState.RELEASED
        # The adopted process is watched: its death is noticed.
        os.kill(before[parked.worker_id], signal.SIGKILL)
        await eventually(lambda: _claim_in(plane, again.id, ClaimState.FAILED))


async def test_a_session_held_across_a_graceful_restart_counts_its_whole_hold(
    tmp_path: Path, fleet: str, no_leftovers: None
) -> None:
    """The worker processes outlive a clean stop and the next start adopts them: the
    ledger's hot time of the claim held across the restart is its hold in the claim log,
    the seconds between the stop and the adoption included."""
    clock = VirtualClock(epoch=None)
    db = tmp_path / "s.db"
    async with plane_on(db, fleet, clock, stop_workers=False) as plane:
        await eventually(lambda: _at_least(plane, 2))
        session = await plane.claim(ClaimRequest(pool="demo", org="acme"))
        clock.advance(20)
    clock.advance(9)  # the restart
    async with plane_on(db, fleet, clock) as plane:
        assert (await get_worker(plane, session.worker_id)).owner == plane.instance_id
        clock.advance(30)
        await plane.release(session.id)
        await plane.run_reaper_pass()
        now = clock.now()
        hot = sum(c.hot_s for _, c in await plane.store.read_ledger("demo", since=0, until=now))
        (logged,) = await plane.store.read_claim_log(since=0, until=now + 1)
        assert logged.id == session.id and logged.held_s is not None
        assert logged.held_s == pytest.approx(59.0, abs=2.0)
        assert hot == pytest.approx(logged.held_s, abs=0.05)


async def test_a_crashed_control_planes_workers_are_adopted_after_expiry(
    tmp_path: Path, fleet: str, no_leftovers: None
) -> None:
    clock = VirtualClock(epoch=None)
    db = tmp_path / "s.db"
    crashed = ControlPlane(
        store=SqliteStore(str(db)),
        runtime=LocalProcessRuntime(
            clock=clock, fleet=fleet, instance_id="crashed", activation_key=TEST_ACTIVATION_KEY
        ),
        activator=HttpActivator(activation_key=TEST_ACTIVATION_KEY),
        pools=[demo_pool()],
        clock=clock,
    )
    await crashed.start(loops=False)
    await eventually(lambda: _at_least(crashed, 2))
    orphans = {w.id for w in await crashed.store.list_workers(states=[S.WARM])}
    # A crash: no clean shutdown, the instance row stays "active" with an old heartbeat.
    await crashed.runtime.close()
    await crashed.activator.close()
    await crashed.store.close()

    async with plane_on(db, fleet, clock) as plane:
        still_theirs = await plane.store.list_workers(states=[S.WARM])
        assert {w.owner for w in still_theirs} == {crashed.instance_id}
        clock.advance(PlaneSettings().instance_expiry_s + 1)
        report = await plane.run_janitor_pass()
        assert report.adopted == 2
        adopted = await plane.store.list_workers(states=[S.WARM])
        assert {w.id for w in adopted} == orphans
        assert {w.owner for w in adopted} == {plane.instance_id}


async def test_stranded_process_without_a_row_is_stopped(
    tmp_path: Path, fleet: str, no_leftovers: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stoker")
    clock = VirtualClock(epoch=None)
    async with plane_on(tmp_path / "s.db", fleet, clock) as plane:
        await eventually(lambda: _at_least(plane, 2))
        # The interpreter itself, not a launcher that forks (a pyenv shim): one process.
        stray = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "import time; time.sleep(600)",
            env={**os.environ, "STOKER_FLEET": fleet, "STOKER_WORKER_ID": "w-stray"},
            start_new_session=True,
        )
        # An instant after `exec` (longer on a loaded machine) its environment reads
        # empty: a pass then would not see it yet (the next one would).
        await eventually(lambda: _labelled(stray.pid, fleet))
        clock.advance(PlaneSettings().stranded_grace_s + 1)
        report = await plane.run_janitor_pass()
        # Only the stray: the pool's own workers have rows (the pass's log says why not).
        stopped = [r.getMessage() for r in caplog.records if "event=stranded" in r.getMessage()]
        events = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=")]
        assert report.stranded_stopped == 1, "\n".join(events[-40:])
        assert len(stopped) == 1 and "worker=w-stray" in stopped[0], stopped
        async with asyncio.timeout(15):
            assert await stray.wait() != 0


async def _labelled(pid: int, fleet: str) -> bool:
    try:
        return psutil.Process(pid).environ().get("STOKER_FLEET") == fleet
    except psutil.Error:
        return False


async def _spawn_failing(plane: ControlPlane) -> bool:
    return any(status.spawn_failing for status in await plane.pool_status())


async def _at_least(plane: ControlPlane, n: int) -> bool:
    return await warm_count(plane) >= n


async def _retired(plane: ControlPlane, worker_id: str) -> bool:
    return (await get_worker(plane, worker_id)).state is S.RETIRED


async def _claim_in(plane: ControlPlane, claim_id: str, state: ClaimState) -> bool:
    return (await plane.get_claim(claim_id)).state is state


#: Stops of a plane with spawns in flight (each a fresh plane): enough to meet every moment
#: a spawn can be in (waiting for the bucket, queued for a start-up slot, granted a slot,
#: starting, probing) a few times over.
STOPS_DURING_SPAWNS = 50


@pytest.mark.slow
async def test_a_stop_during_spawns_leaves_no_process(tmp_path: Path, fleet: str) -> None:
    """A worker process that outlived its plane's stop was a leak: a spawn granted a
    start-up slot (not yet resumed) when the stop retired its row started its process
    afterwards, for a retired row. Another: a spawn recorded its ref while the workers
    listed before it retired, so its retirement missed its fence, and the last sweep's
    /proc scan, run an instant after that spawn's `exec`, read its environment empty.
    Stopped at every moment of its spawns, no plane leaves a process behind."""
    rng = random.Random(7)
    for i in range(STOPS_DURING_SPAWNS):
        clock = VirtualClock(epoch=None)
        store = SqliteStore(str(tmp_path / f"s{i}.db"))
        plane = ControlPlane(
            store=store,
            runtime=LocalProcessRuntime(
                clock=clock,
                fleet=fleet,
                instance_id="unused",
                activation_key=TEST_ACTIVATION_KEY,
                # One start-up at a time: most spawns queue, and one is granted at each end.
                start_limit=1,
            ),
            activator=HttpActivator(activation_key=TEST_ACTIVATION_KEY),
            pools=[demo_pool(warm_target=4)],
            settings=PlaneSettings(janitor_interval_s=3600, reaper_interval_s=3600),
            clock=clock,
        )
        await plane.start(loops=False)
        await asyncio.sleep(rng.uniform(0.0, 0.6))
        await plane.stop(stop_workers=True)
        left = fleet_processes(fleet)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert left == set(), f"stop {i}: processes outlived the plane"
