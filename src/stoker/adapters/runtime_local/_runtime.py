"""The local-process runtime itself: spawn, stop, adopt and list worker processes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import aiohttp
import psutil

from stoker.adapters._logs import EventLog
from stoker.adapters.runtime_local._processes import (
    LABEL_ENDPOINT,
    LABEL_FLEET,
    LABEL_INSTANCE,
    LABEL_POOL,
    LABEL_WORKER_ID,
    authority,
    free_port,
    how_it_ended,
    identity,
    is_sleeping,
    kill_quietly,
    lower_priority,
    restore_priority,
    same_start,
    scan_fleet,
    start_process,
    substitute,
    worker_environment,
)
from stoker.adapters.runtime_local._readiness import probe_client, probe_until_ready
from stoker.adapters.runtime_local._retention import LogRetention, WorkerLogs
from stoker.adapters.runtime_local._startups import StartGate, default_start_limit
from stoker.adapters.runtime_local._watches import ProcessWatch, ProcessWatches
from stoker.domain.activation import ActivationKey
from stoker.domain.errors import RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec, ProcessTemplate
from stoker.ports.clock import Clock
from stoker.ports.runtime import (
    RuntimeListener,
    RuntimeObject,
    SpawnProgress,
    StartSlots,
)
from stoker.worker import SECRET_ENV

_log = EventLog("stoker.runtime.local")

#: How long to wait for a process to disappear after SIGKILL before calling the stop failed.
KILL_WAIT_S = 5.0
#: A starting process found asleep IDLE_SAMPLES times in a row, IDLE_SAMPLE_S apart, is
#: idle (it waits for something): it gives its start-up slot on.
IDLE_SAMPLE_S = 0.25
IDLE_SAMPLES = 4


def default_memory_budget_mb() -> int:
    """The workers' memory budget when none is set: half the machine (the rest is for the
    control plane, the store and the OS)."""
    return int(psutil.virtual_memory().total // (2 * 1024 * 1024))


def memory_cap(memory_budget_mb: int, template: ProcessTemplate) -> int:
    """A local pool's cap when its `max_workers` is 0: the budget over one worker's size."""
    return max(1, memory_budget_mb // max(1, template.memory_mb))


class LocalProcessRuntime:
    """Runs workers as local processes; implements the `Runtime` port.

    `memory_budget_mb` (default: half the machine) over a worker's `memory_mb` is a pool's
    cap when its `max_workers` is 0. Worker output goes to `<log_dir>/<worker id>.log`;
    the logs of ended workers are deleted by `log_retention` (see `WorkerLogs`).
    Readiness is probed every `ready_poll_s`; workers listen on `host`. `probe_session`,
    when given, opens the HTTP session the probes use (the HTTP activator's: a worker's
    first activation then reuses the connection its last probe left open, as activations
    are on the claim path); its owner closes it. Else the runtime opens and closes its own.
    Each worker gets its activation secret (derived from `activation_key`) in its
    environment, never in its argv: every local user can read a process's argv.

    At most `start_limit` workers start at once (default: one per core); more spawns
    wait in a queue, cold ones first, and a worker's spawn timeout runs from its own
    start. A starting worker runs `start_nice` steps nicer than the control plane, so
    that a storm of start-ups cannot starve the API; once ready it gets its priority
    back where the system allows (RLIMIT_NICE or CAP_SYS_NICE), else it keeps it.
    """

    kind = "local"
    has_nodes = False

    def __init__(
        self,
        *,
        clock: Clock,
        fleet: str,
        instance_id: str,
        activation_key: ActivationKey,
        memory_budget_mb: int | None = None,
        log_dir: str | None = None,
        ready_poll_s: float = 0.05,
        host: str = "127.0.0.1",
        probe_session: Callable[[], aiohttp.ClientSession] | None = None,
        start_limit: int | None = None,
        start_nice: int = 10,
        log_retention: LogRetention | None = None,
    ) -> None:
        self.clock = clock
        self.fleet = fleet
        self.instance_id = instance_id
        self._key = activation_key
        if memory_budget_mb is None:
            memory_budget_mb = default_memory_budget_mb()
        self.memory_budget_mb = memory_budget_mb
        self.log_dir = log_dir
        #: The ended workers' logs, and their deletion (None: no logs are written).
        self.logs = WorkerLogs(log_dir, log_retention or LogRetention(), clock) if log_dir else None
        self._pruner: asyncio.Task[None] | None = None
        self.ready_poll_s = ready_poll_s
        self.host = host
        self._listener: RuntimeListener | None = None
        self._open_session = probe_session or probe_client
        self._owns_session = probe_session is None
        self._client: aiohttp.ClientSession | None = None
        self._watches = ProcessWatches(clock, self._on_exit)
        self.startups = StartGate(start_limit or default_start_limit(), clock)
        self.start_nice = start_nice
        #: Set once a ready worker could not get its priority back (logged once).
        self._nice_kept = False

    def start_slots(self) -> StartSlots:
        """The start-up slots (`StartGated`): how many, and how long a start-up holds one."""
        return StartSlots(self.startups.limit, self.startups.hold_s)

    # -- lifecycle of the runtime itself ----------------------------------------------------

    def subscribe(self, listener: RuntimeListener) -> None:
        """Route readiness and loss events to `listener`."""
        self._listener = listener

    async def start(self) -> None:
        """Open the HTTP client of the readiness probes; start deleting the logs of ended
        workers that `log_retention` no longer keeps."""
        if self._client is None:
            self._client = self._open_session()
        if self.logs is not None and self._pruner is None:
            self._pruner = asyncio.create_task(self.logs.run(self._watched), name="prune-logs")
            self._pruner.add_done_callback(_log_failure)

    async def close(self) -> None:
        """Stop probing and watching; the worker processes keep running, to be adopted.
        Spawns still queued for a start-up slot are withdrawn (nothing was started)."""
        self.startups.close()
        pruner, self._pruner = self._pruner, None
        if pruner is not None:
            pruner.cancel()
            await asyncio.gather(pruner, return_exceptions=True)
        await self._watches.close()
        client, self._client = self._client, None
        if client is not None and self._owns_session:
            await client.close()

    def derived_cap(self, pool: PoolSpec) -> int:
        """Local cap when `max_workers` is 0: the memory budget over one worker's size."""
        template = pool.template
        if not isinstance(template, ProcessTemplate):
            # This runtime cannot run the pool at all; spawn refuses it.
            return 1
        return memory_cap(self.memory_budget_mb, template)

    # -- spawn and readiness ----------------------------------------------------------------

    async def spawn(self, worker: Worker, pool: PoolSpec) -> Mapping[str, Any]:
        """Start the worker process; readiness is reported later by `worker_ready`.

        Waits first for a start-up slot (see `StartGate`). Returns the ref `{pid,
        start_time, port, endpoint}`. Raises `RuntimeFailure` when the pool has no process
        template or the process cannot be started, `SpawnWithdrawn` when the worker was
        stopped while it waited for a slot.
        """
        template = pool.template
        if not isinstance(template, ProcessTemplate):
            raise RuntimeFailure(f"pool {pool.name!r} has no process template")
        if self._client is None:
            raise RuntimeFailure("the local runtime is not started")
        # A cold spawn (bound to an org) has a claim waiting for it: it goes first.
        await self.startups.enter(worker.id, urgent=worker.org is not None)
        try:
            return self._start(worker, pool, template)
        except BaseException:
            self.startups.leave(worker.id)
            raise

    def _start(self, worker: Worker, pool: PoolSpec, template: ProcessTemplate) -> dict[str, Any]:
        """Start the process of a worker holding a start-up slot and watch it."""
        client = self._client
        if client is None:
            raise RuntimeFailure("the local runtime is closed")
        try:
            port = free_port(self.host)
        except OSError as exc:
            raise RuntimeFailure(f"no free port on {self.host}: {exc}") from exc
        endpoint = f"http://{authority(self.host, port)}"
        substitutions = {"{port}": str(port), "{worker_id}": worker.id, "{python}": sys.executable}
        argv = [substitute(arg, substitutions) for arg in template.argv]
        if not argv:
            raise RuntimeFailure(f"pool {pool.name!r} has an empty argv")
        labels = {
            LABEL_FLEET: self.fleet,
            LABEL_WORKER_ID: worker.id,
            LABEL_POOL: pool.name,
            LABEL_INSTANCE: self.instance_id,
            LABEL_ENDPOINT: endpoint,
        }
        env = worker_environment(template.env, labels)
        # /proc/<pid>/environ is readable by the worker's own user only (unlike argv).
        env[SECRET_ENV] = self._key.worker_secret(worker.id)
        pid = start_process(worker.id, argv, env, template.cwd, self.log_dir)
        try:
            pidfd = os.pidfd_open(pid)
            # Not reaped yet, so the pid cannot have been reused: this is our process.
            start_time = psutil.Process(pid).create_time()
        except (OSError, psutil.Error) as exc:
            kill_quietly(pid)
            raise RuntimeFailure(f"worker {worker.id} vanished at start: {exc}") from exc
        lower_priority(pid, self.start_nice)
        watch = ProcessWatch(
            worker_id=worker.id,
            pool=pool.name,
            pid=pid,
            start_time=start_time,
            pidfd=pidfd,
            ready=False,
            endpoint=endpoint,
        )
        self._watches.add(watch)
        watch.poller = asyncio.create_task(
            self._await_ready(client, watch, endpoint, pool.timeouts.spawn_s),
            name=f"ready:{worker.id}",
        )
        watch.poller.add_done_callback(_log_failure)
        # The slot is free once the start-up ends, whichever way (ready, failed, stopped).
        watch.poller.add_done_callback(lambda _: self.startups.leave(worker.id))
        _log("worker_spawned", worker=worker.id, pool=pool.name, pid=pid, endpoint=endpoint)
        return {"pid": pid, "start_time": start_time, "port": port, "endpoint": endpoint}

    async def _await_ready(
        self, client: aiohttp.ClientSession, watch: ProcessWatch, endpoint: str, timeout_s: float
    ) -> None:
        """Report `worker_ready` once `/healthz` answers; kill the process if it never does.

        An exit before readiness is reported by the exit watch, which also cancels this.
        """
        idle = asyncio.create_task(self._leave_when_idle(watch), name=f"idle:{watch.worker_id}")
        try:
            ready = await probe_until_ready(
                client,
                self.clock,
                endpoint,
                timeout_s=timeout_s,
                poll_s=self.ready_poll_s,
                gone=watch.exited.is_set,
            )
        finally:
            idle.cancel()
        if ready is None or watch.exited.is_set() or watch.stopping:
            return
        if not ready:
            self._fail_spawn(
                watch, f"not ready within {timeout_s:g}s (/healthz never answered 200)"
            )
            return
        watch.ready = True
        self._restore_priority(watch)
        _log("worker_ready", worker=watch.worker_id, pool=watch.pool, pid=watch.pid)
        if self._listener is not None:
            self._listener.worker_ready(watch.worker_id, endpoint)

    async def _leave_when_idle(self, watch: ProcessWatch) -> None:
        """Give the start-up slot on once the starting process sleeps rather than computes
        (a worker that waits for a timer or a dependency before it listens): the bound is
        on the CPU start-ups take, and an idle one must not hold the others back. A
        process starved of CPU is runnable, not asleep: it keeps its slot."""
        asleep = 0
        while asleep < IDLE_SAMPLES:
            await self.clock.sleep(IDLE_SAMPLE_S)
            sleeping = is_sleeping(watch.pid)
            if sleeping is None:
                return
            asleep = asleep + 1 if sleeping else 0
        self.startups.leave(watch.worker_id)

    def _restore_priority(self, watch: ProcessWatch) -> None:
        """Give a ready worker the control plane's priority back, where the system allows."""
        if not self.start_nice:
            return
        if not restore_priority(watch.pid) and not self._nice_kept:
            self._nice_kept = True
            _log("worker_nice_kept", nice=self.start_nice, why="RLIMIT_NICE forbids it")

    def _fail_spawn(self, watch: ProcessWatch, why: str) -> None:
        """Kill a process that never became ready and report `spawn_failure` once."""
        if self.logs is not None:
            self.logs.ended(watch.worker_id, failed=True)
        watch.stopping = True
        watch.send(signal.SIGKILL)
        self._report_lost(watch, "spawn_failure", "worker_spawn_failed", why, error=why)

    def _on_exit(self, watch: ProcessWatch) -> None:
        """A watched process ended: a loss unless this runtime ended it."""
        ended = how_it_ended(watch.returncode)
        if self.logs is not None:
            self.logs.ended(watch.worker_id, failed=not (watch.ready or watch.stopping))
        if watch.stopping:
            _log("worker_exited", worker=watch.worker_id, pool=watch.pool, pid=watch.pid)
            return
        reason = "lost" if watch.ready else "spawn_failure"
        self._report_lost(
            watch, reason, "worker_lost", ended, pid=watch.pid, reason=reason, ended=ended
        )

    def _report_lost(
        self, watch: ProcessWatch, reason: str, event: str, how: str, /, **fields: Any
    ) -> None:
        """Log a loss as `event` (a warning) and tell the listener `worker_lost(reason)`,
        with `how` it ended (an exit code, a timeout: never the worker's output) and, when
        its output is kept, where to read it.

        The parameters are positional-only so that `reason` can also be a field of the line.
        """
        _log(event, level=logging.WARNING, worker=watch.worker_id, pool=watch.pool, **fields)
        if self.log_dir is not None:
            how += f"; its output: {watch.worker_id}.log in runtime.log_dir"
        if self._listener is not None:
            self._listener.worker_lost(watch.worker_id, reason, how)

    def _watched(self) -> list[str]:
        """The workers whose processes this runtime watches and that have not ended."""
        return [watch.worker_id for watch in self._watches.live()]

    async def prune_logs(self) -> list[str]:
        """Delete the ended workers' logs that `log_retention` no longer keeps now (the
        runtime does every `PRUNE_INTERVAL_S`); returns their worker ids."""
        return await self.logs.prune(self._watched) if self.logs is not None else []

    # -- stop, adoption, listing ------------------------------------------------------------

    async def stop(self, worker: Worker, grace_s: float) -> None:
        """SIGTERM the worker's process, then SIGKILL after `grace_s`.

        Only the process recorded in `worker.runtime_ref` (pid and start time) is ever
        signalled; one that is already gone is not an error. Raises `RuntimeFailure` if
        the process survives SIGKILL.
        """
        if self.startups.withdraw(worker.id, "was stopped"):
            _log("worker_stop_skipped", worker=worker.id, reason="not_started")
            return
        named = identity(worker.runtime_ref)
        if named is None:
            # Stopped before the spawn's ref reached the store: this runtime may know it.
            known = self._watches.find(worker.id)
            named = (known.pid, known.start_time) if known is not None else None
        if named is None:
            _log("worker_stop_skipped", worker=worker.id, reason="no_ref")
            return
        pid, start_time = named
        watch = self._watches.get(pid)
        if watch is None or not same_start(watch.start_time, start_time):
            watch = self._watches.open(worker.id, worker.pool, pid, start_time)
            if watch is None:
                _log("worker_already_gone", worker=worker.id, pid=pid)
                if self.logs is not None:
                    self.logs.ended(worker.id)
                return
            watch.stopping = True
            self._watches.add(watch)
        watch.stopping = True
        if watch.poller is not None:
            watch.poller.cancel()
        watch.send(signal.SIGTERM)
        if await self._watches.wait_exit(watch, grace_s):
            _log("worker_stopped", worker=worker.id, pid=pid, signal="SIGTERM")
            return
        watch.send(signal.SIGKILL)
        if await self._watches.wait_exit(watch, KILL_WAIT_S):
            _log("worker_stopped", worker=worker.id, pid=pid, signal="SIGKILL")
            return
        raise RuntimeFailure(f"worker {worker.id} (pid {pid}) survived SIGKILL")

    async def adopt(self, worker: Worker) -> bool:
        """Watch a live worker left by an earlier control plane; False if it is gone.

        The process must be the one in `worker.runtime_ref` (pid and start time); a pid
        now used by another process counts as gone. Readiness is not announced again.
        """
        named = identity(worker.runtime_ref)
        if named is None:
            return False
        pid, start_time = named
        current = self._watches.get(pid)
        if current is not None and same_start(current.start_time, start_time):
            return True
        watch = self._watches.open(worker.id, worker.pool, pid, start_time)
        if watch is None:
            _log("worker_adopt_failed", worker=worker.id, pid=pid, reason="gone")
            return False
        self._watches.add(watch)
        _log("worker_adopted", worker=worker.id, pool=worker.pool, pid=pid)
        return True

    async def list_objects(self) -> list[RuntimeObject]:
        """Every live process labelled with this fleet (read from /proc in a thread), and
        every live process this runtime watches.

        The second part is not redundant: for an instant after `exec` (and longer on a
        loaded machine) a new process's environment reads empty, so a scan that runs just
        after a spawn misses it, and the shutdown's last sweep would leave it running.
        """
        found = await asyncio.to_thread(scan_fleet, self.fleet, os.getpid())
        objects = []
        for pid, created, env in found:
            watch = self._watches.get(pid)
            objects.append(
                _listed(
                    env[LABEL_WORKER_ID],
                    env.get(LABEL_POOL, ""),
                    pid,
                    created,
                    endpoint=env.get(LABEL_ENDPOINT),
                    ready=watch is not None and watch.ready,
                    instance=env.get(LABEL_INSTANCE),
                )
            )
        scanned = {pid for pid, _created, _env in found}
        for watch in self._watches.live():
            if watch.pid not in scanned:
                objects.append(
                    _listed(
                        watch.worker_id,
                        watch.pool,
                        watch.pid,
                        watch.start_time,
                        endpoint=watch.endpoint,
                        ready=watch.ready,
                        instance=self.instance_id,
                    )
                )
        return objects

    async def set_busy(self, worker: Worker, busy: bool) -> None:
        """Nothing to do: no one disrupts a local process (unlike a cluster node drain)."""
        return None

    def progress(self, worker: Worker) -> SpawnProgress | None:
        """None: a local process starts or fails; it waits on nothing the sweep should know."""
        return None

    def pinned(self, worker: Worker) -> bool | None:
        """None: a local process carries no such mark."""
        return None

    def unpinned(self) -> Collection[str]:
        """None of them: a local process carries no such mark."""
        return ()

    def node_sessions(self, worker: Worker) -> int | None:
        """None: local processes share one machine, with no nodes to give back."""
        return None

    def gather(self, pool: str, on: bool) -> None:
        """Nothing to do: one machine has no nodes to gather sessions on."""

    async def reconcile_headroom(self, pools: Sequence[PoolSpec]) -> None:
        """Nothing to do: one machine has no node autoscaler to hold spare nodes for."""
        return None

    def placeholder_slots(self, pool: PoolSpec) -> int:
        """1: there are no placeholders on one machine."""
        return 1

    def placeholder_requests(self, pool: PoolSpec) -> tuple[float, float]:
        """(0, 0): there are no placeholders on one machine."""
        return 0.0, 0.0


def _listed(
    worker_id: str,
    pool: str,
    pid: int,
    created: float,
    *,
    endpoint: str | None,
    ready: bool,
    instance: str | None,
) -> RuntimeObject:
    """The runtime object of a live worker process."""
    ref: dict[str, Any] = {"pid": pid, "start_time": created}
    if endpoint:
        ref["endpoint"] = endpoint
    return RuntimeObject(
        worker_id=worker_id,
        pool=pool,
        ref=ref,
        created_at=created,
        alive=True,
        ready=ready,
        endpoint=endpoint,
        instance=instance,
    )


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        _log.logger.error("event=task_failed task=%s error=%r", task.get_name(), exc)
