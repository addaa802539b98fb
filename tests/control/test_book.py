"""The book: this replica's memory, its queues and the signals that wake waiting claims.

Pure memory, no store writes: the reader is only asked when a worker is refreshed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from stoker.control.book import Book
from stoker.domain.errors import RuntimeFailure
from stoker.domain.records import Worker
from stoker.domain.states import WorkerState

S = WorkerState
ME = "cp-me"


@dataclass(eq=False)
class Waiting:
    """A claim waiting in the book (the shape of `claims.Attempt` the book sees)."""

    name: str
    abandoned: bool = False
    woken: int = 0
    started: float = 0.0

    def wake(self) -> None:
        self.woken += 1


class NoReads:
    """A reader the book must not need for pure memory operations."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the book read the store: {name}")


def book(sessions: dict[str, int] | None = None) -> Book:
    """A book; with `sessions` (worker id -> sessions on its node), on a runtime with nodes."""
    if sessions is None:
        return Book(reader=NoReads(), instance_id=ME)
    return Book(reader=NoReads(), instance_id=ME, node_sessions=lambda w: sessions.get(w.id))


def worker(wid: str, state: WorkerState = S.WARM, **kw: Any) -> Worker:
    base: dict[str, Any] = {
        "id": wid,
        "pool": "p",
        "revision": "r1",
        "state": state,
        "epoch": 1,
        "owner": ME,
        "created_at": 0.0,
        "updated_at": 0.0,
    }
    base.update(kw)
    return Worker(**base)


# -- slot freed ---------------------------------------------------------------------------


def test_slot_freed_wakes_the_pool_cap_and_org_cap_waiters_of_that_pool_only() -> None:
    b = book()
    pool_cap, acme, globex = Waiting("pool"), Waiting("acme"), Waiting("globex")
    other_pool = Waiting("other")
    b.wait_for_slot("p", "", pool_cap)
    b.wait_for_slot("p", "acme", acme)
    b.wait_for_slot("p", "globex", globex)
    b.wait_for_slot("q", "acme", other_pool)

    b.slot_freed("p", "acme")

    assert (pool_cap.woken, acme.woken, globex.woken) == (1, 1, 1)
    assert other_pool.woken == 0
    # Woken waiters leave the book: they register again if they must wait again.
    b.slot_freed("p", None)
    assert (pool_cap.woken, acme.woken, globex.woken) == (1, 1, 1)


def test_slot_freed_wakes_one_claim_waiting_for_a_warm_worker() -> None:
    b = book()
    gone, first, second = Waiting("gone", abandoned=True), Waiting("first"), Waiting("second")
    for w in (gone, first, second):
        b.wait_for_warm("p", w)
    assert b.waiting_for_warm("p") == 2

    b.slot_freed("p", None)

    assert (gone.woken, first.woken, second.woken) == (0, 1, 0)
    assert b.waiting_for_warm("p") == 1


def test_a_parked_worker_wakes_only_its_orgs_waiters() -> None:
    b = book()
    acme, globex, pool_cap = Waiting("acme"), Waiting("globex"), Waiting("pool")
    b.wait_for_slot("p", "acme", acme)
    b.wait_for_slot("p", "globex", globex)
    b.wait_for_slot("p", "", pool_cap)

    b.offer_hot_idle(worker("w1", S.HOT_IDLE, org="acme"))

    assert (acme.woken, globex.woken, pool_cap.woken) == (1, 0, 0)


async def test_slot_freed_lets_a_sleeping_claim_go_on() -> None:
    """The signal ends an actual wait, as a claim held by a cap sleeps on it."""
    b = book()
    wakeup = asyncio.get_running_loop().create_future()

    @dataclass(eq=False)
    class Sleeper:
        abandoned: bool = False
        started: float = 0.0

        def wake(self) -> None:
            if not wakeup.done():
                wakeup.set_result(None)

    b.wait_for_slot("p", "", Sleeper())
    asyncio.get_running_loop().call_soon(b.slot_freed, "p", "acme")
    await asyncio.wait_for(wakeup, timeout=1)


