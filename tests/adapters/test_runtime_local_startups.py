"""The start-up gate of the local runtime, counted without processes (no time passes)."""

from __future__ import annotations

import asyncio

import pytest

from stoker.adapters.runtime_local._startups import StartGate
from stoker.domain.errors import SpawnWithdrawn


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_storm_never_has_more_than_the_limit_starting() -> None:
    gate = StartGate(3)
    granted: list[str] = []

    async def start(worker_id: str) -> None:
        await gate.enter(worker_id, urgent=worker_id.startswith("cold"))
        granted.append(worker_id)

    tasks = [asyncio.create_task(start(f"warm-{i}")) for i in range(100)]
    tasks += [asyncio.create_task(start(f"cold-{i}")) for i in range(2)]
    await settle()
    assert granted == ["warm-0", "warm-1", "warm-2"]
    assert (gate.starting, gate.queued) == (3, 99)
    gate.leave("warm-1")
    gate.leave("warm-1")  # leaving twice frees one slot only
    await settle()
    # Cold spawns (a claim waits for them) go before the refill that came earlier.
    assert granted[3:] == ["cold-0"]
    while gate.queued:
        gate.leave(granted[-1])
        await settle()
        assert gate.starting == 3
    await asyncio.gather(*tasks)
    assert granted[4:7] == ["cold-1", "warm-3", "warm-4"]
    assert len(set(granted)) == 102 and gate.peak == 3


async def test_withdrawn_and_cancelled_waiters_give_their_turn_on() -> None:
    gate = StartGate(1)
    await gate.enter("a")
    withdrawn = asyncio.create_task(gate.enter("b"))
    cancelled = asyncio.create_task(gate.enter("c"))
    third = asyncio.create_task(gate.enter("d"))
    await settle()
    assert gate.withdraw("b", "was stopped")
    assert not gate.withdraw("a", "was stopped")  # starting, not queued
    cancelled.cancel()
    await settle()
    with pytest.raises(SpawnWithdrawn, match="b was stopped before it started"):
        await withdrawn
    gate.leave("a")
    await third
    assert (gate.starting, gate.queued) == (1, 0)
    # Granted and cancelled at once: the slot is handed on, not lost.
    late = asyncio.create_task(gate.enter("e"))
    await settle()
    gate.leave("d")
    late.cancel()
    await settle()
    assert gate.starting == 0
    gate.close()
    with pytest.raises(ValueError):
        StartGate(0)


async def test_a_spawn_withdrawn_between_its_grant_and_its_turn_never_starts() -> None:
    # The leak behind a process that outlived its plane's stop: the slot was granted, the
    # stop came before the spawn resumed, found no process and no queued spawn, and the
    # spawn then started one for a retired worker.
    gate = StartGate(1)
    await gate.enter("a")
    granted = asyncio.create_task(gate.enter("b"))
    then = asyncio.create_task(gate.enter("c"))
    await settle()
    gate.leave("a")  # "b" is granted its slot; its `enter` has not returned yet
    assert gate.withdraw("b", "was stopped")
    with pytest.raises(SpawnWithdrawn, match="b was withdrawn before it started"):
        await granted
    # Its slot went on to the next one; a withdrawn spawn is withdrawn once.
    await then
    assert (gate.starting, gate.queued) == (1, 0)
    assert not gate.withdraw("b", "was stopped")


async def test_closing_withdraws_a_granted_spawn_too() -> None:
    gate = StartGate(1)
    await gate.enter("a")
    granted = asyncio.create_task(gate.enter("b"))
    await settle()
    gate.leave("a")
    gate.close()
    with pytest.raises(SpawnWithdrawn):
        await granted
    assert (gate.starting, gate.queued) == (0, 0)


class _Clock:
    """A clock that stands still until a test moves it."""

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds


async def test_the_gate_measures_how_long_a_start_up_holds_its_slot() -> None:
    """The mean hold (weight 0.2) of the start-ups that gave their slot on; a grant
    withdrawn before its start-up began is no start-up and is not counted."""
    clock = _Clock()
    gate = StartGate(1, clock)
    assert gate.hold_s is None
    await gate.enter("a")
    clock.t += 2.0
    gate.leave("a")
    assert gate.hold_s == pytest.approx(2.0)
    await gate.enter("b")
    clock.t += 7.0
    gate.leave("b")
    assert gate.hold_s == pytest.approx(2.0 + 0.2 * (7.0 - 2.0))
    await gate.enter("c")
    withdrawn = asyncio.create_task(gate.enter("d"))
    await settle()
    gate.leave("c")  # held no time: 3.0 + 0.2 * (0 - 3.0)
    assert gate.withdraw("d", "was stopped")  # granted, withdrawn before it resumed
    with pytest.raises(SpawnWithdrawn):
        await withdrawn
    assert gate.hold_s == pytest.approx(2.4)
    assert gate.starting == 0
