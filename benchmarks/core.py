"""Core-engine figures with real demo-worker processes (no HTTP API in front).

    python benchmarks/core.py [--workers 30] [--cycles 2000]

Prints:
  1. time from 30 simultaneous misses to 30 warm workers (one reconcile tick + start-up);
  2. claims per second and p50/p99 latency of the in-process claim path, warm and reuse
     (activation of the real worker included), and the same with `activation: none` to
     show the control plane's own share;
  3. memory of one idle demo worker (RSS and USS).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil

from stoker.adapters.activator_http import HttpActivator
from stoker.adapters.runtime_local import LocalProcessRuntime
from stoker.adapters.sqlite import SqliteStore
from stoker.control.plane import ControlPlane
from stoker.domain.activation import ActivationKey
from stoker.domain.records import ClaimRequest
from stoker.domain.specs import Activation, PlaneSettings, PoolSpec, ProcessTemplate
from stoker.domain.states import ClaimMode, WorkerState
from stoker.ports.clock import LoopClock
from stoker.ports.store import Store

DEMO = ProcessTemplate(
    argv=("{python}", "-m", "stoker.demo_worker", "--port", "{port}", "--worker-id", "{worker_id}"),
    memory_mb=32,
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def make_plane(store: Store, **pool: Any) -> ControlPlane:
    """A started control plane (no background loops) on `store`, with one pool `demo` of
    real demo workers (`pool`: its settings)."""
    clock = LoopClock()
    # Wired as bootstrap wires a server: readiness probes on the activator's connections.
    key = ActivationKey(secrets.token_bytes(32))
    activator = HttpActivator(activation_key=key)
    plane = ControlPlane(
        store=store,
        runtime=LocalProcessRuntime(
            clock=clock,
            fleet="bench-" + uuid.uuid4().hex[:6],
            instance_id="bench",
            activation_key=key,
            probe_session=activator.session,
        ),
        activator=activator,
        pools=[PoolSpec(name="demo", template=DEMO, **pool)],
        settings=PlaneSettings(janitor_interval_s=3600, reaper_interval_s=3600),
        clock=clock,
    )
    await plane.start(loops=False)
    return plane


async def wait_for(check: Callable[[], Awaitable[bool]], timeout: float = 120.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.005)


async def misses_to_warm(tmp: Path, n: int) -> None:
    plane = await make_plane(SqliteStore(str(tmp / "ramp.db")), warm_target=0)
    try:
        claims = [
            asyncio.create_task(
                plane.claim(
                    ClaimRequest(
                        pool="demo", org=f"t{i}", mode=ClaimMode.REQUIRE_WARM, timeout_s=120
                    )
                )
            )
            for i in range(n)
        ]
        await asyncio.sleep(0.05)  # every claim has missed and is queued
        t0 = time.perf_counter()
        report = await plane.run_janitor_pass()
        tick = time.perf_counter() - t0
        await asyncio.gather(*claims)
        bound = time.perf_counter() - t0
        print(
            f"[ramp] {n} simultaneous misses -> one reconcile tick reserved "
            f"{report.spawned.get('demo', 0)} slots in {tick * 1000:.1f} ms"
        )
        print(
            f"[ramp] all {n} workers started, warm and bound to their claims after "
            f"{bound:.2f} s (process start + readiness + activation)"
        )
    finally:
        await plane.stop(stop_workers=True)


async def claim_path(tmp: Path, cycles: int, activation: Activation) -> None:
    plane = await make_plane(
        SqliteStore(str(tmp / f"path-{activation}.db")), warm_target=64, activation=activation
    )
    try:
        await wait_for(lambda: _count(plane, WorkerState.WARM, 64))
        # Warm path: claims of distinct orgs take neutral workers (no release in between).
        warm: list[float] = []
        for i in range(60):
            t0 = time.perf_counter()
            claim = await plane.claim(ClaimRequest(pool="demo", org=f"org{i}"))
            warm.append(time.perf_counter() - t0)
            await plane.release(claim.id)
        # Reuse path: one org claims and releases the same parked worker, over and over.
        reuse: list[float] = []
        t_start = time.perf_counter()
        for _ in range(cycles):
            t0 = time.perf_counter()
            claim = await plane.claim(ClaimRequest(pool="demo", org="org0"))
            reuse.append(time.perf_counter() - t0)
            await plane.release(claim.id)
        elapsed = time.perf_counter() - t_start
        label = "activation over HTTP" if activation is Activation.HTTP else "activation: none"
        print(
            f"[claim path, {label}] warm:  p50 {percentile(warm, 0.5) * 1e3:.2f} ms  "
            f"p99 {percentile(warm, 0.99) * 1e3:.2f} ms  (n={len(warm)})"
        )
        print(
            f"[claim path, {label}] reuse: p50 {percentile(reuse, 0.5) * 1e3:.2f} ms  "
            f"p99 {percentile(reuse, 0.99) * 1e3:.2f} ms  "
            f"mean {statistics.mean(reuse) * 1e3:.2f} ms  (n={cycles})"
        )
        print(
            f"[claim path, {label}] {cycles / elapsed:.0f} claim+release cycles/s, "
            f"{cycles / sum(reuse):.0f} claims/s (claim time only)"
        )
    finally:
        await plane.stop(stop_workers=True)


async def _count(plane: ControlPlane, state: WorkerState, n: int) -> bool:
    return len(await plane.store.list_workers(states=[state])) >= n


async def idle_memory(tmp: Path) -> None:
    plane = await make_plane(SqliteStore(str(tmp / "mem.db")), warm_target=5)
    try:
        await wait_for(lambda: _count(plane, WorkerState.WARM, 5))
        await asyncio.sleep(1.0)
        rss, uss = [], []
        for w in await plane.store.list_workers(states=[WorkerState.WARM]):
            info = psutil.Process(int(w.runtime_ref["pid"])).memory_full_info()
            rss.append(info.rss / 2**20)
            uss.append(info.uss / 2**20)
        print(
            f"[memory] idle demo worker: RSS {statistics.median(rss):.1f} MiB, "
            f"USS {statistics.median(uss):.1f} MiB (median of {len(rss)})"
        )
    finally:
        await plane.stop(stop_workers=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=30)
    parser.add_argument("--cycles", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        await misses_to_warm(Path(tmp), args.workers)
        await claim_path(Path(tmp), args.cycles, Activation.HTTP)
        await claim_path(Path(tmp), args.cycles, Activation.NONE)
        await idle_memory(Path(tmp))


if __name__ == "__main__":
    asyncio.run(main())
