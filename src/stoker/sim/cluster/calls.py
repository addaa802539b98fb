"""What tests inject into the fake API server's calls: errors, latency, a shutdown.

Every ClusterAPI call of `FakeApiServer` passes through its `CallGate` first: counted,
delayed by the latency set for it (clock time), failed with the next error queued for
it, or refused once the server is closed.
"""

from __future__ import annotations

import copy
from collections import Counter, deque

from stoker.ports.clock import Clock
from stoker.ports.cluster import ClusterError

#: The port calls that count in `calls` and that `fail_next` and `set_latency` can target.
OPERATIONS = frozenset(
    {
        "create_pod",
        "delete_pod",
        "patch_pod",
        "get_pod",
        "list_pods",
        "watch_pods",
        "get_lease",
        "create_lease",
        "update_lease",
    }
)


class CallGate:
    """Counts every call, and injects the latency and errors tests ask for."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._faults: dict[str, deque[ClusterError]] = {}
        self._latency: dict[str | None, float] = {}
        self.closed = False
        #: How often each port operation was called (failed calls included).
        self.calls: Counter[str] = Counter()

    def fail_next(self, operation: str, error: ClusterError, times: int = 1) -> None:
        """Make the next `times` calls of `operation` raise `error` (after any latency)."""
        if operation not in OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}; one of {sorted(OPERATIONS)}")
        self._faults.setdefault(operation, deque()).extend([error] * times)

    def set_latency(self, seconds: float, operation: str | None = None) -> None:
        """Delay every call of `operation` (all of them if None) by `seconds` of clock time."""
        if operation is not None and operation not in OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}; one of {sorted(OPERATIONS)}")
        if seconds < 0:
            raise ValueError("latency must be >= 0")
        self._latency[operation] = seconds

    async def enter(self, operation: str) -> None:
        """One call of `operation`: counted, delayed, failed as asked."""
        if self.closed:
            raise ClusterError("the fake API server is closed")
        self.calls[operation] += 1
        delay = self._latency.get(operation, self._latency.get(None, 0.0))
        if delay > 0:
            await self._clock.sleep(delay)
        faults = self._faults.get(operation)
        if faults:
            # A copy, so that a fault injected N times does not share one traceback.
            raise copy.copy(faults.popleft())
