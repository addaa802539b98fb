"""The Elector port: who runs the fleet-wide janitor.

Leadership is an optimisation, never a correctness requirement (I7): every janitor action
is a fenced write. An elector re-contends in a loop forever after losing or failing to
renew its lease. Adapters: the store lease (`stoker.adapters.elector_store`) and the
Kubernetes Lease (`stoker.adapters.elector_k8s`).
"""

from __future__ import annotations

from typing import Protocol


class Elector(Protocol):
    """Leader election for one named lease."""

    @property
    def is_leader(self) -> bool:
        """True while this replica holds an unexpired lease."""
        ...

    @property
    def epoch(self) -> int:
        """The lease's fencing epoch while leading (bumped on every change of holder)."""
        ...

    async def run(self) -> None:
        """Contend, lead, renew and re-contend until cancelled."""
        ...

    async def resign(self) -> None:
        """Give the lease up (on a clean shutdown) so another replica leads at once."""
        ...


class SoleLeader:
    """The elector of a single replica: always the leader."""

    is_leader = True
    epoch = 1

    async def run(self) -> None:
        """Nothing to contend for."""

    async def resign(self) -> None:
        """Nothing to give up."""
