"""The logs of ended local workers are deleted by their retention, on virtual time.

`expired` is the rule; `WorkerLogs` applies it to a real `log_dir` (with the machine's
processes injected); the runtime applies it every `PRUNE_INTERVAL_S` of its clock to the
logs of real worker processes, and never to a live worker's.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Collection
from pathlib import Path

import pytest

from fakes import TEST_ACTIVATION_KEY
from runtime_contract import Recorder
from stoker.adapters.runtime_local import LocalProcessRuntime, LogRetention
from stoker.adapters.runtime_local._retention import (
    PRUNE_INTERVAL_S,
    EndedLog,
    WorkerLogs,
    expired,
)
from stoker.bootstrap import build_control_plane
from stoker.config import LocalRuntimeConfig, StokerConfig, load_config
from stoker.domain.errors import ConfigError
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec, ProcessTemplate
from stoker.domain.states import WorkerState
from stoker.ports.clock import VirtualClock

DAY = 86400.0


def test_expired_keeps_the_most_recently_ended_and_the_young() -> None:
    logs = [EndedLog(f"w-{i}", ended_at=1000.0 + i) for i in range(5)]
    # By number: the three most recently ended stay.
    assert sorted(expired(logs, LogRetention(keep=3, keep_s=None), now=2000)) == ["w-0", "w-1"]
    # By age: those that ended more than 997.5 s before now go.
    assert sorted(expired(logs, LogRetention(keep=None, keep_s=997.5), now=2000)) == [
        "w-0",
        "w-1",
        "w-2",
    ]
    # Both bounds: the stricter one for each log.
    assert sorted(expired(logs, LogRetention(keep=4, keep_s=998.5), now=2000)) == [
        "w-0",
        "w-1",
    ]
    assert expired(logs, LogRetention(keep=None, keep_s=None), now=10**9) == []


def test_failed_spawns_are_counted_apart() -> None:
    # A busy pool's 5 ended sessions do not push out the one failed spawn's log.
    ended = [EndedLog(f"w-s{i}", ended_at=100.0 + i) for i in range(5)]
    failed = [EndedLog("w-f0", ended_at=10.0, failed=True)]
    gone = expired(ended + failed, LogRetention(keep=2, keep_s=None), now=200)
    assert sorted(gone) == ["w-s0", "w-s1", "w-s2"]
    # Age bounds them alike.
    assert "w-f0" in expired(ended + failed, LogRetention(keep=2, keep_s=150), now=200)


def write_log(log_dir: Path, name: str, *, written: float | None = None) -> Path:
    path = log_dir / name
    path.write_text("output\n")
    if written is not None:
        os.utime(path, (written, written))
    return path


async def test_worker_logs_delete_ended_logs_past_their_retention(tmp_path: Path) -> None:
    # Mapped onto wall time: files' modification times compare with `now`.
    clock = VirtualClock(epoch=None)
    running: set[str] = {"w-other-fleet"}
    logs = WorkerLogs(
        str(tmp_path),
        LogRetention(keep=2, keep_s=DAY),
        clock,
        running=lambda: set(running),
    )
    now = clock.now()
    old_run = write_log(tmp_path, "w-old-run.log", written=now - 2 * DAY)
    fresh_run = write_log(tmp_path, "w-fresh-run.log", written=now - 60)
    foreign = write_log(tmp_path, "w-other-fleet.log", written=now - 30 * DAY)
    watched = write_log(tmp_path, "w-watched.log", written=now - 30 * DAY)
    unrelated = [write_log(tmp_path, "notes.log", written=now - 30 * DAY)]
    unrelated.append(write_log(tmp_path, "w-x.txt", written=now - 30 * DAY))
    ended = [write_log(tmp_path, f"w-e{i}.log") for i in range(3)]

    def watching() -> Collection[str]:
        return {"w-watched"}

    for i in range(3):
        logs.ended(f"w-e{i}")
        clock.advance(1)
    gone = await logs.prune(watching)
    # A file of an earlier run counts from its last write: a day old, it goes. Of the
    # rest, the two most recently ended stay (w-e2, w-e1).
    assert sorted(gone) == ["w-e0", "w-fresh-run", "w-old-run"]
    assert not old_run.exists() and not fresh_run.exists() and not ended[0].exists()
    assert ended[1].exists() and ended[2].exists()
    # Live workers' logs (any fleet's process, or one the runtime watches) and files that
    # are no worker's log are never touched.
    assert foreign.exists() and watched.exists() and all(p.exists() for p in unrelated)

    # A day after they ended, the kept ones go too; the live ones still stay.
    clock.advance(DAY)
    assert sorted(await logs.prune(watching)) == ["w-e1", "w-e2"]
    assert foreign.exists() and watched.exists()
    # Once its worker ended, a foreign worker's old log is as any other.
    running.clear()
    assert await logs.prune(watching) == ["w-other-fleet"]


async def test_a_failed_spawn_keeps_its_log_while_sessions_end(tmp_path: Path) -> None:
    clock = VirtualClock(epoch=None)
    logs = WorkerLogs(str(tmp_path), LogRetention(keep=1, keep_s=None), clock, running=set)
    write_log(tmp_path, "w-failed.log")
    logs.ended("w-failed", failed=True)
    # Its exit after the kill does not make it an ordinary end.
    logs.ended("w-failed")
    for i in range(3):
        write_log(tmp_path, f"w-s{i}.log")
        clock.advance(1)
        logs.ended(f"w-s{i}")
    assert sorted(await logs.prune(set)) == ["w-s0", "w-s1"]
    assert (tmp_path / "w-failed.log").exists() and (tmp_path / "w-s2.log").exists()


def worker(pool: str = "demo") -> Worker:
    return Worker(
        id=f"w-{uuid.uuid4().hex[:8]}",
        pool=pool,
        revision="r1",
        state=WorkerState.SPAWNING,
        epoch=0,
        owner="cp-test",
        created_at=0.0,
        updated_at=0.0,
    )


DEMO = PoolSpec(
    name="demo",
    template=ProcessTemplate(
        argv=(
            "{python}",
            "-m",
            "stoker.demo_worker",
            "--port",
            "{port}",
            "--worker-id",
            "{worker_id}",
        ),
        memory_mb=32,
    ),
)


async def eventually_gone(path: Path, *, within_s: float = 10.0) -> None:
    """Wait (a bounded while) for the runtime's pruning, run in a thread, to delete `path`."""
    async with asyncio.timeout(within_s):
        while await asyncio.to_thread(path.exists):
            await asyncio.sleep(0.02)


