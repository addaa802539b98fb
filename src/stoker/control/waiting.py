"""Claims waiting for a worker: the queue of claims in arrival order, the claims held by a
cap, and the cold spawns claims wait for.

A waiting claim takes the first worker that gets ready for it: a warm worker offered, or
a cold spawn, its own or another's, whichever comes first, in the order the claims began
to wait. A spawn that gets ready while an earlier claim still waits goes to that claim (as
a warm worker); the claim that started the spawn then waits for the spawn of the claim it
served, which is handed on to it. A spawn nobody waits for any more joins the warm pool.

Every structure here is keyed by the claims themselves and emptied when their wait ends.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Protocol, runtime_checkable


class Waiter(Protocol):
    """A claim waiting for a warm worker or a free slot (`claims.Attempt`)."""

    abandoned: bool
    #: When the claim arrived: its place among the claims waiting for a warm worker.
    started: float

    def wake(self) -> None:
        """Let the waiting claim try again."""
        ...


@runtime_checkable
class SpawnOwner(Waiter, Protocol):
    """A claim that waits for a cold spawn (`claims.Attempt`)."""

    @property
    def org(self) -> str:
        """The org the claim is for."""
        ...

    @property
    def org_cap(self) -> int:
        """The org's cap in the claim's pool (0: none)."""
        ...

    @property
    def in_order(self) -> bool:
        """Whether it takes any ready worker in arrival order (a `cold` claim takes only
        its own spawn)."""
        ...

    #: A spawn handed to it (ready or lost) that it has not looked at yet.
    spawn_ready: tuple[str, asyncio.Future[str]] | None

    def spawn_done(self, worker_id: str, ready: asyncio.Future[str]) -> None:
        """A spawn got ready (or was lost) for it: the result is in `ready`."""
        ...


class WaitingClaims:
    """The waiting claims of one replica, by pool (the book holds them)."""

    def __init__(self) -> None:
        #: Claims waiting for a warm worker, by pool, in arrival order.
        self._warm_waiters: dict[str, OrderedDict[Waiter, None]] = {}
        #: Claims held by a cap, by pool and org; org "" for the pool cap.
        self._cap_waiters: dict[str, dict[str, dict[Waiter, None]]] = {}
        #: Cold spawns a claim waits for: worker id -> endpoint future.
        self._spawn_waits: dict[str, asyncio.Future[str]] = {}
        #: The claim each awaited spawn is linked to, and back.
        self._spawn_owner: dict[str, SpawnOwner] = {}
        self._owned: dict[SpawnOwner, str] = {}
        #: Set by the next claim that queues for a warm worker (`until_warm_waiter`).
        self._first_warm_waiter: asyncio.Future[None] | None = None

    # -- waiting claims ---------------------------------------------------------------------

    def wait_for_warm(self, pool: str, waiter: Waiter) -> None:
        """Wake `waiter` when a warm worker of `pool` is offered or a slot frees (until
        `stop_waiting`). A claim that arrived before every claim queued now (woken, it
        lost the worker to another claim) waits again at the head, not behind them."""
        waiters = self._warm_waiters.setdefault(pool, OrderedDict())
        head = next(iter(waiters), None)
        waiters[waiter] = None
        if head is not None and waiter.started < head.started:
            waiters.move_to_end(waiter, last=False)
        if self._first_warm_waiter is not None and not self._first_warm_waiter.done():
            self._first_warm_waiter.set_result(None)

    def wait_for_slot(self, pool: str, org: str, waiter: Waiter) -> None:
        """Wake `waiter` when `org` (or, with org "", anyone) frees a slot of `pool`, or
        parks a worker `org` may reuse (until `stop_waiting`)."""
        self._cap_waiters.setdefault(pool, {}).setdefault(org, {})[waiter] = None

    def stop_waiting(self, pool: str, org: str, waiter: Waiter) -> None:
        """The wait of `waiter` ended (woken, timed out or abandoned): forget it."""
        warm = self._warm_waiters.get(pool)
        if warm is not None and warm.pop(waiter, 0) is None and not warm:
            del self._warm_waiters[pool]
        by_org = self._cap_waiters.get(pool)
        if by_org is None:
            return
        for key in (org, ""):
            held = by_org.get(key)
            if held is not None and held.pop(waiter, 0) is None and not held:
                del by_org[key]
        if not by_org:
            del self._cap_waiters[pool]

    def waiting_for_warm(self, pool: str) -> int:
        """Claims of `pool` queued for a warm worker (part of demand)."""
        return sum(1 for w in self._warm_waiters.get(pool, ()) if not w.abandoned)

    def hot_idle_parked(self, pool: str, org: str | None) -> None:
        """A worker of `org` was parked (here or on another replica): its claims held by
        the org cap may reuse it."""
        if org is None:
            return
        by_org = self._cap_waiters.get(pool)
        held = by_org.pop(org, None) if by_org is not None else None
        if by_org is not None and not by_org:
            del self._cap_waiters[pool]
        for waiter in held or ():
            waiter.wake()

    def slot_freed(self, pool: str, org: str | None) -> None:
        """A live worker of `pool` (bound to `org`, if any) retired: wake the claims held by
        the pool cap or by an org cap of the pool, and one claim waiting for a warm worker."""
        for held in self._cap_waiters.pop(pool, {}).values():
            for waiter in held:
                waiter.wake()
        self._wake_warm_waiter(pool)

    async def until_warm_waiter(self) -> None:
        """Return once some claim is queued for a warm worker (at once if one is)."""
        if self._warm_waiters:
            return
        if self._first_warm_waiter is None or self._first_warm_waiter.done():
            self._first_warm_waiter = asyncio.get_running_loop().create_future()
        await self._first_warm_waiter

    def warm_waiting_pools(self) -> list[str]:
        """The pools some claim of this replica is queued in for a warm worker."""
        return list(self._warm_waiters)

    def offer_stored(self, pool: str, warm: int) -> None:
        """`warm` workers of `pool` sit ready in the store, whichever replica owns them:
        wake as many of the claims waiting for one, longest waiting first (each then
        reserves one from the store)."""
        for _ in range(warm):
            if not self._wake_warm_waiter(pool):
                return

    def _wake_warm_waiter(self, pool: str) -> bool:
        """Wake the claim that waits longest for a worker of `pool`; False if none does."""
        waiters = self._warm_waiters.get(pool)
        woken = False
        while waiters:
            waiter = next(iter(waiters))
            del waiters[waiter]
            if not waiter.abandoned and not _handed(waiter):
                waiter.wake()
                woken = True
                break
        if waiters is not None and not waiters:
            del self._warm_waiters[pool]
        return woken

    def _first_waiter(self, pool: str) -> Waiter | None:
        """The claim that waits longest for a worker of `pool` (abandoned ones and those
        already handed a spawn skipped)."""
        for waiter in self._warm_waiters.get(pool, ()):
            if not waiter.abandoned and not _handed(waiter):
                return waiter
        return None

    # -- cold spawns ------------------------------------------------------------------------

    def expect_ready(self, worker_id: str, owner: SpawnOwner | None = None) -> asyncio.Future[str]:
        """A future for the endpoint of a cold spawn, set by its readiness event; with
        `owner`, the claim it is linked to (told through `spawn_done`)."""
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._spawn_waits[worker_id] = ready
        if owner is not None:
            self._link(worker_id, owner)
        return ready

    def _link(self, worker_id: str, owner: SpawnOwner) -> None:
        self._spawn_owner[worker_id] = owner
        self._owned[owner] = worker_id

    def _unlink(self, worker_id: str) -> None:
        owner = self._spawn_owner.pop(worker_id, None)
        if owner is not None:
            self._owned.pop(owner, None)

    def spawn_of(self, owner: SpawnOwner) -> str | None:
        """The spawn `owner` waits for, if any (not ready yet)."""
        return self._owned.get(owner)

    def resolve_ready(self, worker_id: str, endpoint: str, *, pool: str = "") -> bool:
        """Hand a readiness event to a claim: the one that waits longest for a worker of
        `pool` if the spawn's own claim waits too, else the spawn's own claim. False when
        no claim takes it (it then becomes a warm worker).

        A claim that takes another claim's spawn gives that claim its own spawn, if it has
        one; else that claim is woken to find or spawn another worker.
        """
        ready = self._spawn_waits.pop(worker_id, None)
        owner = self._spawn_owner.get(worker_id)
        self._unlink(worker_id)
        if ready is None or ready.done():
            return False
        ready.set_result(endpoint)
        if owner is None:
            return True
        first = self._first_waiter(pool) if owner.in_order else None
        if not self._may_take(first, owner):
            if owner.abandoned:
                return False
            self._deliver(pool, owner, worker_id, ready)
            return True
        assert isinstance(first, SpawnOwner)
        theirs = self._owned.get(first)
        if theirs is not None:
            self._unlink(theirs)
            if owner.abandoned:
                self.hand_on(theirs, pool)
            else:
                self.expect_ready(theirs, owner)
        elif not owner.abandoned:
            owner.wake()
        self._deliver(pool, first, worker_id, ready)
        return True

    def _deliver(
        self, pool: str, owner: SpawnOwner, worker_id: str, ready: asyncio.Future[str]
    ) -> None:
        """Hand a spawn's outcome to a claim now (not in a later callback), so the next
        event in the same loop iteration already sees it served."""
        self._leave_queue(pool, owner)
        owner.spawn_done(worker_id, ready)

    def _may_take(self, first: Waiter | None, owner: SpawnOwner) -> bool:
        """Whether `first`, waiting longer than the spawn's `owner`, takes the spawn: a
        claim whose own spawn still counts against its org's cap waits for that one."""
        if first is None or first is owner or not isinstance(first, SpawnOwner):
            return False
        return first.in_order and not (first.org_cap > 0 and first in self._owned)

    def _leave_queue(self, pool: str, waiter: Waiter) -> None:
        waiters = self._warm_waiters.get(pool)
        if waiters is not None:
            waiters.pop(waiter, None)
            if not waiters:
                del self._warm_waiters[pool]

    def resolve_lost(self, worker_id: str, error: BaseException, *, pool: str = "") -> None:
        """Fail the claim waiting on this spawn, if any."""
        ready = self._spawn_waits.pop(worker_id, None)
        owner = self._spawn_owner.get(worker_id)
        self._unlink(worker_id)
        if ready is not None and not ready.done():
            ready.set_exception(error)
            if owner is not None:
                self._deliver(pool, owner, worker_id, ready)

    def drop_spawn_wait(self, worker_id: str) -> None:
        """Nobody waits on this spawn any more."""
        self._spawn_waits.pop(worker_id, None)
        self._unlink(worker_id)

    def hand_on_spawn(self, owner: SpawnOwner, pool: str) -> None:
        """`owner` is served (or gone): its spawn goes to the first claim of `pool` that
        waits without a spawn of its own, or, when none does, to the warm pool."""
        worker_id = self._owned.get(owner)
        if worker_id is not None:
            self._unlink(worker_id)
            self.hand_on(worker_id, pool)

    def hand_on(self, worker_id: str, pool: str) -> None:
        """Link an unlinked spawn to the first claim of `pool` that waits without one (the
        scan stops there), or let it become a warm worker."""
        self._spawn_waits.pop(worker_id, None)
        for waiter in self._warm_waiters.get(pool, ()):
            if waiter.abandoned or waiter in self._owned or _handed(waiter):
                continue
            if isinstance(waiter, SpawnOwner) and waiter.in_order:
                self.expect_ready(worker_id, waiter)
                return


def _handed(waiter: Waiter) -> bool:
    """Whether a spawn was handed to the waiter that it has not looked at yet."""
    return isinstance(waiter, SpawnOwner) and waiter.spawn_ready is not None
