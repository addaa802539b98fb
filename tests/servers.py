"""Real `stoker serve` processes for the SDK, CLI and quick-start tests.

`start_server` runs the command as a user would, in a directory of its own, and waits for
its "listening on" line (bounded); the server picks a free port itself (`port: 0`) and
prints it, so tests never race for a port. `fleet_processes` finds the worker processes
of a fleet by the label every worker carries, to check what a shutdown left running and
to clean up after a test.
"""

from __future__ import annotations

import os
import queue
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

STOKER = str(Path(sys.executable).with_name("stoker"))
LISTENING = re.compile(r"listening on (http://\S+)")
DEMO = ["{python}", "-m", "stoker.demo_worker", "--port", "{port}", "--worker-id", "{worker_id}"]


def environment(**extra: str) -> dict[str, str]:
    """This process's environment without STOKER_* settings nor a terminal size (a test
    that wants one passes COLUMNS), plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("STOKER_") and k not in ("COLUMNS", "LINES")
    }
    env.update(extra)
    return env


@dataclass
class Server:
    """One running `stoker serve`."""

    proc: subprocess.Popen[str]
    url: str
    workdir: Path
    lines: list[str] = field(default_factory=list)
    tail: str = ""

    def log(self) -> str:
        """What the server wrote to stderr so far."""
        path = self.workdir / "server.log"
        return path.read_text() if path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server and wait (bounded) for it to exit; returns its status.

        What it printed after the listening line is then in `tail`.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"stoker serve did not exit within {timeout}s") from None
        finally:
            if self.proc.stdout is not None and not self.proc.stdout.closed:
                self.tail = self.proc.stdout.read()
                self.proc.stdout.close()
        return status


def start_server(
    workdir: Path,
    *,
    config: str | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    open_files: int | None = None,
) -> Server:
    """Run `stoker serve` in `workdir` and wait until it listens (or fail with its log).

    `open_files` sets the server's open-files limit (soft and hard).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [STOKER, "serve", *args]
    if config is not None:
        (workdir / "stoker.yaml").write_text(config)
        argv += ["-c", "stoker.yaml"]
    log = open(workdir / "server.log", "w")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        argv,
        cwd=workdir,
        env=env if env is not None else environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        preexec_fn=None if open_files is None else _limit_files(open_files),
    )
    log.close()
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        while line:
            lines.put(line)
            if LISTENING.search(line):
                break
            line = proc.stdout.readline()
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    deadline = time.perf_counter() + timeout
    while True:
        remaining = deadline - time.perf_counter()
        try:
            line = lines.get(timeout=max(0.0, remaining))
        except queue.Empty:
            line = None
        if line is None:
            proc.kill()
            proc.wait(10)
            log_text = (workdir / "server.log").read_text()
            raise AssertionError(f"stoker serve did not start: {''.join(seen)}\n{log_text}")
        seen.append(line)
        match = LISTENING.search(line)
        if match:
            return Server(proc, match.group(1), workdir, seen)


def _limit_files(n: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return limit


def fleet_processes(fleet: str) -> list[psutil.Process]:
    """Live worker processes labelled with `fleet`."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("STOKER_FLEET") == fleet and process.status() != "zombie":
                found.append(process)
        except psutil.Error:
            continue
    return found


def kill_fleet(fleet: str) -> None:
    """Kill every worker of `fleet` and wait (bounded) until they are gone."""
    processes = fleet_processes(fleet)
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(processes, timeout=10)


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll `predicate()` until it is true or `timeout` passes; False on timeout."""
    deadline = time.perf_counter() + timeout
    while True:
        if predicate():
            return True
        if time.perf_counter() >= deadline:
            return False
        time.sleep(interval)
