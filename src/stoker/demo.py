"""`make demo`: the README's tour in one command, on a server of its own.

    python -m stoker.demo

Starts `stoker serve` on the embedded defaults in a temporary directory (a free port, its
own SQLite file, two demo workers kept warm), then, through the SDK as an application
would: claims a worker for the org `acme`, talks to it with the session token (and shows
that it refuses a request without one), releases it, claims again to get the same worker
back by reuse, and prints the pool after each step. Stops the server and its workers at
the end, whatever happened.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from stoker.sdk import Client

LISTENING = re.compile(r"listening on (http://\S+)")
POOL = "demo"
ORG = "acme"


@contextmanager
def server(directory: str) -> Iterator[str]:
    """A `stoker serve` on a free port in `directory`; yields its URL, stops it after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "stoker", "serve", "--stop-workers"],
        cwd=directory,
        # The embedded defaults, whatever STOKER_* settings this shell has.
        env={k: v for k, v in os.environ.items() if not k.startswith("STOKER_")}
        | {"STOKER_API__PORT": "0", "STOKER_LOG_LEVEL": "warning"},
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            found = LISTENING.search(line)
            if found:
                print(f"$ stoker serve\n{line.rstrip()}")
                yield found.group(1)
                break
        else:
            raise SystemExit(f"stoker demo: the server exited ({proc.wait()}) before listening")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def show_pool(client: Client) -> None:
    """One line: the demo pool's workers by state."""
    pool = client.pool(POOL)
    counts = ", ".join(f"{state} {n}" for state, n in pool.counts.items() if n)
    print(f"  pool {POOL}: {counts or 'no workers yet'}")


def wait_ready(client: Client, *, attempts: int = 120) -> None:
    """Until `/readyz` answers 200 (the store open, the pools loaded), at most a minute."""
    for _ in range(attempts):
        if client.ready():
            return
        time.sleep(0.5)
    raise SystemExit("stoker demo: the server did not get ready within a minute")


def wait_warm(client: Client, *, attempts: int = 120) -> None:
    """Until the demo pool has a warm worker (its first start-ups), at most a minute: the
    tour shows a warm claim, not a cold start on a busy machine."""
    for _ in range(attempts):
        if client.pool(POOL).counts.get("warm", 0):
            return
        time.sleep(0.5)
    raise SystemExit(f"stoker demo: no worker of pool {POOL!r} got warm within a minute")


def tour(url: str) -> None:
    """Claim, use, release and claim again, printing each step."""
    with Client(url) as client:
        wait_ready(client)
        wait_warm(client)
        show_pool(client)
        with client.claim(POOL, ORG) as session:
            first = session.worker_id
            print(f"claimed {first} for {ORG} ({session.claim.source}) at {session.endpoint}")
            answer = httpx.get(session.endpoint, headers=session.headers, timeout=10)
            print(f"  GET / with the session token: {answer.status_code} {answer.text.strip()}")
            refused = httpx.get(session.endpoint, timeout=10)
            print(f"  GET / without it: {refused.status_code}")
            show_pool(client)
        print(f"released {first}")
        show_pool(client)
        with client.claim(POOL, ORG) as again:
            print(f"claimed {again.worker_id} for {ORG} again ({again.claim.source})")
        show_pool(client)


def main() -> None:
    """Run the tour on a fresh server; exit 1 with one line if a step fails."""
    with tempfile.TemporaryDirectory(prefix="stoker-demo-") as directory, server(directory) as url:
        try:
            tour(url)
        except Exception as exc:
            raise SystemExit(f"stoker demo: {type(exc).__name__}: {exc}") from None
    print("server stopped, workers stopped")


if __name__ == "__main__":
    main()
