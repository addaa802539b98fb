"""Kubernetes resource quantities ("500m", "1.5Gi", "2", "1e3") as exact fractions.

One parser for every part that reads a quantity: the Kubernetes runtime (how many workers
a headroom placeholder makes room for) and the simulated cluster (the scheduler's sums).
It lives in the domain so that neither needs the other's libraries: the simulator runs
without the `kubernetes` extra.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

from stoker.domain.errors import ConfigError

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL: dict[str, Fraction] = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
#: Longest suffix first, so that "Mi" is never read as "M".
_SUFFIXES = sorted((*_BINARY, *_DECIMAL), key=len, reverse=True)


@lru_cache(maxsize=4096)
def parse_quantity(text: str) -> Fraction:
    """A Kubernetes quantity ("500m", "1.5Gi", "2", "1e3") as an exact fraction; a
    `ConfigError` for text that is none or is negative."""
    value = text.strip()
    for suffix in _SUFFIXES:
        if value.endswith(suffix):
            number = value[: -len(suffix)]
            scale = Fraction(_BINARY[suffix]) if suffix in _BINARY else _DECIMAL[suffix]
            break
    else:
        number, scale = value, Fraction(1)
    try:
        amount = Fraction(number)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"invalid resource quantity {text!r}") from None
    if amount < 0:
        raise ConfigError(f"negative resource quantity {text!r}")
    product: Fraction = amount * scale
    return product


def cpu_millis(text: str) -> int:
    """CPU quantity in millicores, rounded up (a request of 0.0001 cores takes one)."""
    return math.ceil(parse_quantity(text) * 1000)


def memory_bytes(text: str) -> int:
    """Memory quantity in bytes, rounded up."""
    return math.ceil(parse_quantity(text))
