"""The invariant checker: stoker's invariants I1-I8, checked all through a simulated run.

Two kinds of evidence, so that a violation is caught whether it lasts or not:

- **events**, as they happen: every session the load driver is handed a worker for and
  every session it ends, every worker and claim write a replica makes (its store is an
  `ObservedStore`), every activation a simulated worker receives, every change of
  leader, and every worker pod that disappears from the cluster;
- **checks** of the shared store every `check_interval_s`: of its live workers and bound
  claims as the replicas' acknowledged writes left them (`WrittenRows`, fed by the same
  reports), so they hold on whatever store the replicas share. Within one check,
  violations come in the order the rows were created.

The rules (a "pass" below is the scenario's reaper interval, the slowest loop that must
act: leaks are bounded by "TTL + 2 reaper intervals", also while leadership is lost):

- **I1** a claim is handed out for a worker that another live session still holds; two
  bound claims on one worker; a hot worker without exactly its one bound claim;
- **I2** an activated worker seen with a second org: in a claim, in a write, in an
  activation (a slot reserved for an org that goes back to warm before activation has
  served nobody: org is written once, `stoker.domain.states`);
- **I3** a hot_idle worker past its TTL + 2 passes that the org's `min_hot_idle` floor
  does not keep; a bound claim past its lease + 2 passes;
- **I4** a spawning, reserved or activating row past its timeout + 2 passes (for a
  spawning row whose pod is still Pending, the pool's `pending_s` when longer than
  `spawn_s`: the pod waits on the cluster);
- **I5** live workers above the pool cap or an org's cap (0 = unbounded);
- **I6** warm plus neutral spawning workers below the pool's warm target, with no warm
  spawn by any replica, for longer than 2 passes while the pool cap leaves room (claims
  may drain the pool between passes; a janitor that does not refill it is the fault);
  a bound claim whose worker is not serving it (the worker was drained, retired or lost
  and the claim was not failed), or whose pod has been gone for longer than 2 passes;
- **I7** a janitor's spawn that left more warm and neutral spawning workers than the
  target it asked for (two janitors overshooting); a worker retired twice;
- **I8** live workers above the pool's cap while a rollout is under way (checked by
  `stoker.sim.rollout`, every second of the rollout).

Each violation is recorded once per invariant and subject, with the run time, the details
and a short trace: the latest events about its subject and the latest events overall.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from stoker.domain.records import Claim, Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.cluster import PodPhase, WatchEventType
from stoker.ports.store import SpawnRequest
from stoker.sim.cluster import PodChange
from stoker.sim.written import WrittenRows

#: The pod label that names a worker (the Kubernetes runtime's `LABEL_WORKER_ID`).
WORKER_LABEL = "stoker.dev/worker-id"
#: Events kept: overall, and per subject (worker, claim, org).
_GLOBAL_EVENTS = 400
_SUBJECT_EVENTS = 12
#: Subjects whose events are kept: those of about the last this many subjects noted (a
#: week's replay notes millions of workers and claims, each history about a kilobyte).
SUBJECTS_KEPT = 20_000
#: Events of a trace: about the subject, then overall.
_TRACE_SUBJECT = 10
_TRACE_GLOBAL = 8

_FINISHED = (PodPhase.FAILED, PodPhase.SUCCEEDED)
_IN_FLIGHT = (WorkerState.SPAWNING, WorkerState.RESERVED, WorkerState.ACTIVATING)


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant: when (run seconds), which, about what, and the trace."""

    t: float
    invariant: str
    subject: str
    detail: str
    trace: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        """JSON-ready."""
        return {
            "t": round(self.t, 3),
            "invariant": self.invariant,
            "subject": self.subject,
            "detail": self.detail,
            "trace": list(self.trace),
        }


