"""The book: what this replica remembers between store writes.

It holds the last persisted record of every worker this replica owns (and the claim each
hot one serves, as bound here), the ready queue of
each pool revision and the hot_idle queue of each pool and org (fed by runtime events and
releases), the in-flight set (workers being handed out right
now, which the sweeps leave alone), the runtime facts not persisted yet and the
background tasks; the claims waiting for a worker or a slot, and the cold spawns they
wait on, are its part `waiting`.

A claim takes from the ready queue the warm worker whose node holds the most sessions
(the runtime's `node_sessions`; the first queued on a tie, and always the first on a
runtime without nodes, whose book walks no queue): sessions are pinned against
disruption, so gathering them on fewer nodes leaves others with only warm workers, which
the cluster can give back.
Scale-down ranks its victims the other way (`sessions_beside`).

The store is the authority and the book only a hint: a stale queue entry costs one missed
CAS, never a double assignment. Nothing here writes the store; the parts that do (through
the lifecycle) record the outcome here afterwards (persist before mutate).

Nothing here outlives what it describes: a worker leaves its queue when this replica
records it in another state (or forgets it), a claim leaves the waiters when its wait
ends however it ends, and an emptied queue or waiter list is dropped, so after any run
of claims the book is back to the size of the fleet it holds.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Container, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from stoker.control import logs
from stoker.control.waiting import WaitingClaims
from stoker.domain.errors import StoreError
from stoker.domain.records import Claim, Worker, token_digest
from stoker.domain.states import WorkerState
from stoker.ports.store import StoreReader

_Fact = TypeVar("_Fact")


@dataclass(frozen=True, slots=True)
class PendingRetire:
    """A retirement whose write failed, as it was decided: retried if the row is still so."""

    state: WorkerState
    epoch: int
    reason: str
    stop: bool


@dataclass(frozen=True, slots=True)
class PendingFacts:
    """Runtime facts and retirements not persisted yet (a copy, for passes and tests)."""

    ready: Mapping[str, str]
    lost: Mapping[str, str]
    retire: Mapping[str, PendingRetire]


class Pending(Generic[_Fact]):
    """Facts about workers, by worker id, kept until a write persists them."""

    def __init__(self) -> None:
        self._facts: dict[str, _Fact] = {}

    def note(self, worker_id: str, fact: _Fact) -> None:
        """Remember `fact` until it is settled."""
        self._facts[worker_id] = fact

    def get(self, worker_id: str) -> _Fact | None:
        """The fact not persisted yet, if any."""
        return self._facts.get(worker_id)

    def take(self, worker_id: str) -> _Fact | None:
        """Remove and return the fact (to retry it)."""
        return self._facts.pop(worker_id, None)

    def settled(self, worker_id: str) -> None:
        """The fact is persisted or moot."""
        self._facts.pop(worker_id, None)

    def copy(self) -> dict[str, _Fact]:
        """Every fact, by worker id (a copy)."""
        return dict(self._facts)


class Book(WaitingClaims):
    """This replica's memory of its workers, queues, waiters and background tasks."""

    def __init__(
        self,
        *,
        reader: StoreReader,
        instance_id: str,
        node_sessions: Callable[[Worker], int | None] | None = None,
    ) -> None:
        """`node_sessions` is the runtime's count of the sessions on a worker's node; None
        for a runtime without nodes (claims take the first queued)."""
        super().__init__()
        self._reader = reader
        self.instance_id = instance_id
        self._node_sessions = node_sessions
        self._known: dict[str, Worker] = {}
        #: The claims this replica bound, by id, while their worker is known hot with them:
        #: a release or renewal here needs no read of what never changes in a claim.
        self._bound: dict[str, Claim] = {}
        #: Queues as ordered sets of worker ids (O(1) pop, put back and removal): warm by
        #: (pool, revision), hot_idle by (pool, org).
        self._ready: dict[tuple[str, str], OrderedDict[str, None]] = {}
        self._hot_idle: dict[tuple[str, str], OrderedDict[str, None]] = {}
        self._in_flight: set[str] = set()
        #: Facts not persisted yet (a failed write is retried by the next pass): readiness
        #: (the endpoint), loss (the reason) and retirements whose write failed.
        self.ready: Pending[str] = Pending()
        self.lost: Pending[str] = Pending()
        self.retirements: Pending[PendingRetire] = Pending()
        #: Runtime refs of spawns not persisted yet. The write that takes a worker out of
        #: `spawning` carries its ref, so that no worker becomes claimable without the ref
        #: another replica needs to adopt and to stop its process.
        self._unsaved_refs: dict[str, dict[str, Any]] = {}
        #: When the runtime took each spawn that is still starting (its process forked,
        #: its pod created): its spawn-to-ready time counts from there, not from the time
        #: it queued behind other spawns (docs/scaling.md).
        self._started: dict[str, float] = {}
        #: The order in which this replica asked the runtime for each spawn still starting,
        #: and how many it asked for: whether a worker that gets ready was asked for after a
        #: spawn failed (`Spawner.spawn_ready`). A count, not a time: two asks in one instant
        #: of the clock are still ordered.
        self._asked: dict[str, int] = {}
        self._asks = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        #: True once the replica stopped taking claims (`start_closing`); read on every
        #: claim and release, so a plain attribute rather than a property.
        self.closing = False

    # -- known workers ----------------------------------------------------------------------

    def known(self, worker_id: str) -> Worker | None:
        """The last persisted record of a worker this replica owns, if any."""
        return self._known.get(worker_id)

    def known_workers(self) -> dict[str, Worker]:
        """Every worker this replica owns, as last persisted (a copy)."""
        return dict(self._known)

    def remember(self, worker: Worker) -> Worker:
        """Record the last persisted state of a worker; one that retired or belongs to
        another replica is forgotten."""
        before = self._known.get(worker.id)
        if worker.state is WorkerState.RETIRED or worker.owner != self.instance_id:
            self._forget(worker.id)
        else:
            if before is not None and before.state is not worker.state:
                self._unqueue(before)
            if (
                before is not None
                and before.claim_id is not None
                and (worker.state is not WorkerState.HOT or worker.claim_id != before.claim_id)
            ):
                self._bound.pop(before.claim_id, None)
            self._known[worker.id] = worker
            if worker.state is not WorkerState.SPAWNING:
                self._started.pop(worker.id, None)
                self._asked.pop(worker.id, None)
        return worker

    def _forget(self, worker_id: str) -> None:
        self._started.pop(worker_id, None)
        self._asked.pop(worker_id, None)
        before = self._known.pop(worker_id, None)
        if before is not None:
            self._unqueue(before)
            self._bound.pop(before.claim_id or "", None)

    def remember_bound(self, claim: Claim) -> None:
        """Keep a claim this replica just bound (its worker remembered hot with it), with
        its token as the store keeps it."""
        known = self._known.get(claim.worker_id)
        if known is not None and known.claim_id == claim.id:
            self._bound[claim.id] = claim.evolve(token=token_digest(claim.token))

    def drop_bound(self, claim_id: str) -> None:
        """Forget a claim bound here that a write found ended."""
        self._bound.pop(claim_id, None)

    def bound_claim(self, claim_id: str) -> Claim | None:
        """A claim bound here whose worker is still known hot with it, as it was bound:
        its state and lease may have moved since (another replica may have ended it), what
        else it says never changes."""
        claim = self._bound.get(claim_id)
        if claim is None:
            return None
        known = self._known.get(claim.worker_id)
        if known is None or known.state is not WorkerState.HOT or known.claim_id != claim_id:
            del self._bound[claim_id]
            return None
        return claim

    async def refresh(self, worker_id: str) -> Worker | None:
        """Re-read a worker after a missed CAS: another replica may have taken it over."""
        try:
            fresh = await self._reader.get_worker(worker_id)
        except StoreError:
            return None
        if fresh is None:
            self._forget(worker_id)
            return None
        return self.remember(fresh)

    def load(self, workers: Iterable[Worker]) -> None:
        """Fill memory from workers this replica owns (after adoption)."""
        for worker in workers:
            self.remember(worker)
            if worker.state is WorkerState.WARM:
                self.offer_warm(worker)
            elif worker.state is WorkerState.HOT_IDLE:
                self.offer_hot_idle(worker)

    # -- queues -----------------------------------------------------------------------------

    def offer_warm(self, worker: Worker) -> None:
        """Queue a warm worker and wake the first claim waiting for one."""
        self._ready.setdefault((worker.pool, worker.revision), OrderedDict())[worker.id] = None
        self._wake_warm_waiter(worker.pool)

    def put_back_warm(self, worker: Worker) -> None:
        """Return a warm worker to the head of its queue (its claim was held by a cap)."""
        queue = self._ready.setdefault((worker.pool, worker.revision), OrderedDict())
        queue[worker.id] = None
        queue.move_to_end(worker.id, last=False)

    def offer_hot_idle(self, worker: Worker) -> None:
        """Queue a hot_idle worker for its org and wake that org's waiting claims."""
        if worker.org is None:
            return
        self._hot_idle.setdefault((worker.pool, worker.org), OrderedDict())[worker.id] = None
        self.hot_idle_parked(worker.pool, worker.org)

    def _unqueue(self, worker: Worker) -> None:
        """Take a worker out of the queue its last known state put it in."""
        if worker.state is WorkerState.WARM:
            queues, key = self._ready, (worker.pool, worker.revision)
        elif worker.state is WorkerState.HOT_IDLE and worker.org is not None:
            queues, key = self._hot_idle, (worker.pool, worker.org)
        else:
            return
        queue = queues.get(key)
        if queue is not None:
            queue.pop(worker.id, None)
            if not queue:
                del queues[key]

    def pop(
        self, state: WorkerState, pool: str, org: str, revision: str, *, also: Container[str] = ()
    ) -> Worker | None:
        """The next worker of a queue still known in `state` at `revision` (or one of `also`)
        and not being handed out, marked in flight (the caller clears it once its
        reservation is decided); None when the queue ran dry. A `warm` worker comes from
        the revision's ready queue, a `hot_idle` one from those `org` parked."""
        warm = state is WorkerState.WARM
        queues = self._ready if warm else self._hot_idle
        key = (pool, revision) if warm else (pool, org)
        queue = queues.get(key)
        found = None
        if queue and warm and self._node_sessions is not None:
            found = self._packed(queue, revision, also)
        while queue and found is None:
            known = self._known.get(queue.popitem(last=False)[0])
            if self._takeable(known, state, revision, also):
                found = known
        if queue is not None and not queue:
            del queues[key]
        if found is not None:
            self._in_flight.add(found.id)
        return found

    def _takeable(
        self, known: Worker | None, state: WorkerState, revision: str, also: Container[str]
    ) -> bool:
        """Whether a queued worker is still known in `state` at `revision` (or one of
        `also`) and not being handed out."""
        return (
            known is not None
            and known.state is state
            and (known.revision == revision or known.revision in also)
            and known.id not in self._in_flight
        )

    def _packed(
        self, queue: OrderedDict[str, None], revision: str, also: Container[str]
    ) -> Worker | None:
        """Out of a ready queue: the takeable worker whose node holds the most sessions
        (the first queued on a tie), and the stale entries it passed."""
        best: Worker | None = None
        most = -1
        stale: list[str] = []
        for worker_id in queue:
            known = self._known.get(worker_id)
            if known is None or not self._takeable(known, WorkerState.WARM, revision, also):
                stale.append(worker_id)
                continue
            held = self.sessions_beside(known)
            if held > most:
                best, most = known, held
        for worker_id in stale:
            del queue[worker_id]
        if best is not None:
            del queue[best.id]
        return best

    def sessions_beside(self, worker: Worker) -> int:
        """The sessions on the worker's node as the runtime last saw it (0 when unknown)."""
        held = self._node_sessions(worker) if self._node_sessions is not None else None
        return held or 0

    def heard_worker(self, worker: Worker) -> None:
        """The store's feed announced a worker row: another replica's worker that became
        claimable wakes a claim of this replica waiting for one (which then reserves it
        from the store); one of this replica's that another replica took over is
        forgotten."""
        if worker.owner == self.instance_id:
            return
        known = self._known.get(worker.id)
        if known is not None and worker.version > known.version:
            self._forget(worker.id)
        if worker.state is WorkerState.WARM:
            self._wake_warm_waiter(worker.pool)
        elif worker.state is WorkerState.HOT_IDLE:
            self.hot_idle_parked(worker.pool, worker.org)

    # -- in flight --------------------------------------------------------------------------

    def mark_in_flight(self, worker_id: str) -> None:
        """This replica is handing the worker out: keep the sweeps and other claims away."""
        self._in_flight.add(worker_id)

    def clear_in_flight(self, worker_id: str) -> None:
        """The hand-out ended (bound, given back or failed)."""
        self._in_flight.discard(worker_id)

    def in_flight(self) -> frozenset[str]:
        """Workers this replica is handing out right now (the sweeps leave them alone)."""
        return frozenset(self._in_flight)

    # -- facts not persisted yet, and unsaved runtime refs ----------------------------------

    def ready_settled(self, worker_id: str) -> None:
        """The readiness fact is persisted or moot, and so is the runtime ref it carried."""
        self.ready.settled(worker_id)
        self._unsaved_refs.pop(worker_id, None)

    def pending_facts(self) -> PendingFacts:
        """Facts and retirements still to persist (a copy)."""
        return PendingFacts(self.ready.copy(), self.lost.copy(), self.retirements.copy())

    def keep_unsaved_ref(self, worker_id: str, ref: Mapping[str, Any]) -> None:
        """Keep a spawn's runtime ref until a write carries it."""
        self._unsaved_refs[worker_id] = dict(ref)

    def with_unsaved_ref(self, worker_id: str, **changes: Any) -> dict[str, Any]:
        """`changes` plus the worker's runtime ref if its own write has not succeeded."""
        ref = self._unsaved_refs.get(worker_id)
        return changes if ref is None else {**changes, "runtime_ref": ref}

    def ref_saved(self, worker_id: str) -> None:
        """A write carried the worker's runtime ref."""
        self._unsaved_refs.pop(worker_id, None)

    # -- start-up times ---------------------------------------------------------------------

    def note_started(self, worker_id: str, at: float) -> None:
        """The runtime took the spawn of a worker this replica knows as spawning at `at`."""
        known = self._known.get(worker_id)
        if known is not None and known.state is WorkerState.SPAWNING:
            self._started[worker_id] = at

    def started_at(self, worker_id: str) -> float | None:
        """When the runtime took the worker's spawn (None: not noted, or no longer starting)."""
        return self._started.get(worker_id)

    def note_asked(self, worker_id: str) -> None:
        """This replica asks the runtime for the spawn of a worker it knows as spawning."""
        self._asks += 1
        known = self._known.get(worker_id)
        if known is not None and known.state is WorkerState.SPAWNING:
            self._asked[worker_id] = self._asks

    def asked(self, worker_id: str) -> int | None:
        """Which of this replica's asks the worker's spawn was (1 the first; None: not asked
        here, or no longer starting): a later ask has a larger number."""
        return self._asked.get(worker_id)

    def asks(self) -> int:
        """How many spawns this replica asked the runtime for (the number of the last)."""
        return self._asks

    # -- sizes ------------------------------------------------------------------------------

    def sizes(self) -> dict[str, int]:
        """How many entries each structure of the book holds: what a leak would grow.

        `known` follows the fleet this replica owns; every other entry belongs to work in
        progress (a queued worker, a waiting claim, a spawn, a fact, a task) and goes when
        that work ends.
        """
        return {
            "known": len(self._known),
            "bound": len(self._bound),
            "ready": sum(map(len, self._ready.values())),
            "ready_queues": len(self._ready),
            "hot_idle": sum(map(len, self._hot_idle.values())),
            "hot_idle_queues": len(self._hot_idle),
            "in_flight": len(self._in_flight),
            "spawn_waits": len(self._spawn_waits),
            "pending_ready": len(self.ready.copy()),
            "pending_lost": len(self.lost.copy()),
            "pending_retire": len(self.retirements.copy()),
            "unsaved_refs": len(self._unsaved_refs),
            "spawn_starts": len(self._started),
            "spawn_asks": len(self._asked),
            "warm_waiters": sum(map(len, self._warm_waiters.values())),
            "warm_waiter_pools": len(self._warm_waiters),
            "cap_waiters": sum(
                len(held) for by_org in self._cap_waiters.values() for held in by_org.values()
            ),
            "cap_waiter_keys": sum(map(len, self._cap_waiters.values())),
            "tasks": len(self._tasks),
        }

    # -- background tasks and shutdown ------------------------------------------------------

    def spawn_task(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` in the background, keeping a reference until it ends."""
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logs.event("task_failed", task=task.get_name(), error=repr(exc), level=logs.ERROR)

    def background_tasks(self) -> list[asyncio.Task[Any]]:
        """The background tasks still referenced (stops, spawns, claims being served)."""
        return list(self._tasks)

    async def wait_background(self, timeout: float) -> None:
        """Wait (bounded) for background stops and spawns to finish, then cancel the rest."""
        tasks = [t for t in self._tasks if not t.done()]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    def start_closing(self) -> None:
        """Stop taking claims; releases retire their workers instead of parking them."""
        self.closing = True
