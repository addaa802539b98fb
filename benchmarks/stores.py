"""The same claim workload on SQLite and on PostgreSQL, side by side in one run.

    python benchmarks/stores.py [--workers 96] [--concurrency 24] [--duration 8] [--rounds 2]
                                [--postgres postgresql://postgres@127.0.0.1:5432/test]
                                [--profile DIR] [--baseline SRC]

Each round starts `stoker serve` (real demo workers, uvloop, default logging) once on a
SQLite file and on fresh PostgreSQL schemas (as configured by default, and with
`synchronous_commit: false`), in alternating order, with one pool of exactly `--workers`
warm workers, and measures (see `claim_burst.py`, whose phases these are):

  1. a burst of `--workers` simultaneous claims from as many orgs;
  2. `--concurrency` of those orgs each claiming its parked worker and releasing it, for
     `--duration` seconds.

It prints each run, then the median of each figure per store and the median of the
paired ratios to SQLite, with the CPU the server, the whole machine and, for PostgreSQL,
the database's own processes used per claim+release cycle, and the rate PostgreSQL's CPU
per cycle would allow at most with every core busy (everything runs on the same cores).
The round trips per claim and release are counted (and asserted) in
tests/adapters/test_store_round_trips.py.

With `--baseline SRC` (the `src` folder of another version of stoker), each round runs
SQLite and PostgreSQL (as configured by default) on that version too (its servers started
with `PYTHONPATH=SRC`, named `...@base`), in the alternating order: each version's
PostgreSQL is compared with its own SQLite, and this version's figures with the
baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import uuid
from pathlib import Path

import aiohttp
import psutil
import psycopg
import uvloop

import claim_burst as cb

#: The stores measured: SQLite, PostgreSQL as configured by default, and PostgreSQL with
#: `store_options.synchronous_commit: false` (commits not waiting for the disk, about the
#: durability of SQLite's default).
STORES = ("sqlite", "postgres", "postgres-async")
#: The stores measured with `--baseline`: each on this version and on the baseline.
AB_STORES = ("sqlite", "postgres", "sqlite@base", "postgres@base")


def postgres_cpu() -> float:
    """CPU seconds used so far by the PostgreSQL server processes of this machine."""
    used = 0.0
    for process in psutil.process_iter(["name"]):
        if process.info["name"] in ("postgres", "postmaster"):
            try:
                t = process.cpu_times()
            except psutil.Error:
                continue
            used += t.user + t.system
    return used


async def one_run(args: argparse.Namespace, kind: str) -> dict[str, float]:
    """Fill, burst and sustained phases against one server on the store `kind`."""
    figures: dict[str, float] = {}
    schema = f"stoker_bench_{uuid.uuid4().hex[:10]}"
    env = {}
    store = "sqlite:///./stoker.db"
    postgres = kind.startswith("postgres")
    if postgres:
        store = args.postgres
        env = {
            "STOKER_STORE_OPTIONS__SCHEMA": schema,
            "STOKER_STORE_OPTIONS__SYNCHRONOUS_COMMIT": str(kind != "postgres-async").lower(),
            "STOKER_ACTIVATION__KEY": "bench-" + uuid.uuid4().hex + uuid.uuid4().hex,
        }
    source = args.baseline if kind.endswith("@base") else None
    with tempfile.TemporaryDirectory(prefix="stoker-stores-") as tmp:
        server = cb.Server(Path(tmp), args.workers, False, source, store=store, env=env)
        profile = args.profile / kind if args.profile is not None else None
        profiler = cb.Profiler(profile, server.proc.pid)
        try:
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            async with aiohttp.ClientSession(connector=connector) as http:
                fill = await cb.wait_warm(http, server.url, args.workers, timeout=600)
                print(f"[{kind}] {args.workers} warm workers after {fill:.1f} s")
                await asyncio.sleep(2)
                profiler.start("burst")
                ids = await cb.burst(http, server.url, args.workers, server.proc.pid, figures)
                profiler.stop()
                await asyncio.gather(*(cb.release(http, server.url, i) for i in ids))
                server_cpu = psutil.Process(server.proc.pid)
                before = server_cpu.cpu_times()
                db_before = postgres_cpu()
                await cb.sustained(
                    http, server.url, args.concurrency, args.duration, profiler, figures
                )
                profiler.stop()
                after = server_cpu.cpu_times()
                cycles = figures["cycles/s"] * args.duration
                used = (after.user + after.system) - (before.user + before.system)
                figures["server CPU/cycle (ms)"] = 1000 * used / max(cycles, 1)
                if postgres:
                    db = postgres_cpu() - db_before
                    figures["database CPU/cycle (ms)"] = 1000 * db / max(cycles, 1)
        finally:
            server.stop()
            if postgres:
                with psycopg.connect(args.postgres, autocommit=True) as conn:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return figures


async def main(args: argparse.Namespace) -> None:
    stores = AB_STORES if args.baseline is not None else STORES
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in stores}
    for round_ in range(args.rounds):
        order = stores if round_ % 2 == 0 else stores[::-1]
        for kind in order:
            print(f"-- round {round_ + 1}/{args.rounds}: {kind}")
            runs[kind].append(await one_run(args, kind))
    print(
        f"side by side, {args.rounds} rounds, {args.workers} workers, "
        f"{args.concurrency} orgs cycling (medians; ratio: median of the paired ratios to "
        "sqlite):"
    )
    for name in runs["sqlite"][0]:
        line = f"  {name:22s}"
        for kind in stores:
            mine = [figures[name] for figures in runs[kind]]
            line += f" | {kind} {statistics.median(mine):7.1f}"
            if kind.startswith("postgres"):
                # Against the SQLite of the same version.
                _, at, version = kind.partition("@")
                lite = [figures[name] for figures in runs["sqlite" + at + version]]
                ratios = [p / s for p, s in zip(mine, lite, strict=True)]
                line += (
                    f" ratio {statistics.median(ratios):.2f}"
                    f" ({', '.join(f'{r:.2f}' for r in ratios)})"
                )
        print(line)
    cores = psutil.cpu_count() or 1
    for kind in stores:
        if kind.startswith("postgres"):
            db = [figures["database CPU/cycle (ms)"] for figures in runs[kind]]
            print(f"  database CPU/cycle (ms) {kind}: {statistics.median(db):.2f}")
            # What the machine's cores allow at this store's CPU per cycle (server,
            # database, workers and load generator on the same cores), against SQLite.
            _, at, version = kind.partition("@")
            rate = statistics.median(f["cycles/s"] for f in runs["sqlite" + at + version])
            need = statistics.median(f["machine CPU/cycle (ms)"] for f in runs[kind])
            ceiling = cores * 1000 / need
            print(
                f"  at most {ceiling:.0f} cycles/s {kind} with all {cores} cores busy: "
                f"{ceiling / rate:.2f}x sqlite's measured rate"
            )
    if args.baseline is not None:
        for name in runs["sqlite"][0]:
            line = f"  {name:22s} this / baseline:"
            for kind in ("sqlite", "postgres"):
                ratios = [
                    a[name] / b[name] for a, b in zip(runs[kind], runs[kind + "@base"], strict=True)
                ]
                line += f" {kind} {statistics.median(ratios):.2f}"
            print(line)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=96, help="warm workers and burst size")
    parser.add_argument("--concurrency", type=int, default=24, help="orgs cycling in parallel")
    parser.add_argument("--duration", type=float, default=8.0, help="sustained phase, seconds")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both stores")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy output directory")
    parser.add_argument(
        "--baseline",
        type=cb.stoker_src,
        default=None,
        help="the src folder of a version to compare",
    )
    parser.add_argument(
        "--postgres",
        default="postgresql://postgres@127.0.0.1:5432/test",
        help="the PostgreSQL server (each run uses a schema of its own, dropped after)",
    )
    return parser.parse_args()


if __name__ == "__main__":
    uvloop.run(main(parse()))
