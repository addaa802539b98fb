"""The invariant checker: DESIGN.md §4's I1-I7, checked all through a simulated run.

Two kinds of evidence, so that a violation is caught whether it lasts or not:

- **events**, as they happen: every session the load driver is handed a worker for and
  every session it ends, every worker write a replica makes (its store is wrapped by
  the policy), every activation a simulated worker receives, every change of leader, and
  every worker pod that disappears from the cluster;
- **checks** of the shared store every `check_interval_s`, read straight from the
  simulator's own SQLite database with the columns each rule needs (the same rows the
  replicas see; reading them through `Store.list_workers` would decode every row).

The rules (a "pass" below is the scenario's reaper interval, the slowest loop that must
act: DESIGN.md bounds leaks by "TTL + 2 reaper intervals", also while leadership is lost):

- **I1** a claim is handed out for a worker that another live session still holds; two
  bound claims on one worker; a hot worker without exactly its one bound claim;
- **I2** an activated worker seen with a second org: in a claim, in a write, in an
  activation (a slot reserved for an org that goes back to warm before activation has
  served nobody, DESIGN.md §3 rule 4);
- **I3** a hot_idle worker past its TTL + 2 passes that the org's `min_hot_idle` floor
  does not keep; a bound claim past its lease + 2 passes;
- **I4** a spawning, reserved or activating row past its timeout + 2 passes;
- **I5** live workers above the pool cap or an org's cap (0 = unbounded);
- **I6** warm plus neutral spawning workers below the pool's warm target, with no warm
  spawn by any replica, for longer than 2 passes while the pool cap leaves room (claims
  may drain the pool between passes; a janitor that does not refill it is the fault);
  a bound claim whose worker is not
  serving it (the worker was drained, retired or lost and the claim was not failed),
  or whose pod has been gone for longer than 2 passes;
- **I7** a janitor's spawn that left more warm and neutral spawning workers than the
  target it asked for (two janitors overshooting); a worker retired twice.

Each violation is recorded once per invariant and subject, with the run time, the details
and a short trace: the latest events about its subject and the latest events overall.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from stoker.adapters._rows import LIVE_SQL
from stoker.adapters.store_sqlite import SqliteStore
from stoker.domain.records import Claim, Worker
from stoker.domain.specs import PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.cluster import PodPhase, WatchEventType
from stoker.ports.store import SpawnRequest
from stoker.sim.cluster.apiserver import PodChange

#: The pod label that names a worker (the Kubernetes runtime's `LABEL_WORKER_ID`).
WORKER_LABEL = "stoker.dev/worker-id"
#: Events kept: overall, and per subject (worker, claim, org).
_GLOBAL_EVENTS = 400
_SUBJECT_EVENTS = 12
#: Events of a trace: about the subject, then overall.
_TRACE_SUBJECT = 10
_TRACE_GLOBAL = 8

_FINISHED = (PodPhase.FAILED, PodPhase.SUCCEEDED)


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


class InvariantChecker:
    """Checks I1-I7 on events and every `check_interval_s`; see the module docstring.

    `pool_cap(pool)` and `org_cap(pool, org)` are the caps in force (0 = unbounded) and
    `floor(pool, org)` the org's hot_idle floor, as the policy's replicas compute them.
    """

    def __init__(
        self,
        *,
        store: SqliteStore,
        now: Callable[[], float],
        wall: Callable[[], float],
        pools: Mapping[str, PoolSpec],
        pool_cap: Callable[[str], int],
        org_cap: Callable[[str, str], int],
        floor: Callable[[str, str], int],
        pass_s: float,
        check_interval_s: float,
    ) -> None:
        self._store = store
        self._now = now
        self._wall = wall
        self._pools = dict(pools)
        self._pool_cap = pool_cap
        self._org_cap = org_cap
        self._floor = floor
        self.grace_s = 2 * pass_s
        self.check_interval_s = check_interval_s
        self.violations: list[Violation] = []
        self._reported: set[tuple[str, str]] = set()
        self._events: deque[tuple[float, str]] = deque(maxlen=_GLOBAL_EVENTS)
        self._by_subject: dict[str, deque[tuple[float, str]]] = {}
        #: The first org each worker was bound to (I2).
        self._orgs: dict[str, str] = {}
        #: Worker -> the claim its latest session holds (I1).
        self._held: dict[str, Claim] = {}
        self._retired: set[str] = set()
        #: Worker -> run time its pod was seen gone, terminating or finished (I6).
        self._pod_gone: dict[str, float] = {}
        #: Pool -> run time warm + neutral spawning fell below the target (I6), and the
        #: last time a replica reserved neutral spawn slots for it.
        self._deficit_since: dict[str, float] = {}
        self._warm_spawned: dict[str, float] = {}
        self._claims_rowid = 0
        self._leaders: set[int] = set()
        #: The most replicas that believed they led at one moment (informational: I7
        #: allows it, it only forbids what two janitors could break).
        self.max_concurrent_leaders = 0
        self.checks = 0
        self._task: asyncio.Task[None] | None = None

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

    @property
    def _db(self) -> sqlite3.Connection:
        return self._store.db

    # -- events ----------------------------------------------------------------------------

    def note(self, text: str, *subjects: str) -> None:
        """Record an event for traces (about `subjects`)."""
        entry = (self._now(), text)
        self._events.append(entry)
        for subject in subjects:
            history = self._by_subject.get(subject)
            if history is None:
                history = self._by_subject[subject] = deque(maxlen=_SUBJECT_EVENTS)
            history.append(entry)

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
        if held is not None and held.id != claim.id and self._still_bound(held.id):
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
        """A replica's write of a worker row succeeded (I2 on its org, I7 on retirement)."""
        origin = before.value if before is not None else "new"
        reason = f" reason={worker.reason}" if worker.reason else ""
        self.note(
            f"cp-{replica} wrote worker={worker.id} {origin}->{worker.state.value} "
            f"epoch={worker.epoch} org={worker.org or '-'}{reason}",
            worker.id,
        )
        # Only an activated worker has served its org: a slot reserved for an org's cold
        # claim that went back to warm before activation is neutral (DESIGN.md §3 rule 4).
        if worker.org is not None and worker.activated:
            self._same_org(worker.id, worker.org, f"a write by cp-{replica}")
        if worker.state is WorkerState.RETIRED and before is not WorkerState.RETIRED:
            if worker.id in self._retired:
                self.violation("I7", worker.id, f"retired a second time by cp-{replica}")
            self._retired.add(worker.id)

    def spawn_reserved(self, replica: int, req: SpawnRequest, reserved: int) -> None:
        """A replica reserved spawn slots (I7: a janitor never fills beyond its target)."""
        if req.target is None or reserved == 0:
            return
        self._warm_spawned[req.pool] = self._now()
        self.note(
            f"cp-{replica} reserved {reserved} warm spawn slots, target {req.target}", req.pool
        )
        row = self._db.execute(
            "SELECT COUNT(*) FROM workers WHERE pool = ? AND state IN ('warm', 'spawning') "
            "AND revision = ? AND (state = 'warm' OR org IS NULL)",
            (req.pool, req.revision),
        ).fetchone()
        neutral = int(row[0])
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
        if worker is None or worker in self._pod_gone:
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
        """Read the store and check every rule (called periodically and at the end)."""
        self.checks += 1
        wall = self._wall()
        self._check_claims(wall)
        self._check_new_claims()
        self._check_hot_idle(wall)
        self._check_in_flight(wall)
        self._check_caps()
        self._check_warm()

    def _check_claims(self, wall: float) -> None:
        db = self._db
        for worker, count in db.execute(
            "SELECT worker_id, COUNT(*) FROM claims WHERE state = 'bound' "
            "GROUP BY worker_id HAVING COUNT(*) > 1"
        ):
            self.violation("I1", worker, f"{count} bound claims on one worker")
        for worker, claim in db.execute(
            "SELECT w.id, w.claim_id FROM workers w WHERE w.state = 'hot' AND NOT EXISTS "
            "(SELECT 1 FROM claims c WHERE c.id = w.claim_id AND c.state = 'bound' "
            "AND c.worker_id = w.id)"
        ):
            self.violation("I1", worker, f"hot without its bound claim (claim_id {claim})")
        for claim, worker, state, other in db.execute(
            "SELECT c.id, c.worker_id, w.state, w.claim_id FROM claims c "
            "LEFT JOIN workers w ON w.id = c.worker_id WHERE c.state = 'bound' "
            "AND (w.id IS NULL OR w.state != 'hot' OR w.claim_id IS NOT c.id)"
        ):
            if state == WorkerState.HOT.value:
                self.violation("I1", worker, f"claim {claim} is bound to a worker serving {other}")
            else:
                self.violation(
                    "I6",
                    claim,
                    f"claim bound to worker {worker} which is {state or 'gone'}: "
                    "a lost worker's claim must fail",
                )
        now = self._now()
        expired_before = wall - self.grace_s
        for claim, worker, expires_at in db.execute(
            "SELECT id, worker_id, expires_at FROM claims WHERE state = 'bound' AND expires_at < ?",
            (expired_before,),
        ):
            self.violation(
                "I3",
                claim,
                f"lease expired {wall - expires_at:.0f}s ago (worker {worker}), "
                f"beyond the {self.grace_s:.0f}s of two passes",
            )
        gone = [(w, t) for w, t in self._pod_gone.items() if now - t > self.grace_s]
        for worker, since in gone:
            claim = self._held.get(worker)
            if claim is not None and self._still_bound(claim.id):
                self.violation(
                    "I6",
                    claim.id,
                    f"worker {worker}'s pod is gone since {now - since:.0f}s and "
                    "its claim is still bound",
                )
            else:
                # Settled: nothing more to watch for this pod.
                del self._pod_gone[worker]

    def _check_new_claims(self) -> None:
        rows = self._db.execute(
            "SELECT rowid, id, worker_id, org FROM claims WHERE rowid > ? ORDER BY rowid",
            (self._claims_rowid,),
        ).fetchall()
        for rowid, claim, worker, org in rows:
            self._claims_rowid = max(self._claims_rowid, rowid)
            self._same_org(worker, org, f"claim {claim}")

    def _check_hot_idle(self, wall: float) -> None:
        groups: dict[tuple[str, str], list[tuple[float, str]]] = {}
        for worker, pool, org, idle_since, updated_at, ttl_s in self._db.execute(
            "SELECT id, pool, org, idle_since, updated_at, ttl_s FROM workers "
            "WHERE state = 'hot_idle'"
        ):
            since = idle_since if idle_since is not None else updated_at
            expires = since + (ttl_s if ttl_s is not None else 60.0)
            groups.setdefault((pool, org or ""), []).append((expires, worker))
        for (pool, org), members in groups.items():
            overdue = sorted(m for m in members if m[0] + self.grace_s < wall)
            removable = max(0, len(members) - self._floor(pool, org))
            for expires, worker in overdue[:removable]:
                self.violation(
                    "I3",
                    worker,
                    f"hot_idle of org {org} {wall - expires:.0f}s past its TTL, beyond the "
                    f"{self.grace_s:.0f}s of two passes ({len(members)} parked, floor "
                    f"{self._floor(pool, org)})",
                )

    def _check_in_flight(self, wall: float) -> None:
        for worker, pool, state, updated_at, heartbeat_at in self._db.execute(
            "SELECT id, pool, state, updated_at, heartbeat_at FROM workers "
            "WHERE state IN ('spawning', 'reserved', 'activating')"
        ):
            spec = self._pools.get(pool)
            if spec is None:
                continue
            timeouts = spec.timeouts
            if state == WorkerState.SPAWNING.value:
                deadline = updated_at + timeouts.spawn_s
            elif state == WorkerState.RESERVED.value:
                deadline = updated_at + timeouts.reserve_s
            else:
                deadline = max(updated_at, heartbeat_at) + timeouts.activation_s
            if wall > deadline + self.grace_s:
                self.violation(
                    "I4",
                    worker,
                    f"{state} {wall - deadline:.0f}s past its timeout, beyond the "
                    f"{self.grace_s:.0f}s of two passes",
                )

    def _check_caps(self) -> None:
        per_pool: dict[str, int] = {}
        for pool, org, count in self._db.execute(
            f"SELECT pool, org, COUNT(*) FROM workers WHERE state IN {LIVE_SQL} GROUP BY pool, org"
        ):
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
            row = self._db.execute(
                "SELECT "
                "SUM(CASE WHEN revision = ? AND (state = 'warm' OR (state = 'spawning' "
                "AND org IS NULL)) THEN 1 ELSE 0 END), COUNT(*) "
                f"FROM workers WHERE pool = ? AND state IN {LIVE_SQL}",
                (spec.revision, name),
            ).fetchone()
            neutral, live = int(row[0] or 0), int(row[1])
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

    # -- helpers -----------------------------------------------------------------------------

    def _still_bound(self, claim_id: str) -> bool:
        row = self._db.execute("SELECT state FROM claims WHERE id = ?", (claim_id,)).fetchone()
        return row is not None and row[0] == "bound"

    def _same_org(self, worker: str, org: str, where: str) -> None:
        first = self._orgs.setdefault(worker, org)
        if first != org:
            self.violation("I2", worker, f"bound to org {first}, then to org {org} in {where}")

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
        about = list(self._by_subject.get(subject, ()))[-_TRACE_SUBJECT:]
        recent = list(self._events)[-_TRACE_GLOBAL:]
        merged = sorted(set(about) | set(recent))
        return tuple(f"t={t:.1f}s {text}" for t, text in merged)


def count_by(items: Iterable[Violation]) -> dict[str, int]:
    """Violations per invariant."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item.invariant] = counts.get(item.invariant, 0) + 1
    return dict(sorted(counts.items()))
