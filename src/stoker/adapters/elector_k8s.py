"""`KubernetesLeaseElector`: leader election on a coordination.k8s.io/v1 Lease.

The shared elector loop (`stoker.adapters._election.LeaseElector`) runs on a backend that
reads and writes one Lease through the ClusterAPI port, the way client-go's LeaseLock does:

- holder identity, acquire and renew times and the duration live in the Lease's spec;
- every write is a compare-and-set on the resourceVersion last seen, so of two replicas
  acting at once exactly one wins; the other's 409 is a lost race, not an error;
- the holder renews on the Lease it last wrote, without reading it first (one call per
  renewal instead of two); a 409 or 404 sends it back to reading;
- `leaseTransitions` counts changes of holder and is the fencing epoch (plus one, so the
  first holder leads with epoch 1, as with the store lease);
- a lease held by another replica counts as expired only once this replica has seen it
  unchanged for its whole duration on its own clock (client-go's rule), so a clock skew
  between replicas can never make two of them lead at once.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Unpack

from stoker.adapters._election import ElectorOptions, LeaseElector
from stoker.ports.clock import Clock
from stoker.ports.cluster import ClusterAPI, Conflict, Lease, ObjectNotFound

#: The Lease that elects the janitor, unless configured otherwise.
DEFAULT_LEASE_NAME = "stoker-janitor"


class KubernetesLeaseBackend:
    """A `LeaseBackend` on one Lease object; one instance per elector (it keeps what it saw)."""

    def __init__(self, cluster: ClusterAPI, name: str = DEFAULT_LEASE_NAME) -> None:
        self._cluster = cluster
        self.name = name
        # The last resourceVersion seen and the wall time it was first seen at: the local
        # clock decides expiry, never the holder's renewTime (clock skew).
        self._observed_rv = ""
        self._observed_at = 0.0
        #: The Lease as this backend last wrote it while holding it (renewals start there).
        self._written: Lease | None = None

    async def try_acquire(self, holder: str, now: float, duration_s: float) -> int | None:
        """Create, take over or renew the Lease with a compare-and-set; None if another holds it."""
        seconds = max(1, math.ceil(duration_s))
        written, self._written = self._written, None
        if written is not None and written.holder == holder:
            try:
                stored = await self._cluster.update_lease(
                    replace(written, renew_time=now, duration_s=seconds)
                )
            except (Conflict, ObjectNotFound):
                pass  # changed or gone since: read it, as a contender does
            else:
                return self._hold(stored, now)
        lease = await self._cluster.get_lease(self.name)
        if lease is None:
            fresh = Lease(
                name=self.name,
                holder=holder,
                acquire_time=now,
                renew_time=now,
                duration_s=seconds,
                transitions=0,
            )
            try:
                created = await self._cluster.create_lease(fresh)
            except Conflict:
                return None  # another replica created it first
            return self._hold(created, now)
        self._observe(lease, now)
        ours = lease.holder == holder
        if not ours and lease.holder and not self._expired(lease, now):
            return None
        wanted = replace(
            lease,
            holder=holder,
            acquire_time=(lease.acquire_time or now) if ours else now,
            renew_time=now,
            duration_s=seconds,
            transitions=lease.transitions if ours else lease.transitions + 1,
        )
        try:
            stored = await self._cluster.update_lease(wanted)
        except (Conflict, ObjectNotFound):
            # Someone wrote (or deleted) it since it was read: a lost race.
            return None
        return self._hold(stored, now)

    def _hold(self, stored: Lease, now: float) -> int:
        self._observe(stored, now)
        self._written = stored
        return _epoch(stored)

    async def release(self, holder: str, now: float) -> None:
        """Clear the holder (as client-go does) if `holder` still holds the Lease."""
        self._written = None
        lease = await self._cluster.get_lease(self.name)
        if lease is None or lease.holder != holder:
            return
        try:
            await self._cluster.update_lease(
                replace(lease, holder=None, acquire_time=now, renew_time=now, duration_s=1)
            )
        except (Conflict, ObjectNotFound):
            return  # someone else wrote it meanwhile: it is not ours to release any more

    def _observe(self, lease: Lease, now: float) -> None:
        if lease.resource_version != self._observed_rv:
            self._observed_rv = lease.resource_version
            self._observed_at = now

    def _expired(self, lease: Lease, now: float) -> bool:
        duration = lease.duration_s if lease.duration_s is not None else 0
        return now >= self._observed_at + duration


def _epoch(lease: Lease) -> int:
    return lease.transitions + 1


class KubernetesLeaseElector(LeaseElector):
    """The janitor's elector on a Kubernetes Lease (`leader_election: kubernetes`).

    Same interface and behaviour as every `LeaseElector`: it contends forever, steps down
    when it cannot renew within `renew_deadline_s`, and re-contends. `options` are the
    timings and callbacks of `LeaseElector`.
    """

    def __init__(
        self,
        *,
        cluster: ClusterAPI,
        clock: Clock,
        identity: str,
        lease_name: str = DEFAULT_LEASE_NAME,
        **options: Unpack[ElectorOptions],
    ) -> None:
        self.backend = KubernetesLeaseBackend(cluster, lease_name)
        super().__init__(self.backend, clock=clock, identity=identity, **options)
