"""Packing: claims gather sessions on the nodes that hold the most, and scale-down retires
warm workers from the nodes that hold the fewest, on virtual time (looptime).

Workers are `MemoryRuntime` entries placed on nodes by the test (`runtime.nodes`): no
cluster runs here, and the runtime's count of sessions per node is all the control plane
reads of it (the Kubernetes runtime's own count is tested in
tests/adapters/test_runtime_kubernetes*.py). The store is the real SQLite adapter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_plane_claims import Harness, pool, running

from fakes import FakeProcess, MemoryRuntime
from stoker.domain.records import Worker
from stoker.domain.states import WorkerState

pytestmark = pytest.mark.looptime

S = WorkerState


async def oldest_first(h: Harness) -> list[str]:
    """The warm workers' ids, oldest first (the order a claim took them before packing)."""
    warm = await h.workers(S.WARM)
    return [w.id for w in sorted(warm, key=lambda w: (w.created_at, w.id))]


def session_on(h: Harness, node: str, name: str = "other-session") -> None:
    """A busy worker of another pool on `node` (a session the cluster may not disrupt)."""
    h.runtime.procs[name] = FakeProcess(name, "other", ready=True, busy=True)
    h.runtime.nodes[name] = node


async def test_claims_take_warm_workers_on_the_nodes_with_the_most_sessions(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, [pool(warm_target=6)]) as h:
        warm = await oldest_first(h)
        on_a, on_b, rest = warm[3], warm[1], warm[0:1] + warm[2:3] + warm[4:]
        h.runtime.nodes.update({on_a: "a", on_b: "b"} | dict.fromkeys(rest, "c"))
        session_on(h, "a", "s-1")
        session_on(h, "a", "s-2")
        session_on(h, "b", "s-3")
        # The warm worker beside two sessions, then the one beside one, whatever the
        # order they became warm in (taking them in that order would match by chance
        # once in 30 runs).
        assert (await h.claim("x")).worker_id == on_a
        assert (await h.claim("y")).worker_id == on_b
        # Only node c has warm workers left: the next claim lands there.
        assert (await h.claim("z")).worker_id in rest


class NodelessRuntime(MemoryRuntime):
    """A runtime without nodes (as a local one) that would still count sessions if asked:
    the plane must not ask it."""

    has_nodes = False

    def __init__(self) -> None:
        super().__init__(ready_delay=0.2)
        self.asked: list[str] = []

    def node_sessions(self, worker: Worker) -> int | None:
        self.asked.append(worker.id)
        return super().node_sessions(worker)


async def test_claims_on_a_runtime_without_nodes_walk_no_queue(tmp_path: Path) -> None:
    runtime = NodelessRuntime()
    async with running(tmp_path, [pool(warm_target=4, scale_down_delay=1)], runtime=runtime) as h:
        warm = await oldest_first(h)
        h.runtime.nodes.update(dict.fromkeys(warm, "a"))
        session_on(h, "a")
        bound = {(await h.claim(org)).worker_id for org in ("x", "y")}
        assert bound <= set(warm) and len(bound) == 2
        h.plane.catalog.update_pool(pool(warm_target=0, scale_down_delay=1))
        await h.tick()
        h.clock.advance(2)
        await h.tick()
        assert len(await h.workers(S.WARM)) < 4  # scale-down ran
        assert runtime.asked == []


async def test_scale_down_retires_warm_workers_on_the_emptiest_nodes_first(
    tmp_path: Path,
) -> None:
    spec = pool(warm_target=4, scale_down_delay=1)
    async with running(tmp_path, [spec]) as h:
        old_b1, old_b2, new_a1, new_a2 = await oldest_first(h)
        h.runtime.nodes.update({old_b1: "b", old_b2: "b", new_a1: "a", new_a2: "a"})
        session_on(h, "b")
        h.plane.catalog.update_pool(pool(warm_target=2, scale_down_delay=1))
        await h.tick()  # the excess starts its delay
        h.clock.advance(2)
        retired: list[str] = []
        for _ in range(2):  # one retirement per pass: 10 % of the pool, at least one
            before = set(await oldest_first(h))
            await h.tick()
            retired += sorted(before - set(await oldest_first(h)))
        # Oldest first would have retired the two on b, beside the session; the two on
        # a go, and node a is left with no worker at all.
        assert sorted(retired) == sorted([new_a1, new_a2])
        assert set(await oldest_first(h)) == {old_b1, old_b2}
