"""The log files of ended workers in `log_dir`, kept within bounds.

Every worker writes `<log_dir>/<worker id>.log`. Once its process has ended the file is
only for debugging, so the runtime deletes it when it falls out of `LogRetention`: past
the most recently ended `keep`, or `keep_s` after its worker ended. The logs of workers
that failed to start are counted apart, so that a busy pool's ended sessions never push
out the log a pool's `last_spawn_error` names. A file is never deleted while a process
of its worker lives (any fleet's, as found in /proc, or one this runtime watches).

When a worker ended is known for the workers this runtime saw end; a file left by an
earlier run counts as ended when it was last written (its modification time).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from stoker.adapters._logs import EventLog
from stoker.adapters.runtime_local._processes import scan_workers
from stoker.ports.clock import Clock

_log = EventLog("stoker.runtime.local")

#: How often the runtime looks for logs to delete.
PRUNE_INTERVAL_S = 60.0
#: Worker ids start with this (`Ids.worker`): other files in `log_dir` are left alone.
WORKER_PREFIX = "w-"
LOG_SUFFIX = ".log"


@dataclass(frozen=True, slots=True)
class LogRetention:
    """How many ended workers' logs are kept, and how long. None: no bound of that kind."""

    #: The most recently ended workers whose logs are kept (as many again of workers that
    #: failed to start).
    keep: int | None = 100
    #: Seconds an ended worker's log is kept after the worker ended.
    keep_s: float | None = 7 * 86400.0


@dataclass(frozen=True, slots=True)
class EndedLog:
    """The log of a worker whose process has ended."""

    worker_id: str
    #: Wall time the worker ended (or, for a file of an earlier run, was last written).
    ended_at: float
    #: It ended before it got ready (a failed spawn).
    failed: bool = False


def expired(logs: Iterable[EndedLog], retention: LogRetention, now: float) -> list[str]:
    """The worker ids of the `logs` that `retention` no longer keeps at `now`: beyond the
    `keep` most recently ended of their kind (failed spawns, others), or ended more than
    `keep_s` ago."""
    gone = []
    for failed in (False, True):
        kind = sorted(
            (log for log in logs if log.failed is failed),
            key=lambda log: (log.ended_at, log.worker_id),
            reverse=True,
        )
        for rank, log in enumerate(kind):
            beyond = retention.keep is not None and rank >= retention.keep
            old = retention.keep_s is not None and now - log.ended_at > retention.keep_s
            if beyond or old:
                gone.append(log.worker_id)
    return gone


class WorkerLogs:
    """The worker logs of one `log_dir`: when their workers ended, and their deletion."""

    def __init__(
        self,
        log_dir: str,
        retention: LogRetention,
        clock: Clock,
        *,
        running: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.retention = retention
        self.clock = clock
        #: The ids of the workers whose processes live on this machine (read in a thread).
        self._running = running or (lambda: scan_workers(os.getpid()))
        #: When each worker this runtime saw end ended, and whether it failed to start.
        self._ended: dict[str, EndedLog] = {}

    def ended(self, worker_id: str, *, failed: bool = False) -> None:
        """The worker's process ended now (`failed`: before it got ready)."""
        known = self._ended.get(worker_id)
        if known is None:
            self._ended[worker_id] = EndedLog(worker_id, self.clock.now(), failed)
        elif failed and not known.failed:
            self._ended[worker_id] = EndedLog(worker_id, known.ended_at, True)

    async def prune(self, watched: Callable[[], Collection[str]]) -> list[str]:
        """Delete the logs `retention` no longer keeps; returns their worker ids.

        `watched()` names the workers whose processes this runtime watches: read after
        the scan of the machine's processes, so that one started meanwhile is among them.
        """
        files = await asyncio.to_thread(self._files)
        if not files:
            self._ended.clear()
            return []
        running = await asyncio.to_thread(self._running)
        alive = set(running) | set(watched())
        logs = [
            self._ended.get(worker_id) or EndedLog(worker_id, written)
            for worker_id, written in files.items()
            if worker_id not in alive
        ]
        # What has no file any more needs no end time.
        for worker_id in self._ended.keys() - files.keys():
            del self._ended[worker_id]
        gone = expired(logs, self.retention, self.clock.now())
        if gone:
            failures = await asyncio.to_thread(self._delete, gone)
            for worker_id in gone:
                self._ended.pop(worker_id, None)
            _log("worker_logs_pruned", count=len(gone) - len(failures), kept=len(logs) - len(gone))
            for error in failures[:1]:
                _log("worker_log_prune_failed", error=error)
        return gone

    async def run(self, watched: Callable[[], Collection[str]]) -> None:
        """Prune now and every `PRUNE_INTERVAL_S` of the clock, until cancelled."""
        while True:
            try:
                await self.prune(watched)
            except OSError as exc:
                # An unreadable log_dir is the operator's to fix; the workers run on.
                _log("worker_log_prune_failed", error=str(exc))
            await self.clock.sleep(PRUNE_INTERVAL_S)

    def _files(self) -> dict[str, float]:
        """Each worker log in `log_dir`, by worker id, with its modification time."""
        found: dict[str, float] = {}
        try:
            entries = os.scandir(self.log_dir)
        except FileNotFoundError:
            return found
        with entries:
            for entry in entries:
                name = entry.name
                if not (name.startswith(WORKER_PREFIX) and name.endswith(LOG_SUFFIX)):
                    continue
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        found[name[: -len(LOG_SUFFIX)]] = entry.stat().st_mtime
        return found

    def _delete(self, worker_ids: Iterable[str]) -> list[str]:
        """Delete the logs of `worker_ids`; the errors of those that could not be."""
        failures = []
        for worker_id in worker_ids:
            try:
                os.unlink(os.path.join(self.log_dir, worker_id + LOG_SUFFIX))
            except FileNotFoundError:
                continue
            except OSError as exc:
                failures.append(f"{worker_id}{LOG_SUFFIX}: {exc.strerror or exc}")
        return failures
