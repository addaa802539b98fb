"""What warmth costs and buys (docs/warmth.md), and the claim log (docs/claim-log.md): each
replica counts its own share in memory and writes it in batches, off the claim path.

Worker time is *integrated from transitions*, not sampled: every state change this
replica's lifecycle writes closes the worker's span in its old state at the row's
`updated_at` (the write's own time) and opens the next, so a worker of this replica is
counted to the second in each state, however short. A flush (every fallback-reaper pass)
carries open spans up to now, then reconciles with the store's rows of this replica: a
worker another replica moved (the leader retiring it, a release through another replica)
or this replica adopted is placed by the row's `updated_at`, its last write; one another
replica took for a claim, by the change of its owner (`taken_at`, or the one before when
it changed hands again), from which the taker counts it. A worker that changed hands more
than once since this replica counted it is placed at the flush, by the first of the
changes the store keeps (`ReplicaStore.first_takes`). Spans are
split at hour boundaries exactly. Placeholder time is the leader's: the headroom it keeps
between its passes, in worker slots, with the placeholders' own requests.

An adopted worker's time before its adoption is its previous owner's up to that owner's last
ledger write (a clean stop writes one at its very end), and the adopter's from there: a
graceful restart loses no second. A replica killed outright loses what it counted since its
last write, unless the worker was not moved since: then the adopter counts it from there. A
worker a gone replica left starting or draining is retired, not adopted: the replica that
retires it counts it from the gone one's last ledger write (or the row's last write, if
later) up to the retirement. A
replica that outlives its expiry writes no more (the store refuses the writes of a replica
whose registration is not active): its adopters' counts from its last write are the only ones.

A retired worker's object may outlive its retirement: a pod terminates after its delete
is accepted, holding its requests on its node until the runtime reports it gone
(`terminated`). The replica that wrote the retirement (it requested the delete) remembers
the worker for a while and counts the time in between as draining; another replica never
hears of it, and a report of a worker not remembered is ignored.

A claim adds one to a count and appends one compact row in memory (no I/O); a flush
writes the cells that changed (cumulative per replica, so a failed write loses nothing)
and the log rows gathered since the last one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from stoker.control import logs
from stoker.control.catalog import Catalog
from stoker.control.metrics import Metrics
from stoker.domain.errors import CapacityError, OrgCapError, StoreError
from stoker.domain.ledger import (
    HOUR_S,
    ClaimEnding,
    ClaimLogEntry,
    LedgerCounts,
    LedgerKey,
    hour_of,
    resources_of,
    split_hours,
)
from stoker.domain.records import Claim, Worker
from stoker.domain.specs import CostSpec
from stoker.domain.states import LIVE, ClaimMode, RetireReason, WorkerState
from stoker.ports.clock import Clock
from stoker.ports.store import ReplicaStore

#: The ledger state each worker state's time counts in.
_TIME_STATE = {
    WorkerState.SPAWNING: "starting",
    WorkerState.RESERVED: "starting",
    WorkerState.ACTIVATING: "starting",
    WorkerState.WARM: "warm",
    WorkerState.HOT: "hot",
    WorkerState.HOT_IDLE: "hot_idle",
    WorkerState.DRAINING: "draining",
}
#: Log rows kept in memory while the store fails, at most (the oldest go first).
MAX_PENDING_ROWS = 100_000
#: Retirement reasons of workers that may have no runtime object left to terminate (a
#: spawn the runtime refused, a pod that vanished): a stopping replica does not guess.
_NO_OBJECT = frozenset({RetireReason.SPAWN_FAILURE.value, RetireReason.LOST.value})
#: A retired worker's terminating time is counted up to its pool's `stop_grace_s` plus
#: this (the kubelet's own latency, the watch's delivery): a pod that lingers (its
#: kubelet is gone) is never counted for longer.
TERMINATING_MARGIN_S = 30.0
#: ... and never longer than this, whatever the grace: a cell is kept two hours past its
#: hour, so a late addition still finds it whole.
MAX_TERMINATING_S = float(HOUR_S)
#: How long after that bound a late report (a watch outage, a kubelet that came back)
#: still counts it; a worker not reported gone by then is forgotten, not counted further.
TERMINATING_KEEP_S = 300.0
#: Retired workers remembered at most (the oldest are forgotten first).
MAX_TERMINATING = 10_000


@dataclass(slots=True)
class _Headroom:
    """A pool's placeholders as the leader keeps them: `slots` worker slots requesting
    `cpus` and `gib` in all, counted up to `since` already."""

    revision: str
    slots: float
    cpus: float
    gib: float
    since: float


@dataclass(slots=True, eq=False)
class _Span:
    """A worker's time in one state since `since`, counted up to there already."""

    pool: str
    revision: str
    org: str
    state: str
    since: float
    version: int
    cpus: float
    gib: float
    #: The cell key of the hour last added to (a span adds to the same hour's cell at
    #: every flush: one key made per hour, not per flush).
    key: LedgerKey | None = None
    #: The open spans it is carried with (`_Group`); None for a span carried alone (a
    #: terminating worker's, an adopted worker's gap).
    group: _Group | None = None
    #: A hot span's claim: if another replica releases it and a replica takes the parked
    #: worker before this one's flush, the claim's end says when the session ended.
    claim: str | None = None
    #: When it opened (`since` moves on as it is counted): another replica's first take of
    #: the worker after this ends this replica's time, even a take that committed after a
    #: flush here counted past it (a flush reads the row before the take commits, and
    #: carries the span up to its own time, past the take's).
    opened: float = field(init=False)

    def __post_init__(self) -> None:
        self.opened = self.since


