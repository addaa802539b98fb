"""Leader election on a lease row in the store (`leader_election: store`).

The lease is taken and renewed by compare-and-set in the store (`Store.acquire_lease`); the
fencing epoch is bumped whenever the holder changes. The loop (re-contend forever, step
down at the renew deadline) is the one every elector shares, in `_election`.
"""

from __future__ import annotations

from typing import Unpack

from stoker.adapters._election import ElectorOptions, LeaseElector
from stoker.domain.specs import JANITOR_LEASE
from stoker.ports.clock import Clock
from stoker.ports.store import Store


class StoreLeaseBackend:
    """One named lease row of a `Store`."""

    def __init__(self, store: Store, name: str = JANITOR_LEASE) -> None:
        self.store = store
        self.name = name

    async def try_acquire(self, holder: str, now: float, duration_s: float) -> int | None:
        """Take or renew the lease row; its epoch, or None while another holds it."""
        lease = await self.store.acquire_lease(
            self.name, holder=holder, now=now, duration_s=duration_s
        )
        return lease.epoch if lease is not None else None

    async def release(self, holder: str, now: float) -> None:
        """Free the row if `holder` holds it."""
        await self.store.release_lease(self.name, holder=holder, now=now)


class StoreLeaseElector(LeaseElector):
    """A `LeaseElector` whose lease is a row in the control plane's own store.

    `options` are the timings and callbacks of `LeaseElector`.
    """

    def __init__(
        self,
        store: Store,
        *,
        clock: Clock,
        identity: str,
        name: str = JANITOR_LEASE,
        **options: Unpack[ElectorOptions],
    ) -> None:
        super().__init__(StoreLeaseBackend(store, name), clock=clock, identity=identity, **options)