@pytest.mark.processes
async def test_the_runtime_deletes_ended_workers_logs_every_interval(tmp_path: Path) -> None:
    clock = VirtualClock(epoch=None)
    log_dir = tmp_path / "logs"
    rt = LocalProcessRuntime(
        clock=clock,
        fleet=f"test-{uuid.uuid4().hex[:8]}",
        instance_id="cp-test",
        activation_key=TEST_ACTIVATION_KEY,
        log_dir=str(log_dir),
        log_retention=LogRetention(keep=1, keep_s=None),
    )
    recorder = Recorder()
    rt.subscribe(recorder)
    await rt.start()
    workers: list[Worker] = []
    try:
        for _ in range(3):
            w = worker()
            ref = await rt.spawn(w, DEMO)
            await recorder.ready(w.id)
            workers.append(w.evolve(runtime_ref=dict(ref)))
        first, second, live = workers
        await rt.stop(first, grace_s=5.0)
        clock.advance(1)
        await rt.stop(second, grace_s=5.0)
        logs = {w.id: log_dir / f"{w.id}.log" for w in workers}
        assert all(path.exists() for path in logs.values())
        # The next pruning, one interval on, keeps the most recently ended worker's log
        # and the live one's.
        clock.advance(PRUNE_INTERVAL_S)
        await eventually_gone(logs[first.id])
        assert logs[second.id].exists() and logs[live.id].exists()
        assert await rt.prune_logs() == []
    finally:
        for w in workers:
            await rt.stop(w, grace_s=5.0)
        await rt.close()


def test_the_retention_keys_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "stoker.yaml"
    path.write_text("runtime: {log_dir: ./logs, log_keep: 20, log_keep_s: 3600}\n")
    runtime = load_config(path, {}).config.runtime
    assert isinstance(runtime, LocalRuntimeConfig)
    assert (runtime.log_keep, runtime.log_keep_s) == (20, 3600)
    # Null: no bound of that kind (the logs of ended workers are kept as before).
    path.write_text("runtime: {log_keep: null, log_keep_s: null}\n")
    runtime = load_config(path, {}).config.runtime
    assert isinstance(runtime, LocalRuntimeConfig)
    assert (runtime.log_keep, runtime.log_keep_s) == (None, None)
    # By default: the last 100 ended workers' logs, for a week.
    assert LocalRuntimeConfig().log_keep == 100 and LocalRuntimeConfig().log_keep_s == 7 * DAY
    for bad, key in (
        ("log_keep: 0", "runtime.log_keep"),
        ("log_keep: -1", "runtime.log_keep"),
        ("log_keep_s: 30", "runtime.log_keep_s"),
        ("log_keep_s: .inf", "runtime.log_keep_s"),
        ("log_keep_s: 'a week'", "runtime.log_keep_s"),
    ):
        path.write_text(f"runtime: {{{bad}}}\n")
        with pytest.raises(ConfigError, match=rf"config error: {key}: "):
            load_config(path, {})


async def test_the_retention_reaches_the_runtime(tmp_path: Path) -> None:
    runtime = {"log_dir": str(tmp_path / "logs"), "log_keep": 5, "log_keep_s": 3600}
    config = StokerConfig.model_validate(
        {"store": f"sqlite:///{tmp_path}/stoker.db", "runtime": runtime}
    )
    built = build_control_plane(config).runtime
    assert isinstance(built, LocalProcessRuntime) and built.logs is not None
    assert built.logs.retention == LogRetention(keep=5, keep_s=3600)
    # Without a log_dir there is nothing to keep or delete.
    bare = build_control_plane(StokerConfig(store=f"sqlite:///{tmp_path}/other.db")).runtime
    assert isinstance(bare, LocalProcessRuntime) and bare.logs is None
