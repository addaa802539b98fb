"""An admin's actions on a rollout under way: pause, resume, abort, promote.

Each is one write of the rollout's row by compare-and-set on its pool's generation (read
again and retried when another write won the race), then served by this replica at once;
the others load it within a pass. An action on a rollout that has ended is refused
(`RolloutEnded`, HTTP 409).
"""

from __future__ import annotations

from enum import StrEnum

from stoker.control import logs
from stoker.control.catalog import Catalog
from stoker.control.journal import EventKind
from stoker.control.rollouts import Rollouts
from stoker.domain.errors import NotFound, RolloutEnded
from stoker.domain.pools import Rollout, StaleGeneration
from stoker.domain.rollouts import RolloutState
from stoker.ports.clock import Clock
from stoker.ports.store import ReplicaStore

#: Tries of a write that keeps losing the race to other writes of the pool.
_TRIES = 3


class Action(StrEnum):
    """What an admin may do to a rollout under way."""

    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"
    PROMOTE = "promote"


def acted(rollout: Rollout, action: Action, now: float) -> Rollout:
    """The rollout's row after `action` (`RolloutEnded` when it has ended)."""
    if rollout.state.ended:
        raise RolloutEnded(
            f"rollout {rollout.id!r} of pool {rollout.pool!r} has ended "
            f"({rollout.state.value}): it cannot {action.value}"
        )
    match action:
        case Action.PAUSE:
            return rollout.evolve(state=RolloutState.PAUSED, reason="paused by an admin")
        case Action.RESUME:
            # The step's interval starts again: a pause never counts towards it.
            # The reason of a pause goes with it.
            return rollout.evolve(state=RolloutState.RAMPING, step_started_at=now, reason=None)
        case Action.ABORT:
            return rollout.evolve(
                state=RolloutState.ABORTED, share=0, ended_at=now, reason="aborted"
            )
        case Action.PROMOTE:
            return rollout.evolve(
                state=RolloutState.PROMOTED, share=100, ended_at=now, reason="promoted"
            )


class RolloutActions:
    """Reads and acts on the rollouts of this replica's pools."""

    def __init__(
        self, *, store: ReplicaStore, catalog: Catalog, rollouts: Rollouts, clock: Clock
    ) -> None:
        self._store, self._catalog, self._rollouts, self._clock = store, catalog, rollouts, clock

    async def get(self, pool: str, rollout_id: str) -> Rollout:
        """The pool's rollout `rollout_id`, active or ended; NotFound otherwise."""
        self._catalog.pool(pool)
        rollout = await self._store.get_rollout(rollout_id)
        if rollout is None or rollout.pool != pool:
            raise NotFound(f"pool {pool!r} has no rollout {rollout_id!r}")
        return rollout

    async def act(
        self, pool: str, rollout_id: str, action: Action, *, generation: int | None = None
    ) -> Rollout:
        """Pause, resume, abort or promote the rollout; the row as written. `generation`:
        the pool's generation the caller read (`If-Match`); another is `StaleGeneration`,
        and so is a lost race (None: the one read now, read again on a lost race)."""
        tries = 0
        while True:
            tries += 1
            rollout = await self.get(pool, rollout_id)
            stored = await self._store.get_pool(pool)
            if stored is None:
                raise NotFound(f"pool {pool!r} is not in the store")
            if generation is not None and generation != stored.generation:
                raise StaleGeneration(pool, generation, stored.generation)
            now = self._clock.now()
            written = acted(rollout, action, now)
            try:
                await self._store.update_rollout(written, generation=stored.generation, now=now)
                break
            except StaleGeneration:
                if generation is not None or tries >= _TRIES:
                    raise
        spec = self._catalog.get(pool)
        if spec is not None:
            self._rollouts.adopt(spec, written)
        self._rollouts.record(_EVENTS[action], written, f"{action.value} by an admin")
        logs.event(
            "rollout_" + action.value,
            pool=pool,
            rollout=written.id,
            revision=written.revision,
            state=written.state.value,
        )
        return written


#: The journal's event of each action.
_EVENTS = {
    Action.PAUSE: EventKind.ROLLOUT_PAUSED,
    Action.RESUME: EventKind.ROLLOUT_RESUMED,
    Action.ABORT: EventKind.ROLLOUT_ABORTED,
    Action.PROMOTE: EventKind.ROLLOUT_PROMOTED,
}
