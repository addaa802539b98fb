"""A scenario at one seed gives the same report in every process.

Each run here is a separate `stoker scaletest` process with its own PYTHONHASHSEED, so
an order that follows string hashes (a set of names) shows as a difference. `burst`'s
percent-headroom deletes several placeholders at once after the burst, in the order the
Kubernetes runtime holds them: that is where such an order once leaked (two `weekly` runs
at seed 9 cost $1,060.2 and $1,062.2).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from servers import STOKER, environment


def test_two_processes_with_different_hash_seeds_write_the_same_report(tmp_path: Path) -> None:
    runs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"hash-{hash_seed}"
        argv = [STOKER, "scaletest", "burst", "--short", "-p", "percent-headroom"]
        argv += ["--no-progress", "--out", str(out)]
        proc = subprocess.Popen(
            argv,
            env=environment(PYTHONHASHSEED=hash_seed),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        runs.append((proc, out))
    for proc, _ in runs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    (_, one), (_, two) = runs
    for name in ("summary.json", "timeseries.csv", "claims.jsonl", "passes.csv"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
