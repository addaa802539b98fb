"""The warm claims of one loop iteration as one statement (`batches`): for each, the
oldest worker its org parked, else the warm worker the replica named (or, naming none, any
warm worker nobody else is locking), reserved and with `activate` moved on to activating,
as `reserve_parked_or`'s own statement does.

A batch holds claims of distinct orgs naming distinct warm workers, so no two of its rows
can pick the same worker; a claim within an org's cap is counted under that org's lock
and runs alone (it always names its warm worker).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from stoker.adapters._rows import WORKER_COLUMNS, worker_from_row
from stoker.adapters.postgres.batches import LoopBatches
from stoker.adapters.postgres.connections import Connections
from stoker.adapters.postgres.schema import Names
from stoker.ports.store import ReserveResult

#: One claim's parameters, as `reserve_parked_or`'s own statement takes them.
Params = dict[str, Any]


def took_statement(names: Names) -> str:
    """The common table expression that keeps the changes of owner of the rows a reserving
    statement `moved` (`worker_takes`): a row whose `taken_at` is its write's time was
    taken by this write (or, at that very instant, before: a row that is there already)."""
    return (
        f"took AS (INSERT INTO {names.worker_takes} (worker_id, taken_at) "
        "SELECT id, taken_at FROM moved WHERE taken_at = updated_at ON CONFLICT DO NOTHING)"
    )


def batch_statement(names: Names) -> str:
    """The reservations of a batch in one statement: each claim's values are one element
    of the arrays; each answer row carries its claim's position and whether the worker
    reserved was parked. A claim with no warm worker named (a NULL id) takes any warm
    worker of `%(revision)s` nobody else is locking, newest first, as `reserve_any` does;
    no two claims of the batch get the same one."""
    w = names.workers
    moved = ", ".join(f"w.{name}" for name in WORKER_COLUMNS)
    return (
        "WITH input AS (SELECT * FROM unnest(%(n)s::int[], %(id)s::text[], "
        "%(epoch)s::bigint[], %(version)s::bigint[], %(org)s::text[], "
        "%(now)s::double precision[]) AS i(n, id, epoch, version, org, now)), "
        "parked AS (SELECT i.n, p.id, p.state FROM input AS i CROSS JOIN LATERAL ("
        f"SELECT id, state FROM {w} WHERE pool = %(pool)s "
        "AND revision = ANY(%(revisions)s::text[]) AND state = 'hot_idle' AND org = i.org "
        "ORDER BY array_position(%(revisions)s::text[], revision), updated_at, id "
        "LIMIT 1 FOR UPDATE SKIP LOCKED) AS p), "
        "named AS (SELECT i.n, x.id, x.state FROM input AS i "
        f"JOIN {w} AS x ON x.id = i.id AND x.state = 'warm' AND x.epoch = i.epoch "
        "AND x.version = i.version "
        "WHERE NOT EXISTS (SELECT 1 FROM parked WHERE parked.n = i.n) FOR UPDATE OF x), "
        "wanting AS (SELECT i.n, row_number() OVER (ORDER BY i.n) AS k FROM input AS i "
        "WHERE i.id IS NULL AND NOT EXISTS (SELECT 1 FROM parked WHERE parked.n = i.n)), "
        "free AS (SELECT f.id, f.state, row_number() OVER () AS k FROM ("
        f"SELECT id, state FROM {w} WHERE pool = %(pool)s AND revision = %(revision)s "
        "AND state = 'warm' AND id NOT IN (SELECT id FROM named) "
        "ORDER BY updated_at DESC, id DESC LIMIT (SELECT count(*) FROM wanting) "
        "FOR UPDATE SKIP LOCKED) AS f), "
        "anyone AS (SELECT wanting.n, free.id, free.state FROM wanting JOIN free USING (k)), "
        "picked AS (SELECT * FROM parked UNION ALL SELECT * FROM named "
        "UNION ALL SELECT * FROM anyone), "
        f"moved AS (UPDATE {w} AS w SET "
        "state = CASE WHEN %(activate)s THEN 'activating' ELSE 'reserved' END, "
        "activated = w.activated OR %(activate)s, epoch = w.epoch + 1, "
        "version = w.version + 1, org = i.org, owner = %(owner)s, "
        "heartbeat_at = i.now, updated_at = i.now, "
        "taken_at = CASE WHEN w.owner = %(owner)s THEN w.taken_at ELSE i.now END, "
        "prior_taken_at = CASE WHEN w.owner = %(owner)s THEN w.prior_taken_at "
        "ELSE w.taken_at END "
        "FROM picked JOIN input AS i ON i.n = picked.n "
        "WHERE w.id = picked.id AND w.state = picked.state "
        f"RETURNING picked.n, picked.state = 'hot_idle', {moved}), "
        f"{took_statement(names)} "
        "SELECT * FROM moved"
    )


class ParkedOrWarmBatches:
    """The parked-or-warm reservations of one loop iteration, run as one statement."""

    def __init__(
        self, db: Connections, names: Names, one: Callable[[Params], Awaitable[ReserveResult]]
    ) -> None:
        self._db = db
        self._sql = batch_statement(names)
        self._alone = one
        self._batches: LoopBatches[Params, ReserveResult] = LoopBatches(
            batch=self._batch, one=self._one, group=_group, claims=_claims
        )

    async def reserve(self, params: Params) -> ReserveResult:
        """The claim's reservation, as its own statement would answer it."""
        return await self._batches.run(params)

    async def _one(self, params: Params) -> ReserveResult:
        if params["id"] is None:
            (result,) = await self._batch([params])
            return result
        return await self._alone(params)

    async def _batch(self, batch: list[Params]) -> list[ReserveResult]:
        first = batch[0]
        columns = {name: [p[name] for p in batch] for name in ("id", "epoch", "version", "org")}
        rows = await self._db.all(
            self._sql,
            columns
            | {
                "n": list(range(len(batch))),
                "now": [p["now"] for p in batch],
                "pool": first["pool"],
                "revisions": first["revisions"],
                "revision": first["revision"],
                "activate": first["activate"],
                "owner": first["owner"],
            },
        )
        by_n = {row[0]: row for row in rows}
        return [
            ReserveResult(worker_from_row(row[2:]), parked=row[1])
            if (row := by_n.get(n)) is not None
            else ReserveResult(None)
            for n in range(len(batch))
        ]


def _group(params: Params) -> Hashable | None:
    """The claims that may share a statement; None for one within an org's cap."""
    if params["cap"]:
        return None
    revisions = tuple(params["revisions"])
    return params["pool"], revisions, params["revision"], params["owner"], params["activate"]


def _claims(params: Params) -> tuple[Hashable, ...]:
    """What no two claims of a batch may share: the org, and the warm worker named."""
    if params["id"] is None:
        return (("org", params["org"]),)
    return ("org", params["org"]), ("id", params["id"])
