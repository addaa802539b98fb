"""`FreeIndex`: slots bucketed by free CPU, and the scheduler's best-fit search over them.

`FreeIndex` buckets nodes (or the autoscaler's imaginary bins) by free CPU, with a bit
mask of non-empty buckets: finding a node that fits a pod starts at the first bucket
with enough CPU instead of scanning every node, which is what keeps scheduling cheap at
thousands of nodes. Iteration follows insertion order inside a bucket, never hashing, so
the same inputs give the same placements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, Protocol, TypeVar

from stoker.sim.cluster.resources import Allocatable


class Capacity:
    """A node's allocatable and free capacity, a real node's or a planned one's."""

    __slots__ = (
        "alloc_cpu",
        "alloc_mem",
        "alloc_pods",
        "bucket",
        "free_cpu",
        "free_mem",
        "free_pods",
    )

    def __init__(self, allocatable: Allocatable) -> None:
        # Nothing is placed yet: all of it is free.
        self.alloc_cpu = self.free_cpu = allocatable.cpu_m
        self.alloc_mem = self.free_mem = allocatable.memory_b
        self.alloc_pods = self.free_pods = allocatable.pods
        #: Its bucket in the `FreeIndex` holding it (-1: none).
        self.bucket = -1


class FreeSlot(Protocol):
    """Anything with free capacity the index can bucket: a node or a planned node."""

    alloc_cpu: int
    alloc_mem: int
    free_cpu: int
    free_mem: int
    free_pods: int
    bucket: int

    @property
    def labels(self) -> Mapping[str, str]:
        """The slot's node labels (empty for a planned node)."""
        ...


SlotT = TypeVar("SlotT", bound=FreeSlot)


class FreeIndex(Generic[SlotT]):
    """Slots bucketed by free CPU (`granularity_m` millicores wide), fullest first.

    `candidates(cpu)` yields slots from the bucket holding `cpu` upwards: every slot
    with at least that much free CPU, tightest first, plus a few in the first bucket
    that the caller must still check. A bit mask of non-empty buckets skips empty
    ranges in one integer operation.
    """

    def __init__(self, granularity_m: int = 100) -> None:
        if granularity_m < 1:
            raise ValueError("granularity_m must be >= 1")
        self._granularity = granularity_m
        self._buckets: dict[int, dict[SlotT, None]] = {}
        self._mask = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, slot: SlotT) -> bool:
        bucket = self._buckets.get(slot.bucket)
        return bucket is not None and slot in bucket

    def add(self, slot: SlotT) -> None:
        """Index `slot` under its current free CPU."""
        number = max(slot.free_cpu, 0) // self._granularity
        bucket = self._buckets.get(number)
        if bucket is None:
            bucket = self._buckets[number] = {}
            self._mask |= 1 << number
        bucket[slot] = None
        slot.bucket = number
        self._size += 1

    def discard(self, slot: SlotT) -> None:
        """Stop indexing `slot` (no-op if it is not indexed)."""
        bucket = self._buckets.get(slot.bucket)
        if bucket is None or slot not in bucket:
            return
        del bucket[slot]
        if not bucket:
            del self._buckets[slot.bucket]
            self._mask &= ~(1 << slot.bucket)
        slot.bucket = -1
        self._size -= 1

    def update(self, slot: SlotT) -> None:
        """Move `slot` to the bucket of its new free CPU."""
        number = max(slot.free_cpu, 0) // self._granularity
        if number != slot.bucket:
            self.discard(slot)
            self.add(slot)

    def candidates(self, cpu_m: int) -> Iterator[SlotT]:
        """Slots that may have `cpu_m` free, in ascending free-CPU buckets.

        The caller must not add, move or discard slots while iterating.
        """
        number = max(cpu_m, 0) // self._granularity
        mask = self._mask >> number
        while mask:
            skip = (mask & -mask).bit_length() - 1
            number += skip
            yield from self._buckets[number]
            mask >>= skip + 1
            number += 1

    def __iter__(self) -> Iterator[SlotT]:
        return self.candidates(0)

    def descending(self) -> Iterator[SlotT]:
        """Slots from the most free CPU down (the emptiest first).

        The caller must not add, move or discard slots while iterating.
        """
        mask = self._mask
        while mask:
            top = mask.bit_length() - 1
            yield from self._buckets[top]
            mask &= ~(1 << top)


def most_allocated(slot: FreeSlot, cpu: int, mem: int) -> float:
    """kube-scheduler's MostAllocated score (equal weights) after placing cpu/mem here."""
    used_cpu = slot.alloc_cpu - slot.free_cpu + cpu
    used_mem = slot.alloc_mem - slot.free_mem + mem
    return used_cpu / max(slot.alloc_cpu, 1) + used_mem / max(slot.alloc_mem, 1)


def best_fit(
    index: FreeIndex[SlotT],
    cpu: int,
    mem: int,
    *,
    candidates: int,
    node_filter: tuple[tuple[str, str], ...] = (),
    score: Callable[[SlotT, int, int], float] | None = None,
    emptiest_first: bool = False,
) -> SlotT | None:
    """The best-scored of the first `candidates` slots that fit cpu, mem and one pod.

    Like kube-scheduler on a large cluster, it scores a sample of the feasible nodes
    instead of all of them: the tightest in CPU (the likeliest winners of the default
    `most_allocated` score), or with `emptiest_first` the emptiest (a `least_allocated`
    score's).
    """
    rate = score or most_allocated
    best: SlotT | None = None
    best_score = -math.inf
    found = 0
    for slot in index.descending() if emptiest_first else index.candidates(cpu):
        if slot.free_cpu < cpu or slot.free_mem < mem or slot.free_pods < 1:
            continue
        if node_filter and not all(slot.labels.get(k) == v for k, v in node_filter):
            continue
        value = rate(slot, cpu, mem)
        if value > best_score:
            best, best_score = slot, value
        found += 1
        if found >= candidates:
            break
    return best


def least_allocated(slot: FreeSlot, cpu: int, mem: int) -> float:
    """kube-scheduler's LeastAllocated score (its default; equal weights), 0 to 2."""
    return 2.0 - most_allocated(slot, cpu, mem)
