"""`make bench`: the benchmarks of this directory one after the other, each as its own process.

    python benchmarks/run_all.py [--all] [--postgres URL] [--list] [NAME ...]

By default the ones that need nothing but this machine: `core` (the in-process claim
path with real workers), `claim_burst` (claims over HTTP against `stoker serve`),
`kubernetes_runtime` and `sim_cluster` (the fake cluster on virtual time) and `scaletest`
(every shipped scenario, short form). `--all` adds the PostgreSQL ones (`stores`,
`store_cycles`, `replicas`, `chaos_soak`; `--postgres URL` or STOKER_TEST_POSTGRES_URL
names the server). Each prints its own figures; this prints the wall time of each and exits 1 when
one failed. Run nothing else meanwhile: the figures are wall-clock and CPU measurements.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: name -> the arguments it runs with here (a quick form where the script has one).
LOCAL: dict[str, list[str]] = {
    "core": [],
    "claim_burst": [],
    "kubernetes_runtime": [],
    "sim_cluster": ["--nodes", "500", "--workers", "2000", "--hours", "1"],
    "scaletest": ["--short"],
}
POSTGRES: dict[str, list[str]] = {
    "stores": [],
    "store_cycles": [],
    "replicas": [],
    "chaos_soak": ["--minutes", "2"],
}


def main() -> int:
    """Run the chosen benchmarks; 1 when one failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="benchmarks to run [default: see --list]")
    parser.add_argument("--all", action="store_true", help="add the PostgreSQL benchmarks")
    parser.add_argument("--postgres", default=os.environ.get("STOKER_TEST_POSTGRES_URL"))
    parser.add_argument("--list", action="store_true", help="print the benchmarks and exit")
    args = parser.parse_args()
    known = LOCAL | POSTGRES
    if args.list:
        for name, extra in known.items():
            where = "default" if name in LOCAL else "--all (PostgreSQL)"
            print(f"{name:20} {where:20} {' '.join(extra)}")
        return 0
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(known)}")
    names = args.names or list(LOCAL) + (list(POSTGRES) if args.all else [])
    failed = []
    for name in names:
        command = [sys.executable, str(HERE / f"{name}.py"), *known[name]]
        if name in POSTGRES and args.postgres:
            command += ["--postgres", args.postgres]
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        started = time.monotonic()
        status = subprocess.run(command, check=False).returncode
        print(f"== {name}: exit {status} after {time.monotonic() - started:.0f} s\n", flush=True)
        if status:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
