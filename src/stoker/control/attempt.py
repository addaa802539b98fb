"""One claim being served: what its parts read and the requester may abandon."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from stoker.domain.records import Claim, ClaimRequest
from stoker.domain.specs import PoolSpec
from stoker.domain.states import ClaimMode, MissReason

#: Deadlines count as reached this close to them: on a virtual clock a float-rounding
#: residue of 1e-12 s would otherwise be a timer that never advances time.
_EPS = 1e-6


@dataclass(eq=False)
class Attempt:
    """One claim being served; outlives its requester if the requester gives up."""

    req: ClaimRequest
    pool: PoolSpec
    org_cap: int
    started: float
    deadline: float
    result: asyncio.Future[Claim]
    abandoned: bool = False
    #: The requester was cancelled (it disconnected, or the shutdown grace ended) rather
    #: than answered with its timeout: it was told no capacity refusal.
    cancelled: bool = False
    #: Why the last try found nothing, reported if the deadline passes.
    blocked_by: MissReason | None = None
    missed: bool = False
    #: It found no ready worker and waited for one to start: whatever worker it gets
    #: next (its own spawn, or a warm one that got ready first) served it cold.
    waited_for_start: bool = False
    #: Counted once as a claim that wanted a neutral worker (the demand rate).
    counted: bool = False
    #: The last spawn error of the pool, when its failing spawns held this claim back.
    spawn_error: str | None = None
    wakeup: asyncio.Future[None] | None = field(default=None, repr=False)
    #: A cold spawn handed to this claim, ready (or lost): its id and endpoint future.
    spawn_ready: tuple[str, asyncio.Future[str]] | None = field(default=None, repr=False)
    #: The parked worker of another org this claim retires to make room at the pool cap.
    reclaiming: str | None = None

    @property
    def org(self) -> str:
        """The org the claim is for."""
        return self.req.org

    @property
    def in_order(self) -> bool:
        """Whether it takes any ready worker in arrival order (a `cold` claim waits for
        its own spawn)."""
        return self.req.mode is not ClaimMode.COLD

    @property
    def waits(self) -> bool:
        """Whether it may wait for a worker at all (a timeout of 0 does not)."""
        return self.deadline > self.started

    def gone(self) -> bool:
        """True once the requester gave up (a method, so checks are never narrowed away)."""
        return self.abandoned

    def left(self, now: float) -> float:
        """Seconds left before the deadline (0 when reached)."""
        remaining = self.deadline - now
        return remaining if remaining > _EPS else 0.0

    def wake(self) -> None:
        """End the current wait, if any: a worker or a slot may be free."""
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)

    def spawn_done(self, worker_id: str, ready: asyncio.Future[str]) -> None:
        """The cold spawn handed to this claim got ready or was lost: take it next."""
        self.spawn_ready = (worker_id, ready)
        self.wake()

    def abandon(self, *, cancelled: bool = False) -> None:
        """The requester gave up (`cancelled`: it was cancelled, not timed out): whatever
        the attempt holds goes back."""
        self.abandoned = True
        self.cancelled = cancelled
        self.wake()
