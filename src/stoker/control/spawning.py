"""Spawning: reserve spawn slots in the store within caps and target, then create the
runtime objects, rate-limited by a token bucket sized to the runtime's API budget.

A failed create frees its slot at once (I4), whatever it failed with: a runtime's
`RuntimeFailure`, or anything else a spawn raises (a stored template the runtime cannot
use) — that is a spawn failure too, never a slot left `spawning` until its timeout. Spawns
that keep failing (a worker command that cannot start, a crash loop) back off per pool and
revision, exponentially and capped (`PoolSpec.spawn_backoff`): no spawn starts until the
back-off ends, then one probes, and while it is in flight no other starts; the first
worker that gets ready ends the back-off. Spawns reserved before the trouble began wait for
their turn in `create` rather than try (and fail) one after the other.

What the pool shows (`spawn_failing` in its status, `/readyz`, `stoker_spawn_failing`) is
kept apart from the back-off (`SpawnsFailing`): it ends only when the trouble is over, not
when a worker asked for before the failures gets ready (a pod a namespace quota admitted
before it filled), so a pool stuck below its target says why all along.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, replace
from enum import Enum

from stoker.control import logs
from stoker.control.faults import describe
from stoker.control.journal import EventKind
from stoker.control.retiring import Retirer
from stoker.control.rollouts import Outcome
from stoker.control.shared import Shared
from stoker.domain.errors import RuntimeFailure, SpawnWithdrawn
from stoker.domain.records import Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import RetireReason, WorkerState
from stoker.policy.demand import ReadyTime
from stoker.policy.scaling import spawn_backoff_s
from stoker.ports.clock import TokenBucket
from stoker.ports.runtime import Runtime
from stoker.ports.store import SpawnRequest, SpawnResult


class Turn(Enum):
    """How a spawn's wait for its turn ended."""

    GO = "go"
    #: Retired meanwhile (or the replica shuts down): nothing may start.
    GONE = "gone"
    #: Its spawn timeout ran out while it waited.
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class SpawnTrouble:
    """Spawns of one pool revision failing in a row: how many, the last error, when
    (monotonic) the next one may start, and the spawn that probes now (its worker id)."""

    failures: int
    last_error: str
    retry_at: float
    probe: str | None = None


@dataclass(frozen=True, slots=True)
class SpawnsFailing:
    """What a pool revision whose spawns fail shows: the failures since its spawns last
    worked, the last error, the last of this replica's spawn asks when that failure was
    seen (`Book.asks`), and the failed spawns kept waiting (pods no node fits yet).

    It ends when a worker gets ready that was asked for after the last failure, by this
    replica or another (the runtime takes spawns again), or that was one of those kept
    waiting, the last of them (the cluster made room for them) — not when one asked for
    before the failures does:
    a namespace quota admits a pod, refuses the next two, and the first gets ready a moment
    later, its quota as full as before. It also ends when the leader finds the revision
    at its warm target with ready workers and nothing spawning (`settled`). The back-off
    (`SpawnTrouble`) ends at any readiness, as it always did: what gates spawns is not
    what the status says.
    """

    failures: int
    last_error: str
    asked_before: int
    #: Kept from failure to failure (the same set), and pruned as it is read
    #: (`Spawner._any_waiting`): a readiness costs no scan of every pod that waits.
    waiting: set[str] = field(default_factory=set)
    #: When the last failure was seen (the clock's `now`): a worker another replica asked
    #: for (no ask of this one's to compare) proves the trouble over if its row was
    #: created after it.
    failed_at: float = 0.0


def crash_error(worker: Worker, exc: Exception) -> str:
    """What a spawn that raised something other than a `RuntimeFailure` failed with."""
    return (
        f"worker {worker.id} of revision {worker.revision} could not be started "
        f"(the pool's template or the runtime is faulty): {describe(exc)}"
    )


