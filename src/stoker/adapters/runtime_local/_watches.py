"""The exit watch of worker processes, without a thread per process.

A pidfd becomes readable when its process ends, and the event loop watches it like a
socket. Signals go through the pidfd too, so they can never reach a reused pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from stoker.adapters._deadlines import DeadlinePassed, within
from stoker.adapters.runtime_local._processes import is_same_process, reap
from stoker.ports.clock import Clock


@dataclass(eq=False)
class ProcessWatch:
    """One worker process watched for readiness and exit."""

    worker_id: str
    pool: str
    pid: int
    start_time: float
    #: Pins the process: signals sent through it can never reach a reused pid.
    pidfd: int
    #: An exit after readiness (or adoption) is `lost`; before it, `spawn_failure`.
    ready: bool
    #: Set when the runtime ends the process on purpose: its exit is not a loss.
    stopping: bool = False
    #: Where it listens, when this runtime started it (an adopted one's is in its row).
    endpoint: str | None = None
    exited: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    #: Once exited: its exit code, or minus the signal that ended it (None: not our
    #: child, as an adopted worker, so its status is its parent's to read).
    returncode: int | None = None
    poller: asyncio.Task[None] | None = None

    def send(self, signum: signal.Signals) -> bool:
        """Signal through the pidfd, which cannot reach a reused pid; False if already gone."""
        if self.pidfd < 0:
            return False
        try:
            signal.pidfd_send_signal(self.pidfd, signum)
        except ProcessLookupError:
            return False
        return True


class ProcessWatches:
    """The watched processes, by pid; `on_exit(watch)` runs once when one ends."""

    def __init__(self, clock: Clock, on_exit: Callable[[ProcessWatch], None]) -> None:
        self.clock = clock
        self._on_exit = on_exit
        #: A pid names one live process while it is watched.
        self._by_pid: dict[int, ProcessWatch] = {}

    def get(self, pid: int) -> ProcessWatch | None:
        """The watch of `pid`, if any."""
        return self._by_pid.get(pid)

    def live(self) -> list[ProcessWatch]:
        """The watched processes that have not ended."""
        return [w for w in self._by_pid.values() if not w.exited.is_set()]

    def find(self, worker_id: str) -> ProcessWatch | None:
        """The watch of a worker by id (rare: only when a stop comes without a ref)."""
        return next((w for w in self._by_pid.values() if w.worker_id == worker_id), None)

    def add(self, watch: ProcessWatch) -> None:
        """Watch `watch`'s pidfd for the process's end."""
        previous = self._by_pid.get(watch.pid)
        if previous is not None and previous is not watch:
            # The pid was reused, so the earlier process has ended and its parent reaped it
            # before the loop ran our exit callback: settle that exit first.
            self._exited(previous)
        self._by_pid[watch.pid] = watch
        asyncio.get_running_loop().add_reader(watch.pidfd, self._exited, watch)

    def open(self, worker_id: str, pool: str, pid: int, start_time: float) -> ProcessWatch | None:
        """A (ready, not yet added) watch on `pid` if it still is the one started at
        `start_time`; None when it is gone or the pid now names another process."""
        if not is_same_process(pid, start_time):
            return None
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        # The pid may have been reused between the check and the open: check the pinned one.
        if not is_same_process(pid, start_time):
            os.close(pidfd)
            return None
        return ProcessWatch(
            worker_id=worker_id,
            pool=pool,
            pid=pid,
            start_time=start_time,
            pidfd=pidfd,
            ready=True,
        )

    def remove(self, watch: ProcessWatch) -> None:
        """Stop probing and watching `watch` (its process is left alone)."""
        if watch.poller is not None and not watch.poller.done():
            watch.poller.cancel()
        if watch.pidfd >= 0:
            with contextlib.suppress(RuntimeError):
                # The loop may already be closed when a runtime is dropped late.
                asyncio.get_running_loop().remove_reader(watch.pidfd)
            os.close(watch.pidfd)
            watch.pidfd = -1
        if self._by_pid.get(watch.pid) is watch:
            del self._by_pid[watch.pid]

    async def close(self) -> None:
        """Stop probing and watching every process; the processes keep running."""
        pollers = [w.poller for w in self._by_pid.values() if w.poller is not None]
        for watch in list(self._by_pid.values()):
            self.remove(watch)
        # Let cancelled probes finish before their client goes away.
        await asyncio.gather(*pollers, return_exceptions=True)

    async def wait_exit(self, watch: ProcessWatch, seconds: float) -> bool:
        """Wait up to `seconds` of the injected clock for the process to end."""
        if not watch.exited.is_set():
            with contextlib.suppress(DeadlinePassed):
                await within(self.clock, watch.exited.wait(), seconds)
        return watch.exited.is_set()

    def _exited(self, watch: ProcessWatch) -> None:
        """The pidfd became readable: the process ended."""
        if watch.exited.is_set():
            return
        self.remove(watch)
        watch.returncode = reap(watch.pid)
        watch.exited.set()
        self._on_exit(watch)
