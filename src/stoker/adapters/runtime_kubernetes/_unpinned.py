"""Indexes of the worker pods' do-not-disrupt pins, kept as pods change.

`UnpinnedPods` names the worker pods that are alive without a pin.

The pins' reconcile (`stoker.control.pins`) runs every janitor pass and looks for busy
workers whose pod lost, or never got, its pin. Asking the informer about every worker of
the fleet each pass costs a fleet's worth of lookups for the few pods that carry no pin
(warm and spawning ones, and a patch that failed); the informer keeps this index as pods
change instead, and the reconcile looks at the workers it names.

`PinnedByNode` counts the pinned worker pods on each node: the sessions that keep a node
from being consolidated. Claims take warm workers on the nodes that hold the most, and
scale-down retires those on the nodes that hold the fewest (`Runtime.node_sessions`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from stoker.adapters.runtime_kubernetes._pods import PodView

#: The annotation's value on a pinned pod (as `KubernetesRuntime.pinned` reads it).
_PINNED = "true"


def unpinned_worker(view: PodView) -> str | None:
    """The worker id of `view` when it is a live pod of a worker without the pin."""
    if view.alive and view.do_not_disrupt != _PINNED:
        return view.worker_id
    return None


class UnpinnedPods:
    """Worker id -> names of its live pods without a pin, kept as pods change."""

    def __init__(self) -> None:
        self._by_worker: dict[str, set[str]] = {}

    def changed(self, before: PodView | None, after: PodView | None) -> None:
        """A pod's cached view went from `before` to `after` (None: not cached)."""
        if before is not None and (worker_id := unpinned_worker(before)) is not None:
            names = self._by_worker.get(worker_id, set())
            names.discard(before.name)
            if not names:
                self._by_worker.pop(worker_id, None)
        if after is not None and (worker_id := unpinned_worker(after)) is not None:
            self._by_worker.setdefault(worker_id, set()).add(after.name)

    def workers(self) -> Collection[str]:
        """Ids of the workers with at least one live pod without a pin (a live view: read
        it before the cache changes again)."""
        return self._by_worker.keys()


def pinned_node(view: PodView) -> str | None:
    """The node of `view` when it is a live worker pod with the pin, on a node."""
    if view.alive and view.do_not_disrupt == _PINNED and view.worker_id is not None:
        return view.node_name
    return None


class PinnedByNode:
    """Node name -> live pinned worker pods on it, kept as pods change."""

    def __init__(self) -> None:
        self._pinned: Counter[str] = Counter()

    def changed(self, before: PodView | None, after: PodView | None) -> None:
        """A pod's cached view went from `before` to `after` (None: not cached)."""
        if before is not None and (node := pinned_node(before)) is not None:
            self._pinned[node] -= 1
            if self._pinned[node] <= 0:
                del self._pinned[node]
        if after is not None and (node := pinned_node(after)) is not None:
            self._pinned[node] += 1

    def on(self, node: str) -> int:
        """Live pinned worker pods on `node`."""
        return self._pinned.get(node, 0)

    def most(self, count: int) -> list[tuple[str, int]]:
        """The (at most `count`) nodes with the most live pinned worker pods, and how
        many each holds, most first."""
        return self._pinned.most_common(count)
