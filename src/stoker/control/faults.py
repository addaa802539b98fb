"""Pool faults: one pool's (or revision's) step of a pass fails without stopping the pass.

The janitor and the fallback reaper act pool by pool; an exception in one pool's step (a
stored template the runtime cannot use, a bug that one pool's settings reach) is caught
here, so the other pools are still refilled, scaled down and swept: one pool's failure
never stops the janitor's work on the others. Each pool that failed is
logged once per pass (`event=pool_pass_failed`, with the pool and the step named) and
counted once per pass in `stoker_pass_failures_total{pass,pool}`; a pool whose passes fail
`FAILING_AFTER` times in a row is reported by `/readyz` (docs/operations.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from stoker.control import logs
from stoker.control.journal import EventKind, Journal
from stoker.control.metrics import Metrics
from stoker.domain.errors import StoreError

#: Passes in a row a pool's step must fail before `/readyz` reports the pool.
FAILING_AFTER = 3


@dataclass(frozen=True, slots=True)
class PoolFault:
    """A pool whose step of a pass keeps failing: in which pass, how many passes in a row,
    which step and what it failed with last."""

    pool: str
    pass_name: str
    passes: int
    step: str
    error: str


@dataclass(frozen=True, slots=True)
class PoolProblem:
    """Why `/readyz` calls a pool degraded: its passes (`pass_failing`) or its spawns
    (`spawn_failing`) failed `in_a_row` times in a row, and the last error."""

    pool: str
    problem: Literal["pass_failing", "spawn_failing"]
    in_a_row: int
    detail: str
    revision: str | None = None


def describe(exc: BaseException) -> str:
    """An exception as a log and a status page show it: its kind and its message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class PassFaults:
    """The failing pools of one pass (`janitor` or `reaper`), pass after pass."""

    def __init__(self, pass_name: str, metrics: Metrics, journal: Journal) -> None:
        self.pass_name = pass_name
        self._metrics, self._journal = metrics, journal
        #: The pools that failed in the pass under way: (step, error) of the first failure.
        self._now: dict[str, tuple[str, str]] = {}
        #: Pools whose last passes failed, with how many in a row.
        self._failing: dict[str, PoolFault] = {}

    def begin(self) -> None:
        """A pass starts: nothing of it has failed yet."""
        self._now = {}

    @contextlib.contextmanager
    def step(self, pool: str, step: str) -> Iterator[None]:
        """Run one pool's `step`; an exception is noted for the pool and swallowed. A
        `StoreError` is not the pool's fault: it goes on and fails the pass, as before."""
        try:
            yield
        except StoreError:
            raise
        except Exception as exc:
            self.failed(pool, step, exc)

    def failed(self, pool: str, step: str, exc: BaseException | str) -> None:
        """Note that `pool`'s `step` raised `exc` (or failed as the text says) in the pass
        under way (the first failure of the pool is kept)."""
        if pool not in self._now:
            self._now[pool] = (step, exc if isinstance(exc, str) else describe(exc))

    def end(self) -> None:
        """The pass ended: log and count each pool that failed in it, once; forget the
        pools that did not fail (their streak is over)."""
        failing: dict[str, PoolFault] = {}
        for pool, (step, error) in sorted(self._now.items()):
            before = self._failing.get(pool)
            passes = 1 + (before.passes if before else 0)
            failing[pool] = PoolFault(pool, self.pass_name, passes, step, error)
            self._metrics.pass_failures.labels(self.pass_name, pool).inc()
            logs.event(
                "pool_pass_failed",
                loop=self.pass_name,
                pool=pool,
                step=step,
                passes=passes,
                error=error,
                level=logs.ERROR,
            )
            self._journal.record(
                EventKind.PASS_FAILED, pool=pool, reason=self.pass_name, detail=f"{step}: {error}"
            )
        for pool in sorted(set(self._failing) - set(failing)):
            logs.event("pool_pass_recovered", loop=self.pass_name, pool=pool)
        self._failing = failing
        self._now = {}

    def clear(self) -> None:
        """Forget every streak (this replica stopped running the pass: it lost the lead)."""
        self._failing = {}
        self._now = {}

    def failing(self, at_least: int = FAILING_AFTER) -> list[PoolFault]:
        """The pools whose last `at_least` passes (or more) failed, by name."""
        return [f for f in self._failing.values() if f.passes >= at_least]

    def problems(self) -> list[PoolProblem]:
        """The pools whose passes keep failing, as `/readyz` reports them."""
        return [
            PoolProblem(
                f.pool, "pass_failing", f.passes, f"{f.pass_name} pass, {f.step}: {f.error}"
            )
            for f in self.failing()
        ]