class ViolationLog:
    """The recent events (overall and per subject) and the violations, each recorded once
    per invariant and subject with a trace of the events before it."""

    def __init__(self, now: Callable[[], float], *, subjects: int = SUBJECTS_KEPT) -> None:
        self._now = now
        self.violations: list[Violation] = []
        self._reported: set[tuple[str, str]] = set()
        self._events: deque[tuple[float, str]] = deque(maxlen=_GLOBAL_EVENTS)
        #: The histories of the subjects noted since the last turn, and of those noted in
        #: the turn before (a turn ends when `subjects` are new): a subject noted in
        #: neither is forgotten, so at most twice `subjects` histories are held.
        self._subjects = subjects
        self._by_subject: dict[str, deque[tuple[float, str]]] = {}
        self._older: dict[str, deque[tuple[float, str]]] = {}

    def note(self, text: str, *subjects: str) -> None:
        """Record an event for traces (about `subjects`)."""
        entry = (self._now(), text)
        self._events.append(entry)
        for subject in subjects:
            history = self._by_subject.get(subject)
            if history is None:
                history = self._older.pop(subject, None)
                if history is None:
                    history = deque(maxlen=_SUBJECT_EVENTS)
                self._by_subject[subject] = history
                if len(self._by_subject) >= self._subjects:
                    self._older, self._by_subject = self._by_subject, {}
            history.append(entry)

    def histories(self) -> int:
        """How many subjects' histories are held."""
        return len(self._by_subject) + len(self._older)

    def violation(self, invariant: str, subject: str, detail: str) -> None:
        """Record a violation (once per invariant and subject) with its trace."""
        key = (invariant, subject)
        if key in self._reported:
            return
        self._reported.add(key)
        self.violations.append(
            Violation(
                t=self._now(),
                invariant=invariant,
                subject=subject,
                detail=detail,
                trace=self._trace(subject),
            )
        )

    def _trace(self, subject: str) -> tuple[str, ...]:
        history = self._by_subject.get(subject)
        if history is None:
            history = self._older.get(subject, deque())
        about = list(history)[-_TRACE_SUBJECT:]
        recent = list(self._events)[-_TRACE_GLOBAL:]
        merged = sorted(set(about) | set(recent))
        return tuple(f"t={t:.1f}s {text}" for t, text in merged)