# -- queues -------------------------------------------------------------------------------


def test_ready_queue_skips_stale_entries_and_workers_in_flight() -> None:
    b = book()
    for w in (worker("w1"), worker("w2"), worker("w3"), worker("w4")):
        b.remember(w)
        b.offer_warm(w)
    b.remember(worker("w1", S.RESERVED, org="acme"))  # taken meanwhile
    b.remember(worker("w2", S.RETIRED))  # gone: forgotten
    b.mark_in_flight("w3")

    assert b.pop(S.WARM, "p", "", "r1") == worker("w4")
    assert b.pop(S.WARM, "p", "", "r1") is None
    assert b.pop(S.WARM, "p", "", "r2") is None
    # A popped worker is being handed out until its reservation is decided.
    assert b.in_flight() == frozenset({"w3", "w4"})
    b.clear_in_flight("w3")
    b.clear_in_flight("w4")
    assert b.in_flight() == frozenset()


def test_a_claim_takes_the_warm_worker_whose_node_holds_the_most_sessions() -> None:
    sessions = {"w1": 0, "w2": 3, "w3": 1, "w4": 3}  # w5: on no node the runtime sees
    b = book(sessions)
    for wid in ("w1", "w2", "w3", "w4", "w5"):
        w = worker(wid)
        b.remember(w)
        b.offer_warm(w)
    b.mark_in_flight("w2")  # being handed out: passed over, and out of the queue
    b.remember(worker("w1", S.RESERVED, org="acme"))  # taken meanwhile: stale
    taken = [b.pop(S.WARM, "p", "", "r1") for _ in range(4)]
    # Most sessions first (a node the runtime does not see counts as none); the worker
    # in flight and the one taken meanwhile are passed over.
    assert [w.id if w else None for w in taken] == ["w4", "w3", "w5", None]


def test_a_tie_of_sessions_keeps_the_queue_order() -> None:
    b = book({"w1": 2, "w2": 2, "w3": 2})
    for wid in ("w3", "w1", "w2"):
        w = worker(wid)
        b.remember(w)
        b.offer_warm(w)
    assert [b.pop(S.WARM, "p", "", "r1") for _ in range(3)] == [
        worker("w3"),
        worker("w1"),
        worker("w2"),
    ]


def test_a_warm_worker_put_back_is_picked_first() -> None:
    b = book()
    for w in (worker("w1"), worker("w2")):
        b.remember(w)
        b.offer_warm(w)
    first = b.pop(S.WARM, "p", "", "r1")
    assert first is not None
    b.clear_in_flight(first.id)
    b.put_back_warm(first)
    assert [b.pop(S.WARM, "p", "", "r1"), b.pop(S.WARM, "p", "", "r1")] == [
        worker("w1"),
        worker("w2"),
    ]


def test_offering_a_warm_worker_wakes_the_first_claim_still_waiting() -> None:
    b = book()
    gone, waiting = Waiting("gone", abandoned=True), Waiting("waiting")
    b.wait_for_warm("p", gone)
    b.wait_for_warm("p", waiting)
    w = b.remember(worker("w1"))
    b.offer_warm(w)
    assert (gone.woken, waiting.woken) == (0, 1)


def test_hot_idle_queue_is_per_org_and_revision() -> None:
    b = book()
    old = b.remember(worker("w1", S.HOT_IDLE, org="acme", revision="r0"))
    new = b.remember(worker("w2", S.HOT_IDLE, org="acme"))
    theirs = b.remember(worker("w3", S.HOT_IDLE, org="globex"))
    for w in (old, new, theirs):
        b.offer_hot_idle(w)
    assert b.pop(S.HOT_IDLE, "p", "acme", "r1") == new
    assert b.in_flight() == frozenset({"w2"})
    assert b.pop(S.HOT_IDLE, "p", "acme", "r1") is None
    assert b.pop(S.HOT_IDLE, "p", "globex", "r1") == theirs


