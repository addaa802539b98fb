"""`HeldMax`: the largest value over a sliding window, against a scan of every value."""

from __future__ import annotations

import random
from collections import deque

from stoker.policy.held import HeldMax


def test_the_largest_falls_only_once_it_left_the_window() -> None:
    held = HeldMax[int]()
    assert held.add(0.0, 3, 10.0) == 3
    assert held.add(5.0, 1, 10.0) == 3
    assert held.add(10.0, 2, 10.0) == 3  # 0.0 is still within [0, 10]
    assert held.add(10.5, 0, 10.0) == 2
    assert held.add(21.0, 0, 10.0) == 0


def test_it_answers_as_a_scan_of_every_value_kept_would() -> None:
    """Against the plain form: keep every value, drop those older than the window from
    the front (for good, as the window may change between adds), take the largest."""
    rng = random.Random(7)
    held, kept = HeldMax[int](), deque[tuple[float, int]]()
    now = 0.0
    for _ in range(2000):
        now += rng.choice((0.0, 1.0, 5.0, 30.0))
        window = rng.choice((0.0, 60.0, 1800.0))
        value = rng.randint(0, 6)
        kept.append((now, value))
        while kept[0][0] < now - window:
            kept.popleft()
        assert held.add(now, value, window) == max(v for _, v in kept)


def test_by_a_key_the_latest_of_equals_is_held() -> None:
    """Held by a key (the headroom's placeholders), of equal keys the latest is the one in
    force: what decided the headroom now."""
    held = HeldMax[tuple[int, str]](key=lambda value: value[0])
    assert held.add(0.0, (2, "cold"), 60.0) == (2, "cold")
    assert held.add(10.0, (2, "forecast"), 60.0) == (2, "forecast")
    assert held.add(20.0, (1, "forecast"), 60.0) == (2, "forecast")
    assert held.add(75.0, (0, "none"), 60.0) == (1, "forecast")
    assert held.add(81.0, (0, "none"), 60.0) == (0, "none")
