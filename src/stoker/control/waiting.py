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
import functools
from typing import Protocol, runtime_checkable


class Waiter(Protocol):
    """A claim waiting for a warm worker or a free slot (`claims.Attempt`)."""

    abandoned: bool

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
    def in_order(self) -> bool:
        """Whether it takes any ready worker in arrival order (a `cold` claim takes only
        its own spawn)."""
        ...

    def spawn_done(self, worker_id: str, ready: asyncio.Future[str]) -> None:
        """Its spawn got ready (or was lost): the result is in `ready`."""
        ...


class WaitingClaims:
    """The waiting claims of one replica, by pool (the book holds them)."""

    def __init__(self) -> None:
        #: Claims waiting for a warm worker, by pool, in arrival order.
        self._warm_waiters: dict[str, dict[Waiter, None]] = {}
        #: Claims held by a cap, by pool and org; org "" for the pool cap.
        self._cap_waiters: dict[str, dict[str, dict[Waiter, None]]] = {}
        #: Cold spawns a claim waits for: worker id -> endpoint future.
        self._spawn_waits: dict[str, asyncio.Future[str]] = {}
        #: The claim each awaited spawn is linked to, and back.
        self._spawn_owner: dict[str, SpawnOwner] = {}
        self._owned: dict[SpawnOwner, str] = {}

    # -- waiting claims ---------------------------------------------------------------------

    def wait_for_warm(self, pool: str, waiter: Waiter) -> None:
        """Wake `waiter` when a warm worker of `pool` is offered or a slot frees (until
        `stop_waiting`)."""
        self._warm_waiters.setdefault(pool, {})[waiter] = None

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

    def _wake_warm_waiter(self, pool: str) -> None:
        waiters = self._warm_waiters.get(pool)
        while waiters:
            waiter = next(iter(waiters))
            del waiters[waiter]
            if not waiter.abandoned:
                waiter.wake()
                break
        if waiters is not None and not waiters:
            del self._warm_waiters[pool]

    def _first_waiter(self, pool: str) -> Waiter | None:
        """The claim that waits longest for a worker of `pool` (abandoned ones skipped)."""
        for waiter in self._warm_waiters.get(pool, ()):
            if not waiter.abandoned:
                return waiter
        return None

    # -- cold spawns ------------------------------------------------------------------------

    def expect_ready(self, worker_id: str, owner: SpawnOwner | None = None) -> asyncio.Future[str]:
        """A future for the endpoint of a cold spawn, set by its readiness event; with
        `owner`, the claim it is linked to (told through `spawn_done`)."""
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._spawn_waits[worker_id] = ready
        if owner is not None:
            self._link(worker_id, owner, ready)
        return ready

    def _link(self, worker_id: str, owner: SpawnOwner, ready: asyncio.Future[str]) -> None:
        self._spawn_owner[worker_id] = owner
        self._owned[owner] = worker_id
        ready.add_done_callback(functools.partial(owner.spawn_done, worker_id))

    def _unlink(self, worker_id: str) -> None:
        owner = self._spawn_owner.pop(worker_id, None)
        if owner is not None:
            self._owned.pop(owner, None)

    def spawn_of(self, owner: SpawnOwner) -> str | None:
        """The spawn `owner` waits for, if any (not ready yet)."""
        return self._owned.get(owner)

    def resolve_ready(
        self, worker_id: str, endpoint: str, *, pool: str = "", org: str | None = None
    ) -> bool:
        """Hand a readiness event to the claim waiting on this spawn; False if none waits
        for it first (it then becomes a warm worker, which goes to the first waiting claim).

        `pool` and `org` are the spawn slot's: a claim takes its spawn directly only if the
        slot is reserved for its org and no claim waits longer.
        """
        ready = self._spawn_waits.pop(worker_id, None)
        owner = self._spawn_owner.get(worker_id)
        self._unlink(worker_id)
        if ready is None or ready.done():
            return False
        if owner is not None:
            first = self._first_waiter(pool)
            earlier = owner.in_order and first is not None and first is not owner
            if owner.abandoned or org != owner.org or earlier:
                return False
        ready.set_result(endpoint)
        return True

    def resolve_lost(self, worker_id: str, error: BaseException) -> None:
        """Fail the claim waiting on this spawn, if any."""
        ready = self._spawn_waits.pop(worker_id, None)
        self._unlink(worker_id)
        if ready is not None and not ready.done():
            ready.set_exception(error)

    def drop_spawn_wait(self, worker_id: str) -> None:
        """Nobody waits on this spawn any more."""
        self._spawn_waits.pop(worker_id, None)
        self._unlink(worker_id)

    def hand_on_spawn(self, owner: SpawnOwner, pool: str) -> None:
        """`owner` is served (or gone): its spawn goes to the first claim of `pool` that
        waits without a spawn of its own, or, when none does, to the warm pool.

        The scan runs only when a claim was served by another worker than its own spawn;
        it stops at the first claim with no spawn.
        """
        worker_id = self._owned.get(owner)
        if worker_id is None:
            return
        self.drop_spawn_wait(worker_id)
        for waiter in self._warm_waiters.get(pool, ()):
            if waiter is owner or waiter.abandoned or waiter in self._owned:
                continue
            if isinstance(waiter, SpawnOwner) and waiter.in_order:
                self.expect_ready(worker_id, waiter)
                return