def test_load_queues_what_can_be_claimed_and_remembers_the_rest() -> None:
    b = book()
    warm, parked, hot = worker("w1"), worker("w2", S.HOT_IDLE, org="acme"), worker("w3", S.HOT)
    b.load([warm, parked, hot])
    assert b.known_workers() == {"w1": warm, "w2": parked, "w3": hot}
    assert b.pop(S.WARM, "p", "", "r1") == warm
    assert b.pop(S.HOT_IDLE, "p", "acme", "r1") == parked


def test_memory_forgets_workers_of_other_replicas() -> None:
    b = book()
    b.remember(worker("w1"))
    b.remember(worker("w1", owner="cp-other"))
    assert b.known("w1") is None


# -- cold spawns and facts ------------------------------------------------------------------


async def test_readiness_goes_to_the_claim_waiting_on_the_spawn() -> None:
    b = book()
    ready = b.expect_ready("w1")
    assert b.resolve_ready("w1", "http://w1")
    assert await ready == "http://w1"
    # Nobody waits any more: the next event is a fact to persist.
    assert not b.resolve_ready("w1", "http://w1")

    lost = b.expect_ready("w2")
    b.resolve_lost("w2", RuntimeFailure("gone"))
    with pytest.raises(RuntimeFailure):
        await lost


def test_facts_are_kept_until_settled() -> None:
    b = book()
    b.ready.note("w1", "http://w1")
    b.keep_unsaved_ref("w1", {"pid": 7})
    b.lost.note("w2", "evicted")
    assert b.with_unsaved_ref("w1", endpoint="e") == {"endpoint": "e", "runtime_ref": {"pid": 7}}
    facts = b.pending_facts()
    assert (dict(facts.ready), dict(facts.lost), dict(facts.retire)) == (
        {"w1": "http://w1"},
        {"w2": "evicted"},
        {},
    )
    b.ready_settled("w1")
    b.lost.settled("w2")
    assert b.with_unsaved_ref("w1", endpoint="e") == {"endpoint": "e"}
    facts = b.pending_facts()
    assert (facts.ready, facts.lost, facts.retire) == ({}, {}, {})


# -- nothing outlives what it describes ------------------------------------------------------

EMPTY = {
    "known": 0,
    "bound": 0,
    "ready": 0,
    "ready_queues": 0,
    "hot_idle": 0,
    "hot_idle_queues": 0,
    "in_flight": 0,
    "spawn_waits": 0,
    "pending_ready": 0,
    "pending_lost": 0,
    "pending_retire": 0,
    "unsaved_refs": 0,
    "spawn_starts": 0,
    "spawn_asks": 0,
    "warm_waiters": 0,
    "warm_waiter_pools": 0,
    "cap_waiters": 0,
    "cap_waiter_keys": 0,
    "tasks": 0,
}


def test_claims_that_stop_waiting_leave_the_book() -> None:
    b = book()
    held = [Waiting(f"c{i}") for i in range(50)]
    for i, w in enumerate(held):
        b.wait_for_slot("p", "" if i % 2 else "acme", w)
        b.wait_for_warm("p", w)
    # Every one gave up (timed out or left) without being woken.
    for i, w in enumerate(held):
        b.stop_waiting("p", "" if i % 2 else "acme", w)
    assert b.sizes() == EMPTY
    # A release afterwards wakes nobody that has gone.
    b.slot_freed("p", "acme")
    assert all(w.woken == 0 for w in held)


