"""The worker and claim rows of the SQLite store: reads, and writes that are each a
compare-and-set.

Each write reads the row and writes it back in one transaction of the group commit (see
`batching`), with no `await` between its statements: the writes of one process never
interleave, and other processes wait for the write lock. A write of one statement (a
transition, a reservation) on a private in-memory database needs no BEGIN and COMMIT
(`GroupCommit.single_write`). The checks shared with PostgreSQL
(the transition table, the org rule, caps) come from `_rows`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any, Unpack

from stoker.adapters._rows import (
    CLAIM_SELECT,
    WORKER_COLUMNS,
    WORKER_SELECT,
    ListingFilters,
    check_claim_for,
    check_ending,
    check_move,
    check_reservable,
    checked_changes,
    claim_from_row,
    claim_to_row,
    column_value,
    fenced,
    holds,
    may_bind,
    spawn_room,
    spawning_workers,
    stamp_taken,
    worker_to_row,
)
from stoker.adapters.sqlite.batching import GroupCommit
from stoker.adapters.sqlite.decoded import DecodedRows
from stoker.adapters.sqlite.live_rows import LiveRows
from stoker.domain.errors import ClaimKeyTaken
from stoker.domain.records import Claim, Worker
from stoker.domain.states import LIVE, ClaimState, WorkerState
from stoker.ports.store import (
    ClaimQuery,
    Ending,
    FencedReservation,
    Move,
    Reservation,
    ReserveResult,
    SpawnRequest,
    SpawnResult,
    StateCount,
    WorkerQuery,
)

_WORKER_VALUES = ", ".join("?" for _ in WORKER_COLUMNS)
_WORKER_BY_ID = f"SELECT {WORKER_SELECT} FROM workers WHERE id = ?"
_CLAIM_BY_ID = f"SELECT {CLAIM_SELECT} FROM claims WHERE id = ?"
_CLAIM_BY_KEY = f"SELECT {CLAIM_SELECT} FROM claims WHERE org = ? AND idempotency_key = ?"
_ACTIVATED = {"activated": True}
#: A change of a worker's owner (`stamp_taken`), for the ledger of the replica it left.
_TAKEN = "INSERT OR IGNORE INTO worker_takes (worker_id, taken_at) VALUES (?, ?)"
_PICK = f"SELECT {WORKER_SELECT} FROM workers WHERE pool = ? AND revision = ? AND state = ?"
#: The oldest warm worker of a pool revision, or the oldest hot_idle one of an org.
_PICK_WARM = _PICK + " ORDER BY updated_at, id LIMIT 1"
_PICK_HOT_IDLE = _PICK + " AND org = ? ORDER BY updated_at, id LIMIT 1"


def _marks(values: Sequence[Any]) -> str:
    return ", ".join("?" for _ in values)


#: A list is one marker per value; an empty list of states matches no row.
_FILTERS = ListingFilters(
    "?",
    among=lambda column, values: (
        (f"{column} IN ({_marks(values)})", list(values)) if values else ("1 = 0", [])
    ),
    not_among=lambda column, values: (f"{column} NOT IN ({_marks(values)})", list(values)),
)


def _moved(
    current: Worker,
    *,
    to: WorkerState,
    now: float,
    changes: Mapping[str, Any],
    bump_epoch: bool = False,
) -> tuple[Worker, dict[str, Any]]:
    """`current` moved to `to` at `now` with its version bumped, and the checked field
    changes of the move (no I/O: `WorkerRows._write_move` writes it)."""
    checked = stamp_taken(current, checked_changes(current, to, changes), now)
    new = current.evolve(
        state=to,
        epoch=current.epoch + 1 if bump_epoch else current.epoch,
        version=current.version + 1,
        updated_at=now,
        **checked,
    )
    return new, checked


class WorkerRows:
    """Spawn slots, transitions, reservations, binding and ending claims, renewals; the
    reads of workers (live ones from memory) and claims."""

    _writes: GroupCommit
    _live: LiveRows
    _decoded: DecodedRows

    def _get(self, db: sqlite3.Connection, worker_id: str) -> Worker | None:
        """One worker as this connection sees it: a live one from the live rows (which
        hold this connection's writes, and are read again once another connection
        committed), a retired one from the table."""
        row = self._live.row(worker_id)
        if row is None:
            row = db.execute(_WORKER_BY_ID, (worker_id,)).fetchone()
        return self._decoded.worker(row) if row else None

    def _cas(
        self,
        db: sqlite3.Connection,
        current: Worker,
        *,
        to: WorkerState,
        now: float,
        changes: Mapping[str, Any],
        bump_epoch: bool = False,
    ) -> Worker | None:
        """Apply a checked transition to `current` (already read in this transaction),
        bumping its version."""
        new, changes = _moved(current, to=to, now=now, changes=changes, bump_epoch=bump_epoch)
        return self._write_move(db, current, new, changes)

    def _write_move(
        self, db: sqlite3.Connection, current: Worker, new: Worker, changes: Mapping[str, Any]
    ) -> Worker | None:
        """Compare-and-set `current`'s row (by its version) to `new`: its state, epoch,
        version, `updated_at` and the `changes`; None when the row moved meanwhile. The
        row the trigger put in the live rows is known to decode as `new` (when what was
        written reads back as written: `DecodedRows.written`)."""
        sets = ["state = ?", "epoch = ?", "version = ?", "updated_at = ?"]
        params: list[Any] = [new.state.value, new.epoch, new.version, new.updated_at]
        for name, value in changes.items():
            sets.append(f"{name} = ?")
            params.append(column_value(name, value))
        params += [current.id, current.version]
        cur = db.execute(
            f"UPDATE workers SET {', '.join(sets)} WHERE id = ? AND version = ?", params
        )
        if cur.rowcount != 1:
            return None
        if "taken_at" in changes:
            db.execute(_TAKEN, (new.id, new.taken_at))
        row = self._live.held(new.id)
        if row is not None:
            self._decoded.written(row, new, changes)
        return new

    async def reserve_spawn_slots(
        self, req: SpawnRequest, ids: Sequence[str], now: float
    ) -> SpawnResult:
        """Insert spawning rows within the caps and the target, in one transaction."""
        live = self._live
        async with self._writes.tx() as db:
            room, limited_by = spawn_room(
                req,
                len(ids),
                pool_live=live.count_live(req.pool) if req.pool_cap > 0 else 0,
                org_live=(
                    live.count_live(req.pool, req.org)
                    if req.org is not None and req.org_cap > 0
                    else 0
                ),
                neutral=(
                    live.count_neutral(req.pool, req.revision) if req.target is not None else 0
                ),
            )
            rows = spawning_workers(req, ids[:room], now)
            db.executemany(
                f"INSERT INTO workers ({WORKER_SELECT}) VALUES ({_WORKER_VALUES})",
                [worker_to_row(w) for w in rows],
            )
            return SpawnResult(rows, limited_by)

    async def transition(self, worker_id: str, **move: Unpack[Move]) -> Worker | None:
        """CAS `(id, expect, epoch, version)` -> `to`; None on a miss."""
        to, changes = move["to"], move.get("changes") or {}
        # Illegal moves and unknown fields raise even when the row would not match.
        check_move(move["expect"], to, changes)
        async with self._writes.single_write() as db:
            current = self._get(db, worker_id)
            if current is None or not fenced(current, move):
                return None
            bump = move.get("bump_epoch", False)
            return self._cas(db, current, to=to, now=move["now"], bump_epoch=bump, changes=changes)

    def _reserve_row(
        self, db: sqlite3.Connection, current: Worker, now: float, by: Reservation
    ) -> ReserveResult:
        org, org_cap = by["org"], by["org_cap"]
        if current.state is WorkerState.HOT_IDLE and current.org != org:
            return ReserveResult(None)
        if (
            current.state is WorkerState.WARM
            and org_cap > 0
            and self._live.count_live(current.pool, org) >= org_cap
        ):
            return ReserveResult(None, at_org_cap=True)
        reserved, changes = _moved(
            current,
            to=WorkerState.RESERVED,
            now=now,
            bump_epoch=True,
            changes={"org": org, "owner": by["owner"], "heartbeat_at": now},
        )
        if by.get("activate", False):
            # On to activating in the same statement: the row as the two moves, each checked
            # and each bumping the version, leave it; one write less per claim.
            reserved, activating = _moved(
                reserved, to=WorkerState.ACTIVATING, now=now, changes=_ACTIVATED
            )
            changes |= activating
        worker = self._write_move(db, current, reserved, changes)
        return ReserveResult(worker, parked=current.state is WorkerState.HOT_IDLE)

    async def reserve(
        self, worker_id: str, *, now: float, **by: Unpack[FencedReservation]
    ) -> ReserveResult:
        """CAS one warm or hot_idle worker to reserved for `org` (with `activate`, on to
        activating in the same statement)."""
        check_reservable(by["expect"])
        async with self._writes.single_write() as db:
            current = self._get(db, worker_id)
            if current is None or not fenced(current, by):
                return ReserveResult(None)
            return self._reserve_row(db, current, now, by)

    async def reserve_any(
        self, pool: str, revision: str, *, now: float, **by: Unpack[Reservation]
    ) -> ReserveResult:
        """Reserve the oldest matching worker of the pool revision."""
        expect, org = by["expect"], by["org"]
        check_reservable(expect)
        # Most calls find nothing (the queues in memory already had nothing): look in the
        # live rows' counts first, without taking the write lock, then pick inside the
        # write transaction.
        if not self._live.may_hold(pool, revision, expect, org):
            return ReserveResult(None)
        params: tuple[str, ...] = (pool, revision, expect.value)
        if expect is WorkerState.HOT_IDLE:
            sql, params = _PICK_HOT_IDLE, (*params, org)
        else:
            sql = _PICK_WARM
        async with self._writes.single_write() as db:
            row = db.execute(sql, params).fetchone()
            if row is None:
                return ReserveResult(None)
            worker = self._decoded.worker(row)
            return self._reserve_row(db, worker, now, by)

    async def bind(
        self, worker_id: str, *, epoch: int, version: int, claim: Claim, now: float
    ) -> Worker | None:
        """activating -> hot and insert the claim, atomically."""
        check_claim_for(worker_id, epoch, claim)
        async with self._writes.tx() as db:
            current = self._get(db, worker_id)
            if not may_bind(current, claim, epoch, version):
                return None
            worker = self._cas(
                db,
                current,
                to=WorkerState.HOT,
                now=now,
                changes={"claim_id": claim.id, "idle_since": None},
            )
            if worker is None:
                return None
            if (
                claim.idempotency_key is not None
                and db.execute(_CLAIM_BY_KEY, (claim.org, claim.idempotency_key)).fetchone()
            ):
                # Raised inside the transaction: the worker's move is undone with it.
                raise ClaimKeyTaken(f"org {claim.org!r} has a claim with this Idempotency-Key")
            row = claim_to_row(claim)
            values = ", ".join("?" for _ in row)
            db.execute(f"INSERT INTO claims ({CLAIM_SELECT}) VALUES ({values})", row)
            return worker

    async def end_claim(self, claim_id: str, **end: Unpack[Ending]) -> tuple[Claim, Worker] | None:
        """End a bound claim and move its hot worker, atomically."""
        state, worker_to, now = end["state"], end["worker_to"], end["now"]
        reason, worker_changes = end.get("reason"), end.get("worker_changes")
        check_ending(state, worker_to, worker_changes or {})
        async with self._writes.tx() as db:
            row = db.execute(_CLAIM_BY_ID, (claim_id,)).fetchone()
            claim = claim_from_row(row) if row else None
            if claim is None or claim.state is not ClaimState.BOUND:
                return None
            current = self._get(db, claim.worker_id)
            if not holds(current, claim):
                return None
            changes = {"claim_id": None, **(worker_changes or {})}
            worker = self._cas(db, current, to=worker_to, now=now, changes=changes)
            if worker is None:
                return None
            ended = claim.evolve(state=state, updated_at=now, ended_at=now, reason=reason)
            db.execute(
                "UPDATE claims SET state = ?, updated_at = ?, ended_at = ?, reason = ? "
                "WHERE id = ? AND state = ?",
                (state.value, now, now, reason, claim_id, ClaimState.BOUND.value),
            )
            return ended, worker

    async def renew_claim(self, claim_id: str, *, expires_at: float, now: float) -> Claim | None:
        """Extend a bound claim's lease (one statement: it returns the row it changed)."""
        _, rows = await self._writes.write_one(
            "UPDATE claims SET expires_at = ?, updated_at = ? WHERE id = ? AND state = ? "
            f"RETURNING {CLAIM_SELECT}",
            (expires_at, now, claim_id, ClaimState.BOUND.value),
        )
        return claim_from_row(rows[0]) if rows else None

    async def get_worker(self, worker_id: str) -> Worker | None:
        """One worker row (a live one from the live rows)."""
        row = self._live.row(worker_id)
        if row is None:
            rows = self._writes.read(_WORKER_BY_ID, (worker_id,))
            row = rows[0] if rows else None
        return self._decoded.worker(row) if row else None

    async def list_workers(self, **query: Unpack[WorkerQuery]) -> list[Worker]:
        """Rows matching every filter, oldest first (live states: from the live rows)."""
        states, limit = query.get("states"), query.get("limit")
        if states is not None and LIVE.issuperset(states):
            rows = self._live.select(
                states,
                pool=query.get("pool"),
                org=query.get("org"),
                owner=query.get("owner"),
                not_owners=query.get("not_owners"),
                after=query.get("after"),
                limit=limit,
            )
        else:
            where, params = _FILTERS.where(query)
            sql = f"SELECT {WORKER_SELECT} FROM workers{where} ORDER BY created_at, id"
            if limit is not None:
                sql += f" LIMIT {int(limit)}"
            rows = self._writes.read(sql, params)
        return self._decoded.workers(rows)

    async def count_workers(self) -> list[StateCount]:
        """Live workers grouped by pool, revision, state and binding (from the live rows)."""
        return self._live.state_counts()

    async def get_claim(self, claim_id: str) -> Claim | None:
        """One claim."""
        rows = self._writes.read(_CLAIM_BY_ID, (claim_id,))
        return claim_from_row(rows[0]) if rows else None

    async def claim_by_key(self, org: str, idempotency_key: str) -> Claim | None:
        """The org's claim stored with `idempotency_key` (a digest), if any."""
        rows = self._writes.read(_CLAIM_BY_KEY, (org, idempotency_key))
        return claim_from_row(rows[0]) if rows else None

    async def list_claims(self, **query: Unpack[ClaimQuery]) -> list[Claim]:
        """Claims matching every filter, oldest first."""
        where, params = _FILTERS.where(query)
        sql = f"SELECT {CLAIM_SELECT} FROM claims{where} ORDER BY created_at, id"
        if (limit := query.get("limit")) is not None:
            sql += f" LIMIT {int(limit)}"
        return [claim_from_row(r) for r in self._writes.read(sql, params)]
