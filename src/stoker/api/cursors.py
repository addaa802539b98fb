"""The page cursors of the admin listings (`GET /v1/workers`, `GET /v1/claims`).

A listing runs oldest first, by `(created_at, id)`; a full page answers with `next`, the
cursor of its last row, and `?after=<next>` lists the rows after it. A cursor names a
place in that order, not a row: it stays valid when its row is purged, and rows created
meanwhile show up on a later page. It is opaque to clients (URL-safe base64 of JSON).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Sequence
from typing import Protocol

from fastapi.exceptions import RequestValidationError

_BAD = "must be the `next` of a previous page"


class Listed(Protocol):
    """A row of a listing: a worker or a claim."""

    @property
    def created_at(self) -> float: ...

    @property
    def id(self) -> str: ...


def next_cursor(page: Sequence[Listed], limit: int) -> str | None:
    """The `next` of a page: the cursor of its last row when it is full, else None."""
    if len(page) < limit or not page:
        return None
    return page_cursor(page[-1].created_at, page[-1].id)


def read_after(text: str | None) -> tuple[float, str] | None:
    """The `(created_at, id)` of a listing's `after` (None when not given)."""
    return read_cursor(text) if text is not None else None


def page_cursor(created_at: float, row_id: str) -> str:
    """The cursor of the row created at `created_at` with id `row_id`."""
    raw = json.dumps([created_at, row_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def read_cursor(text: str) -> tuple[float, str]:
    """The `(created_at, id)` a cursor names; a validation error of the query's `after`
    (422) for anything else."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        created_at, row_id = json.loads(raw)
    except (binascii.Error, ValueError, TypeError):
        raise _invalid(text) from None
    if isinstance(created_at, bool) or not isinstance(created_at, int | float):
        raise _invalid(text)
    try:
        at = float(created_at)
    except OverflowError:
        raise _invalid(text) from None
    if not math.isfinite(at) or not isinstance(row_id, str):
        raise _invalid(text)
    return at, row_id


def _invalid(text: str) -> RequestValidationError:
    error = {
        "type": "value_error",
        "loc": ("query", "after"),
        "msg": _BAD,
        "input": text,
        "ctx": {"error": _BAD},
    }
    return RequestValidationError([error])
