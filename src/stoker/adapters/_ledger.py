"""The rows of the ledger and the claim log (`_schema.LEDGER`, `_schema.CLAIM_LOG`), built and
read the same way by both stores."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from stoker.adapters._rows import dump_json
from stoker.adapters._schema import CLAIM_LOG, LEDGER
from stoker.domain.ledger import (
    ClaimEnding,
    ClaimLogEntry,
    LedgerCounts,
    LedgerKey,
)

#: The ledger's columns in row order, and the claim log's.
LEDGER_COLUMNS = LEDGER.names
LOG_COLUMNS = CLAIM_LOG.names
#: The columns an arrival sets (besides the key), and those an ending sets.
ARRIVAL_SETS = ("at", "mode", "source", "wait_s", "revision")
ENDING_SETS = ("held_s", "outcome")


def ledger_rows(
    instance_id: str, cells: Mapping[LedgerKey, LedgerCounts], now: float
) -> list[tuple[Any, ...]]:
    """One row per cell, in `LEDGER_COLUMNS` order (hists as JSON text)."""
    rows = []
    for key in sorted(cells, key=lambda k: (k.pool, k.revision, k.org, k.hour)):
        counts = cells[key]
        rows.append(
            (
                key.pool,
                key.revision,
                key.org,
                key.hour,
                instance_id,
                *counts.scalar_values(),
                dump_json(counts.hists()),
                now,
            )
        )
    return rows


def ledger_from_row(row: Sequence[Any]) -> tuple[LedgerKey, LedgerCounts]:
    """A cell from a row read in `LEDGER_COLUMNS` order."""
    values = dict(zip(LEDGER_COLUMNS, row, strict=True))
    hists = values["hists"]
    if isinstance(hists, str):
        hists = json.loads(hists)
    key = LedgerKey(values["pool"], values["revision"], values["org"], int(values["hour"]))
    return key, LedgerCounts.from_parts(values, hists or {})


def arrival_row(entry: ClaimLogEntry) -> tuple[Any, ...]:
    """An arrival's row in `LOG_COLUMNS` order."""
    return (
        entry.id,
        entry.at,
        entry.pool,
        entry.org,
        entry.mode,
        entry.source,
        entry.wait_s,
        entry.held_s,
        entry.outcome,
        entry.revision,
    )


def ending_row(ending: ClaimEnding) -> tuple[Any, ...]:
    """An ending's row in `LOG_COLUMNS` order, its arrival taken as its bind until the
    arrival's own write lands."""
    return (
        ending.id,
        ending.bound_at,
        ending.pool,
        ending.org,
        ending.mode,
        ending.source,
        0.0,
        ending.held_s,
        ending.outcome,
        None,
    )


def log_from_row(row: Sequence[Any]) -> ClaimLogEntry:
    """A log entry from a row read in `LOG_COLUMNS` order."""
    return ClaimLogEntry(*row)
