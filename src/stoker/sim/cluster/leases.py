"""The API server's Leases: one namespace's, with resourceVersion compare-and-set."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from stoker.ports.cluster import Conflict, Invalid, Lease, ObjectNotFound
from stoker.sim.cluster.validation import check_name


class LeaseTable:
    """Leases by name; each write takes the next global resourceVersion from `next_rv`."""

    def __init__(self, namespace: str, next_rv: Callable[[], str]) -> None:
        self._namespace = namespace
        self._next_rv = next_rv
        self._leases: dict[str, Lease] = {}

    def get(self, name: str) -> Lease | None:
        """The lease, or None."""
        return self._leases.get(name)

    def create(self, lease: Lease) -> Lease:
        """Store a new lease; `Conflict` if it exists."""
        check_name("lease", lease.name)
        if lease.namespace and lease.namespace != self._namespace:
            raise Invalid(
                f"lease namespace {lease.namespace!r} is not {self._namespace!r}", status=400
            )
        if lease.name in self._leases:
            raise Conflict(f'leases.coordination.k8s.io "{lease.name}" already exists', status=409)
        created = replace(lease, namespace=self._namespace, resource_version=self._next_rv())
        self._leases[lease.name] = created
        return created

    def update(self, lease: Lease) -> Lease:
        """Replace the lease if `lease.resource_version` is still current (compare-and-set)."""
        current = self._leases.get(lease.name)
        if current is None:
            raise ObjectNotFound(f'leases.coordination.k8s.io "{lease.name}" not found', status=404)
        if lease.resource_version and lease.resource_version != current.resource_version:
            raise Conflict(
                f'Operation cannot be fulfilled on leases.coordination.k8s.io "{lease.name}": '
                "the object has been modified; please apply your changes to the latest version",
                status=409,
            )
        updated = replace(lease, namespace=self._namespace, resource_version=self._next_rv())
        self._leases[lease.name] = updated
        return updated