def test_woken_waiters_leave_no_empty_lists_behind() -> None:
    b = book()
    acme, pool_cap, warm = Waiting("acme"), Waiting("pool"), Waiting("warm")
    b.wait_for_slot("p", "acme", acme)
    b.wait_for_slot("p", "", pool_cap)
    b.wait_for_warm("p", warm)
    b.offer_hot_idle(worker("w1", S.HOT_IDLE, org="acme"))
    b.slot_freed("p", None)
    assert (acme.woken, pool_cap.woken, warm.woken) == (1, 1, 1)
    for w, org in ((acme, "acme"), (pool_cap, ""), (warm, "")):
        b.stop_waiting("p", org, w)
    sizes = b.sizes()
    assert (sizes["cap_waiter_keys"], sizes["warm_waiter_pools"]) == (0, 0)


def test_reaped_hot_idle_workers_leave_their_orgs_queues() -> None:
    """200 orgs park a worker each and all are reaped: no queue keeps a stale id."""
    b = book()
    for i in range(200):
        b.offer_hot_idle(b.remember(worker(f"w{i}", S.HOT_IDLE, org=f"org{i}")))
    assert b.sizes()["hot_idle"] == 200
    for i in range(200):
        b.remember(worker(f"w{i}", S.DRAINING, org=f"org{i}"))
        b.remember(worker(f"w{i}", S.RETIRED, org=f"org{i}"))
    assert b.sizes() == EMPTY


def test_old_revision_ready_queues_go_with_their_workers() -> None:
    b = book()
    for i in range(20):
        b.offer_warm(b.remember(worker(f"w{i}", revision="r0")))
    b.offer_warm(b.remember(worker("new", revision="r1")))
    for i in range(20):
        b.remember(worker(f"w{i}", S.DRAINING, revision="r0"))
    assert b.sizes()["ready_queues"] == 1
    for i in range(20):
        b.remember(worker(f"w{i}", S.RETIRED, revision="r0"))
    # A worker another replica took over is forgotten and unqueued too.
    b.remember(worker("new", revision="r1", owner="cp-other"))
    assert b.sizes() == EMPTY


def test_a_drained_queue_is_dropped() -> None:
    b = book()
    b.offer_warm(b.remember(worker("w1")))
    assert b.pop(S.WARM, "p", "", "r1") == worker("w1")
    assert b.pop(S.WARM, "p", "", "r1") is None
    b.clear_in_flight("w1")
    sizes = b.sizes()
    assert (sizes["ready"], sizes["ready_queues"]) == (0, 0)


def test_an_offer_of_stored_warm_workers_wakes_as_many_waiters_oldest_first() -> None:
    b = book()
    gone = Waiting("gone", abandoned=True)
    first, second, third = Waiting("first"), Waiting("second"), Waiting("third")
    for w in (gone, first, second, third):
        b.wait_for_warm("p", w)
    assert b.warm_waiting_pools() == ["p"]

    b.offer_stored("p", 2)
    assert (gone.woken, first.woken, second.woken, third.woken) == (0, 1, 1, 0)
    b.offer_stored("q", 3)  # another pool's workers wake nobody here
    b.offer_stored("p", 5)  # more workers than waiters
    assert (first.woken, second.woken, third.woken) == (1, 1, 1)
    assert b.warm_waiting_pools() == []


def test_a_woken_claim_that_lost_the_worker_waits_again_at_the_head() -> None:
    b = book()
    first, second, third = (
        Waiting("first", started=1),
        Waiting("second", started=2),
        Waiting("third", started=3),
    )
    for w in (first, second, third):
        b.wait_for_warm("p", w)
    b.offer_stored("p", 1)
    assert (first.woken, second.woken) == (1, 0)
    # Another replica's claim reserved the worker first: the oldest claim queues again,
    # ahead of those that came after it; a newer claim goes to the back.
    b.wait_for_warm("p", first)
    b.wait_for_warm("p", Waiting("fourth", started=4))
    b.offer_stored("p", 2)
    assert (first.woken, second.woken, third.woken) == (2, 1, 0)