class InvariantChecker:
    """Checks I1-I7 on events and every `check_interval_s`; see the module docstring.

    `pool_cap(pool)` and `org_cap(pool, org)` are the caps in force (0 = unbounded) and
    `floor(pool, org)` the org's hot_idle floor, as the policy's replicas compute them.
    """

    def __init__(
        self,
        *,
        now: Callable[[], float],
        wall: Callable[[], float],
        pools: Mapping[str, PoolSpec],
        pool_cap: Callable[[str], int],
        org_cap: Callable[[str, str], int],
        floor: Callable[[str, str], int],
        pass_s: float,
        check_interval_s: float,
    ) -> None:
        self.rows = WrittenRows()
        self._now = now
        self._wall = wall
        self._pools = dict(pools)
        self._pool_cap = pool_cap
        self._org_cap = org_cap
        self._floor = floor
        self.grace_s = 2 * pass_s
        self.check_interval_s = check_interval_s
        self.log = ViolationLog(now)
        self.note = self.log.note
        self.violation = self.log.violation
        #: The first org each worker was bound to (I2).
        self._orgs: dict[str, str] = {}
        #: Worker -> the claim its latest session holds (I1).
        self._held: dict[str, Claim] = {}
        self._retired: set[str] = set()
        #: Worker -> run time its pod was seen gone, terminating or finished (I6).
        self._pod_gone: dict[str, float] = {}
        #: Workers whose pod is Pending (I4: they wait on the cluster).
        self._pod_pending: set[str] = set()
        #: Pool -> run time warm + neutral spawning fell below the target (I6), and the
        #: last time a replica reserved neutral spawn slots for it.
        self._deficit_since: dict[str, float] = {}
        self._warm_spawned: dict[str, float] = {}
        self._leaders: set[int] = set()
        #: The most replicas that believed they led at one moment (informational: I7
        #: allows it, it only forbids what two janitors could break).
        self.max_concurrent_leaders = 0
        self.checks = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def violations(self) -> list[Violation]:
        """Every violation so far, in the order found."""
        return self.log.violations

    # -- running -------------------------------------------------------------------------

    def start(self) -> None:
        """Check every `check_interval_s` on the running loop until `stop`."""
        self._task = asyncio.ensure_future(self._loop())
        self._task.set_name("invariant-checker")

    async def stop(self) -> None:
        """Stop the periodic checks (a last `check` is the caller's to run)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            self.check()

    # -- events ----------------------------------------------------------------------------

    def session_bound(self, claim: Claim, latency_s: float) -> None:
        """The load driver was handed `claim` (I1: is its worker free? I2: same org?)."""
        worker = claim.worker_id
        self.note(
            f"session bound claim={claim.id} worker={worker} org={claim.org} "
            f"source={claim.source.value} latency={latency_s:.3f}s",
            worker,
            claim.id,
        )
        held = self._held.get(worker)
        if held is not None and held.id != claim.id and self.rows.still_bound(held.id):
            self.violation(
                "I1",
                worker,
                f"worker handed to claim {claim.id} (org {claim.org}) while claim {held.id} "
                f"(org {held.org}) still holds it",
            )
        self._same_org(worker, claim.org, f"claim {claim.id}")
        self._held[worker] = claim

    def session_ended(self, claim: Claim, how: str) -> None:
        """The load driver ended (or found ended) its session on `claim`."""
        self.note(f"session {how} claim={claim.id} worker={claim.worker_id}", claim.worker_id)
        held = self._held.get(claim.worker_id)
        if held is not None and held.id == claim.id:
            del self._held[claim.worker_id]

    def activation(self, worker_id: str, org: str, epoch: int) -> None:
        """A simulated worker received an activation (I2: never a second org)."""
        self.note(f"activation worker={worker_id} org={org} epoch={epoch}", worker_id)
        self._same_org(worker_id, org, f"an activation at epoch {epoch}")

    def worker_written(self, replica: int, before: WorkerState | None, worker: Worker) -> None:
        """A replica's write of a worker row succeeded (I2 on its org, I7 on retirement).

        A write that keeps the state (a heartbeat, an adoption) only updates the rows.
        """
        self.rows.worker_written(worker)
        if before is worker.state:
            return
        origin = before.value if before is not None else "new"
        reason = f" reason={worker.reason}" if worker.reason else ""
        self.note(
            f"cp-{replica} wrote worker={worker.id} {origin}->{worker.state.value} "
            f"epoch={worker.epoch} org={worker.org or '-'}{reason}",
            worker.id,
        )
        # Only an activated worker has served its org: a slot reserved for an org's cold
        # claim that went back to warm before activation is neutral (org is written once).
        if worker.org is not None and worker.activated:
            self._same_org(worker.id, worker.org, f"a write by cp-{replica}")
        if worker.state is WorkerState.RETIRED and before is not WorkerState.RETIRED:
            if worker.id in self._retired:
                self.violation("I7", worker.id, f"retired a second time by cp-{replica}")
            self._retired.add(worker.id)

    def claim_bound(self, replica: int, claim: Claim) -> None:
        """A replica bound (and stored) `claim` (I2: its worker's org)."""
        self.rows.claim_bound(claim)
        self._same_org(claim.worker_id, claim.org, f"claim {claim.id}")

    def claim_renewed(self, replica: int, claim: Claim) -> None:
        """A replica extended `claim`'s lease."""
        self.rows.claim_renewed(claim)

    def claim_ended(self, replica: int, claim: Claim) -> None:
        """A replica ended `claim` (released, expired or failed)."""
        self.rows.claim_ended(claim)

    def spawn_reserved(self, replica: int, req: SpawnRequest, reserved: int) -> None:
        """A replica reserved spawn slots (I7: a janitor never fills beyond its target)."""
        if req.target is None or reserved == 0:
            return
        self._warm_spawned[req.pool] = self._now()
        self.note(
            f"cp-{replica} reserved {reserved} warm spawn slots, target {req.target}", req.pool
        )
        neutral = self.rows.neutral[(req.pool, req.revision)]
        if neutral > req.target:
            self.violation(
                "I7",
                req.pool,
                f"cp-{replica}'s spawn left {neutral} warm and neutral spawning workers, "
                f"above its target of {req.target}",
            )

    def leader_changed(self, replica: int, leading: bool) -> None:
        """A replica started or stopped leading."""
        self.note(f"cp-{replica} {'started' if leading else 'stopped'} leading")
        if leading:
            self._leaders.add(replica)
        else:
            self._leaders.discard(replica)
        self.max_concurrent_leaders = max(self.max_concurrent_leaders, len(self._leaders))

    def pod_changed(self, change: PodChange) -> None:
        """The cluster's change stream: remember when a worker's pod went away."""
        pod = change.after
        worker = pod.labels.get(WORKER_LABEL)
        if worker is None:
            return
        if pod.phase == PodPhase.PENDING and change.type is not WatchEventType.DELETED:
            self._pod_pending.add(worker)
        else:
            self._pod_pending.discard(worker)
        if worker in self._pod_gone:
            return
        gone = (
            change.type is WatchEventType.DELETED
            or pod.deletion_timestamp is not None
            or pod.phase in _FINISHED
        )
        if gone:
            self._pod_gone[worker] = self._now()
            self.note(f"pod of worker={worker} gone ({pod.phase}, {pod.reason or '-'})", worker)

    # -- checks ------------------------------------------------------------------------------

    def check(self) -> None:
        """Check every rule on the rows as written (called periodically and at the end)."""
        self.checks += 1
        wall = self._wall()
        self._check_claims(wall)
        self._check_hot_idle(wall)
        self._check_in_flight(wall)
        self._check_caps()
        self._check_warm()

    def _check_claims(self, wall: float) -> None:
        # Every bound claim and hot worker is looked at, each check; only those that break
        # a rule are sorted (into the order the rows were listed in), not the fleet.
        rows = self.rows
        per_worker = rows.claims_per_worker
        for worker_id in sorted(w for w, n in per_worker.items() if n > 1):
            self.violation("I1", worker_id, f"{per_worker[worker_id]} bound claims on one worker")
        claims = rows.claims
        unbound = [
            w
            for w in rows.by_state.get(WorkerState.HOT, {}).values()
            if (c := claims.get(w.claim_id or "")) is None or c.worker_id != w.id
        ]
        for worker in rows.workers_in_order(unbound):
            self.violation(
                "I1", worker.id, f"hot without its bound claim (claim_id {worker.claim_id})"
            )
        workers = rows.workers
        astray = [
            c
            for c in claims.values()
            if (holder := workers.get(c.worker_id)) is None
            or holder.state is not WorkerState.HOT
            or holder.claim_id != c.id
        ]
        for claim in rows.claims_in_order(astray):
            holder = workers.get(claim.worker_id)
            if holder is not None and holder.state is WorkerState.HOT:
                self.violation(
                    "I1",
                    claim.worker_id,
                    f"claim {claim.id} is bound to a worker serving {holder.claim_id}",
                )
                continue
            if holder is not None:
                state = holder.state.value
            else:
                state = "retired" if claim.worker_id in self._retired else "gone"
            self.violation(
                "I6",
                claim.id,
                f"claim bound to worker {claim.worker_id} which is {state}: "
                "a lost worker's claim must fail",
            )
        now = self._now()
        expired_before = wall - self.grace_s
        expired = [c for c in claims.values() if c.expires_at < expired_before]
        for claim in rows.claims_in_order(expired):
            self.violation(
                "I3",
                claim.id,
                f"lease expired {wall - claim.expires_at:.0f}s ago (worker "
                f"{claim.worker_id}), beyond the {self.grace_s:.0f}s of two passes",
            )
        gone = [(w, t) for w, t in self._pod_gone.items() if now - t > self.grace_s]
        for worker_id, since in gone:
            held = self._held.get(worker_id)
            if held is not None and rows.still_bound(held.id):
                self.violation(
                    "I6",
                    held.id,
                    f"worker {worker_id}'s pod is gone since {now - since:.0f}s and "
                    "its claim is still bound",
                )
            else:
                # Settled: nothing more to watch for this pod.
                del self._pod_gone[worker_id]

    def _check_hot_idle(self, wall: float) -> None:
        groups: dict[tuple[str, str], list[tuple[float, str]]] = {}
        for worker in self.rows.in_states(WorkerState.HOT_IDLE):
            since = worker.idle_since if worker.idle_since is not None else worker.updated_at
            expires = since + (worker.ttl_s if worker.ttl_s is not None else 60.0)
            groups.setdefault((worker.pool, worker.org or ""), []).append((expires, worker.id))
        for (pool, org), members in groups.items():
            overdue = sorted(m for m in members if m[0] + self.grace_s < wall)
            removable = max(0, len(members) - self._floor(pool, org))
            for expires, worker_id in overdue[:removable]:
                self.violation(
                    "I3",
                    worker_id,
                    f"hot_idle of org {org} {wall - expires:.0f}s past its TTL, beyond the "
                    f"{self.grace_s:.0f}s of two passes ({len(members)} parked, floor "
                    f"{self._floor(pool, org)})",
                )

    def _check_in_flight(self, wall: float) -> None:
        for worker in self.rows.in_states(*_IN_FLIGHT):
            spec = self._pools.get(worker.pool)
            if spec is None:
                continue
            timeouts = spec.timeouts
            if worker.state is WorkerState.SPAWNING:
                waits = worker.id in self._pod_pending
                deadline = worker.updated_at + (
                    max(timeouts.spawn_s, timeouts.pending_s) if waits else timeouts.spawn_s
                )
            elif worker.state is WorkerState.RESERVED:
                deadline = worker.updated_at + timeouts.reserve_s
            else:
                deadline = max(worker.updated_at, worker.heartbeat_at) + timeouts.activation_s
            if wall > deadline + self.grace_s:
                self.violation(
                    "I4",
                    worker.id,
                    f"{worker.state.value} {wall - deadline:.0f}s past its timeout, beyond "
                    f"the {self.grace_s:.0f}s of two passes",
                )

    def _check_caps(self) -> None:
        per_pool: dict[str, int] = {}
        for pool, org, count in self.rows.org_counts():
            per_pool[pool] = per_pool.get(pool, 0) + count
            if org is not None:
                cap = self._org_cap(pool, org)
                if cap and count > cap:
                    self.violation("I5", f"{pool}/{org}", f"{count} live workers, org cap {cap}")
        for pool, count in per_pool.items():
            cap = self._pool_cap(pool)
            if cap and count > cap:
                self.violation("I5", pool, f"{count} live workers, pool cap {cap}")

    def _check_warm(self) -> None:
        now = self._now()
        for name, spec in self._pools.items():
            # Every revision's: during a rollout the warm target is split between them.
            neutral = sum(n for (pool, _rev), n in self.rows.neutral.items() if pool == name)
            live = self.rows.per_pool[name]
            cap = self._pool_cap(name)
            short = neutral < spec.warm_target and (cap == 0 or live < cap)
            since = self._deficit_since.get(name)
            if not short or (since is not None and self._warm_spawned.get(name, -1.0) >= since):
                # Full, or a janitor spawned since the shortfall began: claims draining the
                # pool between two passes are what the warm pool is for.
                self._deficit_since.pop(name, None)
                if short:
                    self._deficit_since[name] = now
                continue
            since = self._deficit_since.setdefault(name, now)
            if now - since > self.grace_s:
                self.violation(
                    "I6",
                    name,
                    f"{neutral} warm or spawning for a warm target of {spec.warm_target} "
                    f"since {now - since:.0f}s, with room under the cap",
                )

    def _same_org(self, worker: str, org: str, where: str) -> None:
        first = self._orgs.setdefault(worker, org)
        if first != org:
            self.violation("I2", worker, f"bound to org {first}, then to org {org} in {where}")


def count_by(items: Iterable[Violation]) -> dict[str, int]:
    """Violations per invariant."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.invariant] = counts.get(item.invariant, 0) + 1
    return dict(sorted(counts.items()))
