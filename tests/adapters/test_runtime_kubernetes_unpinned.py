"""The informer's indexes of the worker pods' do-not-disrupt pins: the live pods without
one, and the pinned pods counted by node."""

from __future__ import annotations

from dataclasses import replace

from stoker.adapters.runtime_kubernetes._pods import PodView, preferred_nodes
from stoker.adapters.runtime_kubernetes._unpinned import PinnedByNode, UnpinnedPods
from stoker.ports.cluster import PreferredNodes


def view(name: str, worker_id: str | None = None, **changes: object) -> PodView:
    base = PodView(
        name=name,
        worker_id=worker_id,
        pool="duck",
        instance="cp-one",
        placeholder=None,
        phase="Running",
        ready=True,
        pod_ip="10.0.0.1",
        port=8080,
        reason=None,
        terminating=False,
        do_not_disrupt=None,
        created_at=0.0,
        resource_version="1",
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_a_live_worker_pod_without_the_pin_is_named_until_pinned() -> None:
    index = UnpinnedPods()
    pod = view("w-1", "w-1")
    index.changed(None, pod)
    assert set(index.workers()) == {"w-1"}
    pinned = replace(pod, do_not_disrupt="true")
    index.changed(pod, pinned)
    assert set(index.workers()) == set()
    index.changed(pinned, pod)
    assert set(index.workers()) == {"w-1"}


def test_a_pod_that_ends_or_is_forgotten_leaves_the_index() -> None:
    index = UnpinnedPods()
    a, b = view("w-1", "w-1"), view("w-2", "w-2")
    index.changed(None, a)
    index.changed(None, b)
    index.changed(a, replace(a, terminating=True))
    index.changed(b, None)
    assert set(index.workers()) == set()


def test_placeholders_are_never_named_and_two_pods_of_one_worker_count_apart() -> None:
    index = UnpinnedPods()
    index.changed(None, view("hold-1", None, placeholder="duck"))
    assert set(index.workers()) == set()
    old, new = view("w-1-a", "w-1"), view("w-1-b", "w-1")
    index.changed(None, old)
    index.changed(None, new)
    index.changed(old, replace(old, phase="Failed"))
    assert set(index.workers()) == {"w-1"}
    index.changed(new, replace(new, do_not_disrupt="true"))
    assert set(index.workers()) == set()


def test_pinned_pods_are_counted_on_their_node_while_alive_and_pinned() -> None:
    index = PinnedByNode()
    a = view("w-1", "w-1", node_name="n-1", do_not_disrupt="true")
    b = view("w-2", "w-2", node_name="n-1")
    index.changed(None, a)
    index.changed(None, b)
    index.changed(None, view("hold-1", None, placeholder="duck", node_name="n-1"))
    assert (index.on("n-1"), index.on("n-2")) == (1, 0)
    pinned_b = replace(b, do_not_disrupt="true")
    index.changed(b, pinned_b)
    assert index.on("n-1") == 2
    index.changed(pinned_b, replace(pinned_b, terminating=True))
    index.changed(a, None)
    assert index.on("n-1") == 0


def test_a_pinned_pod_counts_once_it_has_a_node() -> None:
    index = PinnedByNode()
    pending = view("w-1", "w-1", do_not_disrupt="true", phase="Pending", ready=False)
    index.changed(None, pending)
    assert index.on("n-1") == 0
    running = replace(pending, node_name="n-1", phase="Running", ready=True)
    index.changed(pending, running)
    assert index.on("n-1") == 1


def test_the_nodes_with_the_most_sessions_come_first() -> None:
    index = PinnedByNode()
    for number, node in enumerate(["n-1", "n-2", "n-2", "n-3", "n-2", "n-3"]):
        index.changed(
            None, view(f"w-{number}", f"w-{number}", node_name=node, do_not_disrupt="true")
        )
    assert index.most(2) == [("n-2", 3), ("n-3", 2)]
    assert index.most(16) == [("n-2", 3), ("n-3", 2), ("n-1", 1)]
    assert PinnedByNode().most(16) == []


def test_preferred_nodes_weigh_each_node_by_its_share_of_the_most_sessions() -> None:
    terms = preferred_nodes([("n-1", 6), ("n-2", 3), ("n-3", 3), ("n-4", 1), ("n-5", 0)])
    assert terms == (
        PreferredNodes(100, ("n-1",)),
        PreferredNodes(50, ("n-2", "n-3")),
        PreferredNodes(17, ("n-4",)),
    )
    # One session beside 300 still counts (weights are 1-100); no session: no preference.
    assert preferred_nodes([("n-1", 300), ("n-2", 1)])[-1] == PreferredNodes(1, ("n-2",))
    assert preferred_nodes([]) == preferred_nodes([("n-1", 0)]) == ()
