"""Kubernetes quantities, parsed once for the Kubernetes runtime and the simulator."""

from __future__ import annotations

from fractions import Fraction

import pytest

from stoker.domain.errors import ConfigError
from stoker.domain.quantities import cpu_millis, memory_bytes, parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2", Fraction(2)),
        ("500m", Fraction(1, 2)),
        ("1.5Gi", Fraction(3 << 29)),
        ("512Mi", Fraction(512 << 20)),
        ("1M", Fraction(10**6)),
        ("1e3", Fraction(1000)),
        (" 4Ki ", Fraction(4096)),
    ],
)
def test_a_quantity_is_its_exact_value(text: str, value: Fraction) -> None:
    assert parse_quantity(text) == value


def test_cpu_and_memory_round_up_to_their_unit() -> None:
    assert cpu_millis("0.0001") == 1
    assert cpu_millis("1.5") == 1500
    assert memory_bytes("1.5Ki") == 1536


@pytest.mark.parametrize("text", ["", "Gi", "two", "-1", "1..5"])
def test_what_is_no_quantity_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="resource quantity"):
        parse_quantity(text)
