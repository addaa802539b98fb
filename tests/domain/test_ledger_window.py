"""The time window of a ledger or claim-log read (`since`, `until`): what each accepts,
and errors that name the parameter and the whole text given."""

from __future__ import annotations

import pytest

from stoker.domain.ledger import window

NOW = 1_800_000_000.0


def test_durations_and_unix_seconds() -> None:
    assert window("24h", None, NOW, 60.0) == (NOW - 86400.0, NOW)
    assert window("2d", "1d", NOW, 60.0) == (NOW - 2 * 86400.0, NOW - 86400.0)
    assert window(None, "1799999000", NOW, 60.0) == (1799998940.0, 1799999000.0)


@pytest.mark.parametrize(
    ("since", "until", "message"),
    [
        (
            "bogus",
            None,
            "since: expected unix seconds or a duration such as 24h or 7d, got 'bogus'",
        ),
        (
            "1h",
            "yesterday",
            "until: expected unix seconds or a duration such as 24h or 7d, got 'yesterday'",
        ),
        (
            "nan",
            None,
            "since: expected unix seconds or a duration such as 24h or 7d, got 'nan'",
        ),
        # Python's float reads `1_000` as 1000; a time given so is a typo, not 1970.
        (
            "1_000",
            None,
            "since: expected unix seconds or a duration such as 24h or 7d, got '1_000'",
        ),
        (
            "1_5h",
            None,
            "since: expected unix seconds or a duration such as 24h or 7d, got '1_5h'",
        ),
        ("-1h", None, "since: not a duration: '-1h'"),
        ("", None, "since: expected unix seconds or a duration such as 24h or 7d, got ''"),
        ("1h", "", "until: expected unix seconds or a duration such as 24h or 7d, got ''"),
        ("1h", "2h", "since must be before until"),
    ],
)
def test_a_bad_window_names_its_parameter_and_text(
    since: str, until: str | None, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        window(since, until, NOW, 60.0)
    assert str(err.value) == message
