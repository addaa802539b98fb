"""The store's share of a claim: in-process claim+release cycles on SQLite and PostgreSQL.

    python benchmarks/store_cycles.py [--concurrency 24] [--seconds 5] [--rounds 2]
                                      [--postgres URL] [--pin]

A control plane in this process (no HTTP API in front), one pool of `--concurrency` real
demo workers with `activation: none`, so that what is measured is the control plane and
its store: `--concurrency` orgs each claim their parked worker and release it, over and
over, for `--seconds`, on a SQLite file and on a fresh PostgreSQL schema, in alternating
order. Prints, per store, cycles per second, the CPU this process used per cycle (user
and system) and, for PostgreSQL, the CPU of this machine's PostgreSQL processes per cycle.

`--pin` (Linux) pins this process to the first core and PostgreSQL's processes to the
last while PostgreSQL runs, as if the database had a core of its own: if the process's
CPU per cycle stays the same, it is the driver's work per statement, not the shared
cores, that costs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import uvloop

from chaos_soak import DEFAULT_POSTGRES
from core import make_plane
from stoker.adapters.postgres import PostgresStore
from stoker.adapters.sqlite import SqliteStore
from stoker.domain.records import ClaimRequest
from stoker.domain.specs import Activation
from stoker.domain.states import WorkerState
from stoker.ports.store import Store
from stores import postgres_cpu


def postgres_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] == "postgres"]


@contextlib.contextmanager
def pinned(on: bool) -> Iterator[None]:
    """This process on the first core, PostgreSQL's on the last, while the block runs."""
    cores = sorted(os.sched_getaffinity(0))
    if not on or len(cores) < 2:
        yield
        return
    me = psutil.Process()
    others = postgres_processes()
    before = {p.pid: p.cpu_affinity() for p in others}
    try:
        me.cpu_affinity(cores[:1])
        for process in others:
            with contextlib.suppress(psutil.Error):
                process.cpu_affinity(cores[-1:])
        yield
    finally:
        me.cpu_affinity(cores)
        for process in others:
            with contextlib.suppress(psutil.Error):
                process.cpu_affinity(before[process.pid])


async def one_run(args: argparse.Namespace, kind: str, tmp: Path) -> dict[str, float]:
    """Cycles of `--concurrency` orgs on a fresh store of `kind`."""
    schema = f"stoker_cycles_{uuid.uuid4().hex[:10]}"
    store: Store
    if kind == "postgres":
        store = PostgresStore(args.postgres, schema=schema)
    else:
        store = SqliteStore(str(tmp / f"{schema}.db"))
    plane = await make_plane(store, warm_target=args.concurrency, activation=Activation.NONE)
    try:
        await plane.run_janitor_pass()
        async with asyncio.timeout(120):
            while len(await store.list_workers(states=[WorkerState.WARM])) < args.concurrency:
                await asyncio.sleep(0.05)
        orgs = [f"org{i}" for i in range(args.concurrency)]
        # Each org claims once and parks its worker: the cycles reuse it.
        first = [await plane.claim(ClaimRequest(pool="demo", org=org)) for org in orgs]
        for claim in first:
            await plane.release(claim.id)
        cycles = 0
        deadline = time.monotonic() + args.seconds

        async def loop(org: str) -> None:
            nonlocal cycles
            while time.monotonic() < deadline:
                claim = await plane.claim(ClaimRequest(pool="demo", org=org))
                await plane.release(claim.id)
                cycles += 1

        with pinned(args.pin and kind == "postgres"):
            me, db = psutil.Process().cpu_times(), postgres_cpu()
            started = time.monotonic()
            await asyncio.gather(*(loop(org) for org in orgs))
            elapsed = time.monotonic() - started
            after, db_after = psutil.Process().cpu_times(), postgres_cpu()
        n = max(cycles, 1)
        figures = {
            "cycles/s": cycles / elapsed,
            "process CPU/cycle (ms)": 1000 * (after.user + after.system - me.user - me.system) / n,
            "process user CPU/cycle (ms)": 1000 * (after.user - me.user) / n,
        }
        if kind == "postgres":
            figures["database CPU/cycle (ms)"] = 1000 * (db_after - db) / n
        return figures
    finally:
        await plane.stop(stop_workers=True)
        if kind == "postgres":
            with psycopg.connect(args.postgres, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def main(args: argparse.Namespace) -> None:
    runs: dict[str, list[dict[str, float]]] = {"sqlite": [], "postgres": []}
    with tempfile.TemporaryDirectory(prefix="stoker-cycles-") as tmp:
        for round_ in range(args.rounds):
            order = ("sqlite", "postgres") if round_ % 2 == 0 else ("postgres", "sqlite")
            for kind in order:
                figures = await one_run(args, kind, Path(tmp))
                shown = ", ".join(f"{k} {v:.3f}" for k, v in figures.items())
                print(f"round {round_ + 1} {kind}: {shown}")
                runs[kind].append(figures)
    pin = " (PostgreSQL pinned to a core of its own)" if args.pin else ""
    print(f"{args.concurrency} orgs cycling, {args.rounds} rounds, medians{pin}:")
    for name in runs["postgres"][0]:
        line = f"  {name:28s}"
        for kind in runs:
            if name in runs[kind][0]:
                line += f" | {kind} {statistics.median(r[name] for r in runs[kind]):8.3f}"
        print(line)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=24, help="orgs cycling at once")
    parser.add_argument("--seconds", type=float, default=5.0, help="cycling time per run")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both stores")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("STOKER_TEST_POSTGRES_URL", DEFAULT_POSTGRES),
    )
    parser.add_argument(
        "--pin", action="store_true", help="PostgreSQL's processes on a core of their own"
    )
    return parser.parse_args()


if __name__ == "__main__":
    uvloop.run(main(parse()))