class Spawner:
    """Neutral warm spawns for the janitor, cold spawns for one org's claim."""

    def __init__(self, shared: Shared, *, retirer: Retirer, runtime: Runtime) -> None:
        self._book, self._lifecycle = shared.book, shared.lifecycle
        self._catalog, self._metrics, self._ids = shared.catalog, shared.metrics, shared.ids
        self._retirer = retirer
        self._runtime = runtime
        self._journal = shared.journal
        self._rollouts = shared.rollouts
        settings = shared.settings
        self._clock = shared.clock
        self._bucket = TokenBucket(
            shared.clock, rate=settings.spawn_rate, burst=settings.spawn_burst
        )
        #: Pool revisions whose spawns fail, by (pool, revision): what gates their spawns.
        self._trouble: dict[tuple[str, str], SpawnTrouble] = {}
        #: What those revisions show (a revision is here whenever it is in `_trouble`, and
        #: stays until its trouble is over: see `SpawnsFailing`).
        self._failing: dict[tuple[str, str], SpawnsFailing] = {}
        #: Set (and replaced) when a revision's trouble changes: its queued spawns wake.
        self._changes: dict[tuple[str, str], asyncio.Event] = {}
        #: Set at shutdown: spawns that wait for their turn give up (nothing started).
        self._closing = False
        #: Spawn-to-ready time of this replica's spawns, per pool.
        self._ready: dict[str, ReadyTime] = {}

    # -- spawn-to-ready time ------------------------------------------------------------------

    def observe_ready(self, pool: str, seconds: float) -> None:
        """A spawn of `pool` got ready `seconds` after the runtime took it (see
        `Book.note_started`; after its row was written when that was not noted)."""
        spec = self._catalog.get(pool)
        if spec is not None:
            self._ready_time(spec).observe(seconds)

    def ready_s(self, pool: PoolSpec) -> float:
        """The pool's spawn-to-ready estimate (its seed until a spawn got ready)."""
        return self._ready_time(pool).seconds

    def _ready_time(self, pool: PoolSpec) -> ReadyTime:
        estimate = self._ready.get(pool.name)
        if estimate is None:
            estimate = self._ready[pool.name] = ReadyTime(pool.demand.ready_seed_s)
        return estimate

    # -- crash-loop back-off ------------------------------------------------------------------

    def trouble(self, pool: PoolSpec) -> SpawnTrouble | None:
        """The back-off of the pool's current revision, if its spawns fail and no worker
        got ready since (what gates its spawns; `failing` says what the pool shows)."""
        return self._trouble.get((pool.name, pool.revision))

    def failing(self, pool: PoolSpec) -> SpawnsFailing | None:
        """The spawn trouble of the pool's current revision as its status shows it, until
        the trouble is over (see `SpawnsFailing`)."""
        return self._failing.get((pool.name, pool.revision))

    def failing_revisions(self) -> dict[tuple[str, str], SpawnsFailing]:
        """Every pool revision whose spawns fail, as shown, by (pool, revision)."""
        return dict(self._failing)

    def backoff_left(self, pool: PoolSpec) -> float:
        """Seconds before the pool may start a spawn again (0: it may now). While the
        probe is in flight, its outcome decides: asked again at least every initial back-off
        (never 0, which would have a claim ask again at once, over and over)."""
        trouble = self._trouble.get((pool.name, pool.revision))
        if trouble is None:
            return 0.0
        left = max(0.0, trouble.retry_at - self._clock.monotonic())
        if self._probing(trouble):
            return max(left, pool.spawn_backoff.initial_s)
        return left

    def spawn_failed(
        self, pool: str, revision: str, error: str, *, waiting: str | None = None
    ) -> None:
        """A spawn of the revision failed (not created, or lost before ready): back off.
        `waiting`: the worker whose spawn failed, when it is kept (a pod no node fits)."""
        spec = self._catalog.get(pool)
        if spec is None:
            return
        self._metrics.revision_failures.labels(pool, revision, "spawn").inc()
        self._rollouts.note(pool, revision, Outcome.SPAWN_FAILURE)
        before = self._trouble.get((pool, revision))
        failures = 1 + (before.failures if before else 0)
        delay = spawn_backoff_s(failures, spec.spawn_backoff)
        self._trouble[(pool, revision)] = SpawnTrouble(
            failures, error, self._clock.monotonic() + delay
        )
        shown = self._failing.get((pool, revision))
        kept = shown.waiting if shown else set()
        if waiting is not None:
            kept.add(waiting)
        shown = self._failing[(pool, revision)] = SpawnsFailing(
            1 + (shown.failures if shown else 0),
            error,
            self._book.asks(),
            kept,
            self._clock.now(),
        )
        self._changed((pool, revision))
        if revision == spec.revision:
            self._metrics.spawn_failing.labels(pool).set(shown.failures)
        logs.event(
            "spawn_backoff",
            pool=pool,
            revision=revision,
            failures=failures,
            retry_in_s=round(delay, 3),
            error=error,
            level=logs.WARNING,
        )
        self._journal.record(EventKind.SPAWN_FAILED, pool=pool, detail=f"{revision}: {error}")

    def forget(self, pool: str) -> None:
        """Drop what this replica learnt of a pool deleted from the store: its revisions'
        spawn trouble (`/readyz` names it no more) and its spawn-to-ready time."""
        for key in [k for k in self._trouble if k[0] == pool]:
            del self._trouble[key]
            self._changed(key)
        for key in [k for k in self._failing if k[0] == pool]:
            del self._failing[key]
        self._ready.pop(pool, None)

    def spawn_ready(self, worker: Worker) -> None:
        """A worker got ready: its revision's spawns work (again) and its back-off ends;
        what the pool shows ends only if the trouble is over (see `SpawnsFailing`)."""
        key = (worker.pool, worker.revision)
        if self._trouble.pop(key, None) is not None:
            self._changed(key)
        shown = self._failing.get(key)
        if shown is None:
            return
        was_waiting = worker.id in shown.waiting
        shown.waiting.discard(worker.id)
        asked = self._book.asked(worker.id)
        # This replica's own spawn: by the order of its asks (times may tie on a virtual
        # clock). Another replica's (on Kubernetes every replica hears every pod get
        # ready): by its row's creation, after the last failure or not.
        if asked is not None:
            after = asked > shown.asked_before
        else:
            after = worker.created_at > shown.failed_at
        if not (after or was_waiting) or self._any_waiting(shown.waiting):
            return
        self._recovered(key)

    def settled(self, pool: str, revision: str) -> None:
        """The revision holds its warm target with ready workers and wants no spawn (the
        leader's pass): nothing is stuck, so what it shows of earlier failures ends, though
        no worker asked for after them got ready (a pool whose target was lowered, or one
        whose failed spawn was not needed after all; else it would show them until its next
        spawn, for hours in an idle pool)."""
        key = (pool, revision)
        if key in self._failing and key not in self._trouble:
            # (Still backing off: the next readiness or probe decides.)
            self._recovered(key)

    def _recovered(self, key: tuple[str, str]) -> None:
        """The spawn trouble of the (pool, revision) `key` is over: the pool shows it no
        more."""
        del self._failing[key]
        pool, revision = key
        spec = self._catalog.get(pool)
        if spec is not None and spec.revision == revision:
            self._metrics.spawn_failing.labels(pool).set(0)
        logs.event("spawn_recovered", pool=pool, revision=revision)

    def _any_waiting(self, worker_ids: set[str]) -> bool:
        """Whether one of the failed spawns kept waiting still does (this replica knows it
        as spawning); those that no longer do (retired meanwhile) are dropped from
        `worker_ids` on the way, so each is looked at until it goes, not at every
        readiness."""
        while worker_ids:
            worker_id = next(iter(worker_ids))
            known = self._book.known(worker_id)
            if known is not None and known.state is WorkerState.SPAWNING:
                return True
            worker_ids.discard(worker_id)
        return False

    def _allowed(self, pool: PoolSpec, count: int) -> int:
        """How many of `count` spawns may start now: none while backing off, one probe
        once the back-off ended."""
        trouble = self._trouble.get((pool.name, pool.revision))
        if trouble is None:
            return count
        if self._probing(trouble) or trouble.retry_at > self._clock.monotonic():
            return 0
        # The probe takes the slot of the next failure: until it fails or gets ready, no
        # other spawn starts (`_probe_reserved` names it once its slot is reserved).
        delay = spawn_backoff_s(trouble.failures, pool.spawn_backoff)
        self._trouble[(pool.name, pool.revision)] = replace(
            trouble, probe=None, retry_at=self._clock.monotonic() + delay
        )
        return min(count, 1)

    def _probe_reserved(self, pool: PoolSpec, workers: list[Worker]) -> None:
        """The slot `_allowed` let a backing-off revision reserve is its probe."""
        key = (pool.name, pool.revision)
        trouble = self._trouble.get(key)
        if trouble is not None and workers:
            self._trouble[key] = replace(trouble, probe=workers[0].id)

    def _probing(self, trouble: SpawnTrouble) -> bool:
        """Whether the revision's probe is still in flight (its slot still spawning)."""
        if trouble.probe is None:
            return False
        known = self._book.known(trouble.probe)
        return known is not None and known.state is WorkerState.SPAWNING

    def _turn_in(self, worker: Worker, pool: PoolSpec) -> float | None:
        """None when the spawn may start now (its revision's spawns work, or it is the
        probe, or it becomes the probe), else how long to wait before asking again."""
        key = (pool.name, pool.revision)
        trouble = self._trouble.get(key)
        if trouble is None or trouble.probe == worker.id:
            return None
        now = self._clock.monotonic()
        if self._probing(trouble):
            # Woken when the probe fails or gets ready; asks again at least this often.
            return max(trouble.retry_at - now, pool.spawn_backoff.initial_s)
        if trouble.retry_at > now:
            return trouble.retry_at - now
        delay = spawn_backoff_s(trouble.failures, pool.spawn_backoff)
        self._trouble[key] = replace(trouble, probe=worker.id, retry_at=now + delay)
        return None

    def close(self) -> None:
        """Shutdown: the spawns waiting for their turn give up now instead of probing
        through the grace (their slots stay for the next start to settle)."""
        self._closing = True
        for key in list(self._changes):
            self._changed(key)

    def _changed(self, key: tuple[str, str]) -> None:
        """Wake the spawns of the revision that wait for their turn."""
        event = self._changes.pop(key, None)
        if event is not None:
            event.set()

    async def _until_changed(self, key: tuple[str, str], seconds: float) -> None:
        """Wait until the revision's trouble changes (or shutdown), at most `seconds`."""
        if self._closing:
            return
        event = self._changes.setdefault(key, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await event.wait()

    def _crashed(self, pool: PoolSpec, what: str, exc: Exception) -> None:
        """A spawn of the revision raised before a slot was reserved (its template breaks
        the cap): an attempt and a failure, backed off like any other."""
        error = (
            f"spawns of revision {pool.revision} cannot be reserved "
            f"(the pool's template is faulty): {describe(exc)}"
        )
        self._metrics.spawn_failures.labels(pool.name, "crash").inc()
        self._rollouts.note(pool.name, pool.revision, Outcome.SPAWN)
        logs.event(
            "spawn_failed",
            pool=pool.name,
            revision=pool.revision,
            step=what,
            error=error,
            level=logs.WARNING,
        )
        self.spawn_failed(pool.name, pool.revision, error)

    async def spawn_warm(self, pool: PoolSpec, count: int, *, target: int) -> int:
        """Reserve up to `count` neutral spawn slots (never beyond `target`) and spawn them
        (fewer while the pool's spawns fail: see `SpawnTrouble`). A template the cap
        cannot be read from counts as a failed spawn and is raised on to the pass."""
        probe = (pool.name, pool.revision) in self._trouble
        count = self._allowed(pool, count)
        if count <= 0:
            return 0
        try:
            cap = self._catalog.pool_cap(pool)
        except Exception as exc:
            # A failed spawn (backed off, judged by the rollout) and a failed step of the
            # pass (the janitor notes the pool and goes on with the others).
            self._crashed(pool, "warm", exc)
            raise
        req = SpawnRequest(
            pool=pool.name,
            revision=pool.revision,
            count=count,
            owner=self._book.instance_id,
            pool_cap=cap,
            target=target,
        )
        ids = [self._ids.worker() for _ in range(count)]
        result = await self._lifecycle.reserve_slots(req, ids)
        if probe:
            self._probe_reserved(pool, result.workers)
        for worker in result.workers:
            self._book.remember(worker)
            self._metrics.spawns.labels(pool.name, "warm").inc()
            self._rollouts.note(pool.name, pool.revision, Outcome.SPAWN)
            self._book.spawn_task(self.create(worker, pool), f"spawn:{worker.id}")
        return len(result.workers)

    async def reserve_cold_slot(self, pool: PoolSpec, org: str, org_cap: int) -> SpawnResult:
        """One spawn slot bound to `org` within the pool and org caps (not created yet);
        none, `limited_by` "backoff", while the pool's spawns fail and back off."""
        probe = (pool.name, pool.revision) in self._trouble
        if not self._allowed(pool, 1):
            return SpawnResult(workers=[], limited_by="backoff")
        try:
            cap = self._catalog.pool_cap(pool)
        except Exception as exc:
            self._crashed(pool, "cold", exc)
            return SpawnResult(workers=[], limited_by="backoff")
        req = SpawnRequest(
            pool=pool.name,
            revision=pool.revision,
            count=1,
            owner=self._book.instance_id,
            org=org,
            pool_cap=cap,
            org_cap=org_cap,
        )
        result = await self._lifecycle.reserve_slots(req, [self._ids.worker()])
        if probe:
            self._probe_reserved(pool, result.workers)
        for worker in result.workers:
            self._book.remember(worker)
            self._metrics.spawns.labels(pool.name, "cold").inc()
            self._rollouts.note(pool.name, pool.revision, Outcome.SPAWN)
        return result

    async def create(self, worker: Worker, pool: PoolSpec) -> bool:
        """Create the runtime object of a spawning slot; a failure, whatever it raised,
        frees the slot at once and counts. While the revision backs off the spawn waits
        for its turn to probe (its slot kept, until it starts or is retired)."""
        turn = await self._turn(worker, pool)
        if turn is not Turn.GO:
            # Retired (and forgotten) while it waited for its turn (a shutdown, a stuck
            # sweep, another replica): its stop found no process, so none may start now.
            self._book.drop_spawn_wait(worker.id)
            if turn is Turn.EXPIRED:
                # Its spawn timeout ran out while the revision backed off: the slot goes
                # back now (nothing was started), as the stuck sweep would retire it.
                await self._retirer.retire(worker, RetireReason.STUCK, stop=False)
            return False
        # While the runtime holds the spawn (queued behind other start-ups, or starting the
        # process) the stuck sweep leaves the row alone: its spawn timeout has not begun.
        self._book.mark_in_flight(worker.id)
        self._book.note_asked(worker.id)
        try:
            ref = await self._runtime.spawn(worker, pool)
        except SpawnWithdrawn:
            # Stopped while it waited for a start-up slot: retired already, nothing failed.
            self._book.drop_spawn_wait(worker.id)
            return False
        except RuntimeFailure as exc:
            self._metrics.spawn_failures.labels(pool.name, "create").inc()
            logs.worker_event("spawn_failed", worker, error=str(exc), level=logs.WARNING)
            self.spawn_failed(worker.pool, worker.revision, str(exc))
            self._book.drop_spawn_wait(worker.id)
            await self._retirer.retire(worker, RetireReason.SPAWN_FAILURE, stop=False)
            return False
        except Exception as exc:
            # Not a runtime's word for a failure (a template value of the wrong type met
            # the runtime): a failed spawn all the same. The runtime may have started
            # something before it raised, so the retirement stops what it finds.
            error = crash_error(worker, exc)
            self._metrics.spawn_failures.labels(pool.name, "crash").inc()
            logs.worker_event("spawn_failed", worker, error=error, level=logs.ERROR)
            self.spawn_failed(worker.pool, worker.revision, error)
            self._book.drop_spawn_wait(worker.id)
            await self._retirer.retire(worker, RetireReason.SPAWN_FAILURE)
            return False
        finally:
            # Cleared before anything else can happen: once ready, the worker is offered to
            # claims, which skip what is in flight.
            self._book.clear_in_flight(worker.id)
        # The start-up begins now: the wait for the bucket and the runtime's start-up slot
        # is the queue of other spawns, not what a new worker takes to get ready.
        self._book.note_started(worker.id, self._clock.now())
        # Kept until written: if this write fails (or readiness overtakes it), the write
        # that makes the worker ready carries the ref instead.
        self._book.keep_unsaved_ref(worker.id, ref)
        current = self._book.known(worker.id) or worker
        if current.state is WorkerState.SPAWNING and current.epoch == worker.epoch:
            recorded = await self._lifecycle.move(
                current, WorkerState.SPAWNING, runtime_ref=dict(ref)
            )
            if recorded is not None:
                self._book.ref_saved(worker.id)
                self._book.remember(recorded)
        return True

    async def _turn(self, worker: Worker, pool: PoolSpec) -> Turn:
        """Wait for the token bucket and for the spawn's turn (see `_turn_in`), at most
        until the slot's spawn timeout."""
        key = (pool.name, pool.revision)
        deadline = worker.updated_at + pool.timeouts.spawn_s
        waited = False
        while not (waited and self._closing):
            await self._bucket.acquire()
            known = self._book.known(worker.id)
            if known is None or (known.state, known.epoch) != (WorkerState.SPAWNING, worker.epoch):
                return Turn.GONE
            wait = self._turn_in(worker, pool)
            if wait is None:
                # After a wait, the row may have been retired by another replica's sweep
                # (this book does not hear of it): read it before anything starts.
                return Turn.GO if not waited or await self._still_spawning(worker) else Turn.GONE
            left = deadline - self._clock.now()
            if left <= 0:
                return Turn.EXPIRED
            await self._until_changed(key, min(wait, left))
            waited = True
        return Turn.GONE

    async def _still_spawning(self, worker: Worker) -> bool:
        """Whether the store still holds the slot as it was reserved (False on a failed
        read: better a slot the sweep retires than a process without a row)."""
        fresh = await self._book.refresh(worker.id)
        return fresh is not None and (fresh.state, fresh.epoch) == (
            WorkerState.SPAWNING,
            worker.epoch,
        )