@dataclass(slots=True, eq=False)
class _Group:
    """The open spans that add alike to the same cells (one pool, revision, org and state,
    with the same resources), carried in one step at a flush instead of one by one: a
    fleet of a thousand workers is a few groups. `settled` members are counted up to
    `carried`; the `fresh` ones, opened since (or placed at a row's write later than the
    last flush), from their own `since`."""

    pool: str
    revision: str
    org: str
    state: str
    cpus: float
    gib: float
    carried: float
    settled: int = 0
    #: By `id` (in the order they opened: a deterministic sum).
    fresh: dict[int, _Span] = field(default_factory=dict)
    #: As a span's: the cell key of the hour last added to.
    key: LedgerKey | None = None


@dataclass(slots=True)
class _Terminating:
    """A worker this replica retired, whose object may still hold its node share: its
    `span` (draining, from the retirement) is counted up to the report of its end, at most
    up to `until`; it is forgotten at `forget_at`. `stopped`: its retirement stopped an
    object known to be there (not a failed spawn's or a lost worker's, which may have
    none), so a stopping replica counts it up to its stop."""

    span: _Span
    until: float
    forget_at: float
    stopped: bool


class Ledger:
    """This replica's ledger cells and claim log rows until they are written."""

    def __init__(
        self,
        *,
        clock: Clock,
        catalog: Catalog,
        instance_id: str,
        metrics: Metrics,
        ends_reported: bool = True,
    ) -> None:
        self._clock, self._catalog, self._instance_id = clock, catalog, instance_id
        #: Whether the runtime reports the end of an object it stopped (`terminated`; a
        #: pod's): a local process's stop waits for its exit, and nothing is left to count.
        self._ends_reported = ends_reported
        #: Cumulative counts of the cells of hours not yet over and written.
        self._cells: dict[LedgerKey, LedgerCounts] = {}
        self._dirty: set[LedgerKey] = set()
        self._open: dict[str, _Span] = {}
        #: The open spans by what they add to (`_Group`).
        self._groups: dict[tuple[str, str, str, str, float, float], _Group] = {}
        #: Per pool: the headroom it keeps since when (`_Headroom`).
        self._placeholders: dict[str, _Headroom] = {}
        self._arrivals: list[ClaimLogEntry] = []
        self._endings: list[ClaimEnding] = []
        self._failures = itertools.count(1)
        self._resources: dict[tuple[str, str], tuple[float, float]] = {}
        #: How long a placeholder count stands without a new headroom pass.
        self.placeholder_stale_s = 60.0
        self._worker_seconds = metrics.ledger_worker_seconds
        self._idle_cost = metrics.ledger_idle_cost
        self._avoided = metrics.ledger_cold_start_avoided
        self._ready_mean: dict[str, tuple[int, float]] = {}
        #: Adopted workers' rows as their previous owner left them, and the adoption's time
        #: (and orphans' rows before each move this replica wrote, and the move's time):
        #: the time between is counted at the next flush.
        self._gaps: list[tuple[Worker, float]] = []
        #: Workers of replicas that are gone which this replica retires (`orphaned`), as
        #: last written (the row a move without its fence, a claim's end, started from):
        #: their owners.
        self._orphans: dict[str, Worker] = {}
        #: Metric increments gathered in memory and added at each flush (no metric call on
        #: the claim path): (series, labels) -> amount.
        self._metered: dict[tuple[str, str, str], float] = {}
        #: Whether the store refused a write (this replica's registration is not active).
        self._refused = False
        #: Workers this replica retired, until their runtime object is reported gone (or
        #: forgotten), in the order retired.
        self._terminating: dict[str, _Terminating] = {}
        #: Hot spans ended at another replica's take, with the take's time: placed at their
        #: claim's end at the next flush (`_place_releases`).
        self._released: list[tuple[_Span, float]] = []
        #: Spans of workers that changed hands more than once since they opened: the
        #: worker's id, the span, the earliest change its row shows (the first one is no
        #: later) and whether it was taken; ended at the first change at the next flush
        #: (`_place_unsure`, one read for them all).
        self._unsure: list[tuple[str, _Span, float, bool]] = []

    # -- what the other parts tell it (in memory only) --------------------------------------

    def moved(
        self, before: WorkerState | None, worker: Worker, previous: Worker | None = None
    ) -> None:
        """The lifecycle wrote `worker` (coming from `before`; None for a new spawn slot),
        fenced on the row `previous` (when it was a `move`)."""
        at = worker.updated_at
        if before is None:
            self._cell(worker.pool, worker.revision, worker.org or "", at).spawns += 1
        orphan = self._orphans.get(worker.id)
        if orphan is not None and orphan.owner == worker.owner:
            self._orphan_moved(previous or orphan, worker)
        span = self._open.get(worker.id)
        # A flush that ran while the write was in flight may have counted the old state a
        # little past the write's time: the new one starts after it, never both at once.
        opened = at if span is None else max(at, self._end_span(span, before, worker, previous, at))
        if worker.state is WorkerState.RETIRED:
            self._retired(worker, span, at)
        else:
            self._open_span(worker, opened)

    def _end_span(
        self,
        span: _Span,
        before: WorkerState | None,
        worker: Worker,
        previous: Worker | None,
        at: float,
    ) -> float:
        """Close the open `span` for this replica's write `worker` at `at` (coming from
        `before`). Since this replica last counted the worker, another replica may have
        taken it (its owner changed: this replica's time ends at that take, `_left_by`), or
        moved it while it stayed this replica's (a release through another replica): then
        the span's state ends at that move, and the time from there to this write is
        counted in the state the move left (`before`), from the move's time as the row
        tells it (the row this write was fenced on, or a parked worker's `idle_since`);
        when it does not, at this write, as before. Returns up to when the worker's time
        is counted now."""
        since = _since(span)
        left, unsure = self._left_by(span, since, worker, previous, at)
        state = _TIME_STATE.get(before) if before is not None else None
        if left < at or state is None or state == span.state:
            self._close(worker.id, left, taken=left < at, unsure=unsure)
            return max(since, left)
        changed = previous.updated_at if previous is not None else None
        if changed is None and before is WorkerState.HOT_IDLE:
            changed = worker.idle_since
        if changed is None or not since < changed < at:
            self._close(worker.id, at)
            return max(since, at)
        self._close(worker.id, changed)
        self._carry_after(span, state, changed, at, org=(previous or worker).org or "")
        return at

    def _carry_after(
        self, span: _Span, state: str, start: float, end: float, *, org: str | None = None
    ) -> None:
        """Count the worker of the ended `span` (its pool, revision and resources) in
        `state` from `start` to `end`: the time after a move this replica did not write."""
        after = _Span(
            span.pool,
            span.revision,
            span.org if org is None else org,
            state,
            start,
            0,
            span.cpus,
            span.gib,
        )
        self._carry_span(after, end)

    def _left_by(
        self, span: _Span, since: float, worker: Worker, previous: Worker | None, at: float
    ) -> tuple[float, bool]:
        """When this replica's time of the worker of the open `span` ends, for its write
        `worker` at `at`: at the write, unless another replica took the worker since this
        replica's last flush. Then at that take: the write is of a row another replica
        holds, or takes the worker back (the row's `prior_taken_at`, the take before), or
        moves a row another replica held (as `_left_at` reads them). `since`: up to when the
        span is counted. And whether earlier takes may precede it (see `_left_at`): a take
        back follows another replica's take, which may have followed others."""
        me = self._instance_id
        if worker.owner != me:
            left, unsure = _left_at(worker, span, me)
            return max(since, min(left, at)), unsure
        prior = worker.prior_taken_at
        if (
            worker.taken_at is not None
            and worker.taken_at >= at
            and prior is not None
            and prior > span.opened
        ):
            return max(since, min(prior, at)), True
        if previous is not None and previous.owner != me:
            left, unsure = _left_at(previous, span, me)
            return max(since, min(left, at)), unsure
        return at, False

    def terminated(self, worker_id: str, at: float) -> None:
        """The runtime object of worker `worker_id` holds its node share no more at `at`
        (a pod this replica deleted ended or left the cluster): if this replica retired it,
        its time from the retirement up to then is counted as draining, up to its bound. A
        worker not remembered (retired by another replica, or long ago) is ignored."""
        held = self._terminating.pop(worker_id, None)
        if held is not None:
            self._carry_span(held.span, min(at, held.until))

    def _retired(self, worker: Worker, span: _Span | None, at: float) -> None:
        """Remember a worker this replica just retired, in its span's pool, revision and
        org (without a span here, an orphan's: its row's), until its runtime object is
        reported gone (with a runtime that reports it)."""
        if not self._ends_reported:
            return
        if span is None:
            cpus, gib = self._resources_of(worker.pool, worker.revision)
            span = _Span(worker.pool, worker.revision, worker.org or "", "", at, 0, cpus, gib)
        # The grace the retirement's stop was given.
        grace = self._catalog.stop_grace_s(worker.pool)
        until = at + min(grace + TERMINATING_MARGIN_S, MAX_TERMINATING_S)
        draining = _Span(
            span.pool, span.revision, span.org, "draining", at, worker.version, span.cpus, span.gib
        )
        stopped = worker.reason not in _NO_OBJECT
        self._terminating[worker.id] = _Terminating(
            draining, until, until + TERMINATING_KEEP_S, stopped
        )
        if len(self._terminating) > MAX_TERMINATING:
            del self._terminating[next(iter(self._terminating))]

    def orphaned(self, worker: Worker) -> None:
        """This replica retires worker `worker_id`, which `owner`, a replica that is gone,
        left starting or draining, or parked past its TTL or in a session past its lease
        (a fallback reaper's): not adopted, it keeps its owner.

        Each move this replica writes of it counts the time since the row's previous write,
        or since its owner's last ledger write if later (an adoption's rule), in the state
        the row was in, up to its retirement. A move is fenced on the row's version, so of
        two replicas retiring the same worker (a leader and the next), each piece of its
        time is counted by the one whose write ended it, once.
        """
        if worker.owner != self._instance_id:
            self._orphans[worker.id] = worker

    def _orphan_moved(self, previous: Worker, worker: Worker) -> None:
        # Counted at the next flush, which reads the owner's last ledger write.
        self._gaps.append((previous, worker.updated_at))
        if worker.state in LIVE:
            self._orphans[worker.id] = worker
        else:
            del self._orphans[worker.id]

    def adopted(self, previous: Worker, worker: Worker) -> None:
        """This replica adopted `worker`; `previous` is its row as the previous owner left it.

        The previous owner counted the worker up to its last ledger write; the time from there
        (or from the row's last write, if later) to the adoption is counted at the next flush,
        which reads that write's time. From the adoption on the worker is this replica's
        (an adoption keeps the state: no move tells of it).
        """
        self._gaps.append((previous, worker.updated_at))
        self._orphans.pop(worker.id, None)
        self._close(worker.id, worker.updated_at)
        self._open_span(worker, worker.updated_at)

    def spawn_ready(self, worker: Worker, seconds: float) -> None:
        """A spawn of this replica answered its readiness probe `seconds` after it started."""
        self._cell(worker.pool, worker.revision, worker.org or "", self._clock.now()).add_ready(
            seconds
        )
        n, total = self._ready_mean.get(worker.pool, (0, 0.0))
        self._ready_mean[worker.pool] = (n + 1, total + seconds)

    def claimed(self, claim: Claim, *, revision: str, wait_s: float) -> None:
        """A claim was bound after waiting `wait_s` since it arrived. It is counted in the
        hour it arrived, as the claim log files it, so that an hour's claims read the same
        in the ledger and in an export of that hour (a wait is at most an hour, and a cell
        is kept two hours past its own)."""
        now = self._clock.now()
        source = claim.source.value
        self._cell(claim.pool, revision, claim.org, now - wait_s).add_claim(source, wait_s)
        if source != "cold":
            n, total = self._ready_mean.get(claim.pool, (0, 0.0))
            if n:
                self._meter("avoided", claim.pool, "", total / n)
        self._log(
            ClaimLogEntry(
                id=claim.id,
                at=now - wait_s,
                pool=claim.pool,
                org=claim.org,
                mode=claim.mode.value,
                source=source,
                wait_s=wait_s,
                held_s=None,
                outcome="open",
                revision=revision,
            )
        )

    def failed(
        self,
        *,
        pool: str,
        revision: str,
        org: str,
        mode: ClaimMode,
        wait_s: float,
        error: BaseException,
    ) -> None:
        """A claim got no worker: `error` is what its requester was told. Counted in the
        hour it arrived, as `claimed`."""
        now = self._clock.now()
        self._cell(pool, revision, org, now - wait_s).add_failure(wait_s)
        outcome = "failed"
        if isinstance(error, OrgCapError):
            outcome = "org_cap"
        elif isinstance(error, CapacityError) and error.reason in ("pool_cap", "no_capacity"):
            outcome = error.reason
        self._log(
            ClaimLogEntry(
                id=f"failed-{self._instance_id}-{next(self._failures)}",
                at=now - wait_s,
                pool=pool,
                org=org,
                mode=mode.value,
                source=None,
                wait_s=wait_s,
                held_s=None,
                outcome=outcome,
                revision=None,
            )
        )

    def claim_ended(self, claim: Claim) -> None:
        """A bound claim ended (released, expired or failed), by this replica's write."""
        ended = claim.ended_at if claim.ended_at is not None else claim.updated_at
        self._endings.append(
            ClaimEnding(
                id=claim.id,
                pool=claim.pool,
                org=claim.org,
                mode=claim.mode.value,
                source=claim.source.value,
                bound_at=claim.created_at,
                held_s=max(0.0, ended - claim.created_at),
                outcome=claim.state.value,
            )
        )
        if len(self._endings) > MAX_PENDING_ROWS:
            del self._endings[: len(self._endings) - MAX_PENDING_ROWS]

    def placeholders(
        self, pool: str, revision: str, slots: float, *, requests: tuple[float, float]
    ) -> None:
        """The leader keeps `slots` worker slots of placeholders for `pool` from now on,
        which request `requests` (CPUs, GiB) in all."""
        now = self._clock.now()
        self._accrue_placeholders(pool, now)
        self._placeholders[pool] = _Headroom(revision, slots, *requests, since=now)

    # -- writing ----------------------------------------------------------------------------

    async def flush(self, store: ReplicaStore, *, final: bool = False) -> None:
        """Carry open spans up to now, reconcile with the store's rows of this replica, and
        write the cells that changed and the log rows gathered (a failure keeps them).

        `final`: the replica stops. The workers it retired whose objects still terminate
        are counted as draining up to now (within their bound), since no report of their
        end will reach it: their time after the stop is not counted by anyone."""
        now = self._clock.now()
        if final:
            for held in self._terminating.values():
                if held.stopped:
                    self._carry_span(held.span, min(now, held.until))
            self._terminating.clear()
        if self._gaps:
            await self._count_gaps(store)
        if self._orphans:
            await self._forget_orphans(store)
        try:
            mine = await store.list_workers(owner=self._instance_id, states=LIVE)
        except StoreError as exc:
            logs.event("ledger_read_failed", error=str(exc), level=logs.WARNING)
            mine = None
        if mine is not None:
            self._reconcile(mine, now)
            await self._close_gone(store, {w.id for w in mine}, now)
        if self._unsure:
            await self._place_unsure(store)
        if self._released:
            await self._place_releases(store)
        self._carry_groups(now)
        for pool in list(self._placeholders):
            self._accrue_placeholders(pool, now)
        self._forget_terminating(now)
        self._publish_metrics()
        await self._write(store, now)

    async def _place_unsure(self, store: ReplicaStore) -> None:
        """End the spans of workers that changed hands more than once since this replica
        counted them at the first change, as the store kept it; at the earliest change
        their rows kept when it cannot be read."""
        pending, self._unsure = self._unsure, []
        firsts: list[float | None]
        try:
            firsts = await store.first_takes([(w, span.opened) for w, span, _, _ in pending])
        except StoreError as exc:
            logs.event("ledger_read_failed", error=str(exc), level=logs.WARNING)
            firsts = [None] * len(pending)
        for (_, span, at, taken), first in zip(pending, firsts, strict=True):
            left = max(span.since, at if first is None else min(first, at))
            if taken and span.claim is not None and left > span.since:
                self._released.append((span, left))
            else:
                self._carry_span(span, left)

    async def _place_releases(self, store: ReplicaStore) -> None:
        """Count the sessions another replica released, of workers taken before this
        replica saw the release: hot up to the claim's end, parked from there to the take.
        A claim that cannot be read leaves its span hot up to the take."""
        released, self._released = self._released, []
        for span, taken_at in released:
            try:
                claim = await store.get_claim(span.claim or "")
            except StoreError as exc:
                logs.event("ledger_read_failed", error=str(exc), level=logs.WARNING)
                claim = None
            ended = claim.ended_at if claim is not None else None
            if ended is None or not span.since < ended < taken_at:
                self._carry_span(span, taken_at)
                continue
            self._carry_span(span, ended)
            self._carry_after(span, "hot_idle", ended, taken_at)

    def _forget_terminating(self, now: float) -> None:
        """Forget the retired workers not reported gone in time: their object never went
        (or was gone before the retirement: a lost worker's), so nothing more is counted."""
        if self._terminating:
            for worker_id in [w for w, h in self._terminating.items() if h.forget_at <= now]:
                del self._terminating[worker_id]

    async def _count_gaps(self, store: ReplicaStore) -> None:
        """Count adopted workers' time from their previous owner's last ledger write (or the
        row's last write, if later) up to the adoption, in the state the row was left in."""
        written: dict[str, float | None] = {}
        gaps, self._gaps = self._gaps, []
        for index, (previous, adopted_at) in enumerate(gaps):
            owner = previous.owner or ""
            if owner not in written:
                try:
                    written[owner] = await store.ledger_written_at(owner)
                except StoreError as exc:
                    logs.event("ledger_read_failed", error=str(exc), level=logs.WARNING)
                    self._gaps = gaps[index:]
                    return
            state = _TIME_STATE.get(previous.state)
            start = max(previous.updated_at, written[owner] or 0.0)
            if state is None or adopted_at <= start:
                continue
            cpus, gib = self._resources_of(previous.pool, previous.revision)
            org = previous.org or ""
            gap = _Span(previous.pool, previous.revision, org, state, start, 0, cpus, gib)
            self._carry_span(gap, adopted_at)

    async def _forget_orphans(self, store: ReplicaStore) -> None:
        """Forget the orphans retired meanwhile by another replica (a leader before or after
        this one), whose write counted their last piece, or adopted since (by this replica
        or another: then counted as adopted)."""
        for worker_id, orphan in list(self._orphans.items()):
            try:
                row = await store.get_worker(worker_id)
            except StoreError:
                return
            if row is None or row.state not in LIVE or row.owner != orphan.owner:
                del self._orphans[worker_id]

    def _reconcile(self, rows: list[Worker], now: float) -> None:
        for row in rows:
            span = self._open.get(row.id)
            if span is None:
                # Adopted, or this replica's before it started counting: from its last write.
                self._open_span(row, min(row.updated_at, now))
            elif row.version > span.version and _TIME_STATE.get(row.state) != span.state:
                # Moved by another replica: the change is its row's last write.
                self._close(row.id, max(_since(span), min(row.updated_at, now)))
                self._open_span(row, max(row.updated_at, 0.0))

    async def _close_gone(self, store: ReplicaStore, live: set[str], now: float) -> None:
        """Close the spans of workers no longer live and ours: retired or taken over by
        another replica's write, at that write's time, or taken by another replica for a
        claim, at the reservation (`_left_at`; now, when the row cannot be read)."""
        for worker_id in [w for w in self._open if w not in live]:
            span = self._open.get(worker_id)
            try:
                row = await store.get_worker(worker_id)
            except StoreError:
                row = None
            if span is None or self._open.get(worker_id) is not span:
                # This replica wrote it meanwhile (the move closed the span it knew).
                continue
            if row is not None and row.owner == self._instance_id and row.state in LIVE:
                # Taken back by this replica while the flush read its rows: still counting.
                continue
            left, unsure = (now, False) if row is None else _left_at(row, span, self._instance_id)
            taken = row is not None and row.owner != self._instance_id and row.state in LIVE
            self._close(worker_id, max(_since(span), min(left, now)), taken=taken, unsure=unsure)

    async def _write(self, store: ReplicaStore, now: float) -> None:
        if self._dirty:
            cells = {key: self._cells[key].copy() for key in self._dirty}
            try:
                written = await store.record_ledger(self._instance_id, cells, now=now)
            except StoreError as exc:
                logs.event("ledger_write_failed", error=str(exc), level=logs.WARNING)
            else:
                if not written and not self._refused:
                    # This replica's registration expired (or it stopped): the workers it
                    # held are others' now, counted by them from its last write.
                    logs.event(
                        "ledger_write_refused", reason="registration_not_active", level=logs.WARNING
                    )
                self._refused = self._refused or not written
                self._dirty.clear()
                # A cell is kept two hours past its hour: a late span (a move another
                # replica wrote, reconciled later) still adds to the whole of it.
                over = [k for k in self._cells if k.hour + 3 * HOUR_S <= now]
                for key in over:
                    del self._cells[key]
        if self._arrivals or self._endings:
            arrivals, endings = self._arrivals, self._endings
            self._arrivals, self._endings = [], []
            try:
                await store.record_claim_log(arrivals, endings)
            except StoreError as exc:
                logs.event("claim_log_write_failed", error=str(exc), level=logs.WARNING)
                self._arrivals[:0] = arrivals
                self._endings[:0] = endings

    # -- spans ------------------------------------------------------------------------------

    def _open_span(self, worker: Worker, at: float) -> None:
        state = _TIME_STATE.get(worker.state)
        if state is None or worker.owner != self._instance_id:
            return
        cpus, gib = self._resources_of(worker.pool, worker.revision)
        org = worker.org or ""
        span = _Span(worker.pool, worker.revision, org, state, at, worker.version, cpus, gib)
        ident = (worker.pool, worker.revision, org, state, cpus, gib)
        group = self._groups.get(ident)
        if group is None:
            # Carried up to now at the latest: a span placed at a later write stays fresh.
            group = self._groups[ident] = _Group(*ident, carried=min(at, self._clock.now()))
        if at > group.carried:
            group.fresh[id(span)] = span
        else:
            # Opened before the group's last carry (a move placed at its row's write):
            # its own time up to there first, then it is carried with the others.
            self._carry_span(span, group.carried)
            group.settled += 1
        span.group = group
        if state == "hot":
            span.claim = worker.claim_id
        self._open[worker.id] = span

    def _close(
        self, worker_id: str, at: float, *, taken: bool = False, unsure: bool = False
    ) -> None:
        """End the open span of `worker_id` at `at` (not before its counted part ends).

        `taken`: at another replica's take. A worker is taken warm or parked, so a hot
        span ending there had its session released through another replica meanwhile:
        it is counted at the next flush, hot up to its claim's end and parked from there
        (`_place_releases`). `unsure`: `at` is a take that other takes may have preceded;
        the next flush ends the span at the first (`_place_unsure`)."""
        span = self._open.pop(worker_id, None)
        if span is None:
            return
        group = span.group
        assert group is not None
        if group.fresh.pop(id(span), None) is None:
            group.settled -= 1
            span.since = group.carried
        span.group = None
        if unsure:
            self._unsure.append((worker_id, span, at, taken))
        elif taken and span.claim is not None and at > span.since:
            self._released.append((span, at))
        else:
            self._carry_span(span, at)

    def _carry_groups(self, now: float) -> None:
        """Carry every open span up to `now`, a group at a time."""
        for ident, group in list(self._groups.items()):
            if group.settled and now > group.carried:
                self._add_time(group.pool, group.state, group.carried, now, group, group.settled)
            if group.fresh:
                # Each from its own start; one that starts later (a row written after now)
                # stays fresh until then.
                later = {}
                for key, span in group.fresh.items():
                    if span.since <= now:
                        self._carry_span(span, now)
                        group.settled += 1
                    else:
                        later[key] = span
                group.fresh = later
            group.carried = max(group.carried, now)
            if not group.settled and not group.fresh:
                del self._groups[ident]

    def _carry_span(self, span: _Span, until: float) -> None:
        if until <= span.since:
            return
        self._add_time(span.pool, span.state, span.since, until, span)
        span.since = until

    def _accrue_placeholders(self, pool: str, now: float) -> None:
        held = self._placeholders.get(pool)
        if held is None:
            return
        since, slots = held.since, held.slots
        until = min(now, since + self.placeholder_stale_s)
        if slots > 0 and until > since:
            # Per slot-second: a share of what the placeholders hold on their nodes.
            cpus, gib = held.cpus / slots, held.gib / slots
            for hour, seconds in split_hours(since, until):
                cell = self._cell_at(LedgerKey(pool, held.revision, "", hour))
                cell.add_time("placeholder", seconds * slots, cpus, gib)
            self._meter("seconds", pool, "placeholder", (until - since) * slots)
            self._idle_cost_of(pool, "headroom", (until - since) * slots, cpus, gib)
        held.since = now

    def _add_time(
        self, pool: str, state: str, start: float, end: float, span: _Span | _Group, n: int = 1
    ) -> None:
        """Add the time from `start` to `end` in `state` of `n` workers alike (`span`'s, or
        a group's) to their cells, hour by hour, and to the pool's meters."""
        hour = hour_of(start)
        if end <= hour + HOUR_S:
            # Within one hour (nearly every flush's carry): `split_hours`' one piece.
            self._cell_at(_key_at(span, hour)).add_time(
                state, (end - start) * n, span.cpus, span.gib
            )
        else:
            for hour, seconds in split_hours(start, end):
                self._cell_at(_key_at(span, hour)).add_time(state, seconds * n, span.cpus, span.gib)
        self._meter("seconds", pool, state, (end - start) * n)
        if state in ("warm", "hot_idle"):
            kind = "warm" if state == "warm" else "parked"
            self._idle_cost_of(pool, kind, (end - start) * n, span.cpus, span.gib)

    def _idle_cost_of(self, pool: str, kind: str, seconds: float, cpus: float, gib: float) -> None:
        """Meter `seconds` of idle `kind` time, each holding `cpus` and `gib`, at the pool's
        prices (nothing without them)."""
        spec = self._catalog.get(pool)
        cost: CostSpec | None = spec.cost if spec is not None else None
        if cost is None:
            return
        self._meter("cost", pool, kind, cost.of(seconds, seconds * cpus, seconds * gib))

    def _meter(self, series: str, pool: str, label: str, amount: float) -> None:
        key = (series, pool, label)
        self._metered[key] = self._metered.get(key, 0.0) + amount

    def _publish_metrics(self) -> None:
        metered, self._metered = self._metered, {}
        for (series, pool, label), amount in metered.items():
            if series == "seconds":
                self._worker_seconds.labels(pool, label).inc(amount)
            elif series == "cost":
                self._idle_cost.labels(pool, label).inc(amount)
            else:
                self._avoided.labels(pool).inc(amount)

    def _resources_of(self, pool: str, revision: str) -> tuple[float, float]:
        known = self._resources.get((pool, revision))
        if known is None:
            spec = self._catalog.revision_spec(pool, revision) or self._catalog.get(pool)
            known = resources_of(spec.template) if spec is not None else (0.0, 0.0)
            if spec is not None:
                self._resources[(pool, revision)] = known
        return known

    def _cell(self, pool: str, revision: str, org: str, at: float) -> LedgerCounts:
        return self._cell_at(LedgerKey(pool, revision, org, hour_of(at)))

    def _cell_at(self, key: LedgerKey) -> LedgerCounts:
        self._dirty.add(key)
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = LedgerCounts()
        return cell

    def _log(self, entry: ClaimLogEntry) -> None:
        self._arrivals.append(entry)
        if len(self._arrivals) > MAX_PENDING_ROWS:
            del self._arrivals[: len(self._arrivals) - MAX_PENDING_ROWS]


