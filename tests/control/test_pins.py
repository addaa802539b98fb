"""Which workers' nodes must not be disrupted (`wants_pin`), and the reconcile of missing
pins on a runtime's pins in memory."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from stoker.control.book import Book
from stoker.control.metrics import Metrics
from stoker.control.pins import Pins, wants_pin
from stoker.domain.records import Worker
from stoker.domain.states import WorkerState

S = WorkerState


def worker(state: WorkerState, *, activated: bool = False) -> Worker:
    return Worker(
        id="w-1",
        pool="p",
        revision="r",
        state=state,
        epoch=1,
        owner="cp",
        created_at=0.0,
        updated_at=0.0,
        activated=activated,
    )


@pytest.mark.parametrize(
    ("state", "activated", "wanted"),
    [
        (S.WARM, False, False),
        (S.RESERVED, False, False),  # picked from warm: neutral until activated
        (S.RESERVED, True, True),  # reserved for reuse by its org
        (S.ACTIVATING, True, True),
        (S.HOT, True, True),
        (S.HOT_IDLE, True, True),
        (S.SPAWNING, False, None),
        (S.DRAINING, True, None),
        (S.RETIRED, True, None),
    ],
)
def test_a_worker_is_pinned_once_it_holds_an_orgs_data(
    state: WorkerState, activated: bool, wanted: bool | None
) -> None:
    assert wants_pin(worker(state, activated=activated)) is wanted


class PodPins:
    """A runtime's pins as `Pins` reads them: the ids of pods without a pin (`unpinned`),
    and the patches it was sent."""

    def __init__(self, unpinned: set[str]) -> None:
        self.without_pin = unpinned
        self.patched: list[tuple[str, bool]] = []

    def unpinned(self) -> set[str]:
        return self.without_pin

    def pinned(self, worker: Worker) -> bool:
        return worker.id not in self.without_pin

    async def set_busy(self, worker: Worker, busy: bool) -> None:
        self.patched.append((worker.id, busy))
        self.without_pin.discard(worker.id)


class CountingBook(Book):
    """A book that counts how often the whole of it is copied out."""

    walks = 0

    def known_workers(self) -> dict[str, Worker]:
        self.walks += 1
        return super().known_workers()


def pins_of(workers: list[Worker], runtime: PodPins) -> tuple[Pins, CountingBook, Metrics]:
    book = CountingBook(reader=None, instance_id="cp")  # type: ignore[arg-type]
    book.load(workers)
    shared = SimpleNamespace(
        book=book, catalog=SimpleNamespace(pools={"p": None}), metrics=Metrics()
    )
    return Pins(shared, runtime=runtime, reader=None), book, shared.metrics  # type: ignore[arg-type]


def fleet(n: int) -> list[Worker]:
    """`n` hot workers of replica `cp`, then a warm one (`w-warm`)."""
    hot = [
        dataclasses.replace(worker(S.HOT, activated=True), id=f"w-{i:03}", org="acme")
        for i in range(n)
    ]
    return [*hot, dataclasses.replace(worker(S.WARM), id="w-warm")]


async def test_a_pass_without_a_missing_pin_looks_only_at_the_unpinned_pods() -> None:
    """Only the warm worker's pod lacks a pin (as it should): nothing is patched and the
    book's fleet is not walked."""
    runtime = PodPins({"w-warm"})
    pins, book, metrics = pins_of(fleet(50), runtime)
    assert await pins.reconcile() == 0
    assert runtime.patched == [] and book.walks == 0
    assert metrics.registry.get_sample_value("stoker_pins_out_of_date", {"pool": "p"}) == 0


async def test_missing_pins_are_restored_in_the_books_order() -> None:
    runtime = PodPins({"w-warm", "w-040", "w-007"})
    pins, book, _ = pins_of(fleet(50), runtime)
    assert await pins.reconcile() == 0
    assert runtime.patched == [("w-007", True), ("w-040", True)]
    assert book.walks == 1