def _key_at(owner: _Span | _Group, hour: int) -> LedgerKey:
    """The key of `owner`'s cell of `hour`, kept on it: made once per hour, not per flush."""
    key = owner.key
    if key is None or key.hour != hour:
        key = owner.key = LedgerKey(owner.pool, owner.revision, owner.org, hour)
    return key


def _since(span: _Span) -> float:
    """Up to when the open `span` is counted: its own start, or its group's last carry."""
    group = span.group
    return span.since if group is None else max(span.since, group.carried)


def _left_at(row: Worker, span: _Span, me: str) -> tuple[float, bool]:
    """When the worker of `span` left this replica's time, as its row now reads, and
    whether earlier takes may precede that time. Taken by another replica (a claim there,
    an adoption): at the first change of its owner since the span opened, of the last two
    the row keeps (`prior_taken_at`, `taken_at`), however often the taker reserved it
    again since, and never before what is counted already; the row's later writes (the
    sessions, their ends) are the taker's, which counts the worker from the take on. When
    both are since the span opened, it may have changed hands before them too: unsure. A
    row written before `taken_at` existed: at its last reservation (`heartbeat_at`).
    Otherwise (a move another replica wrote, a retirement): at the row's last write."""
    if row.owner != me:
        since = _since(span)
        if row.taken_at is not None:
            opened = span.opened
            takes = [t for t in (row.prior_taken_at, row.taken_at) if t is not None and t > opened]
            # Taken before what is counted already (a flush that read the row just before
            # the take committed): count no more.
            if not takes:
                return since, False
            return max(since, min(takes[0], row.updated_at)), len(takes) > 1
        if row.heartbeat_at > since:
            return min(row.heartbeat_at, row.updated_at), False
    return row.updated_at, False
