"""Structured logs: one `key=value` line per event, one event per worker state change."""

from __future__ import annotations

import logging
import re
from typing import Any

from stoker.domain.records import Worker

logger = logging.getLogger("stoker")

DEBUG, INFO, WARNING, ERROR = logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR


_NEEDS_QUOTES = re.compile(r'[ ="]')


def _fmt(value: Any) -> str:
    text = value if type(value) is str else str(value)
    if not text or _NEEDS_QUOTES.search(text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def event(name: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """Log `event=<name>` with the fields as key=value pairs (None values left out)."""
    if not logger.isEnabledFor(level):
        return
    parts = [f"event={name}"]
    parts += [f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None]
    # The fields travel with the record too, typed, for the JSON format.
    logger.log(level, " ".join(parts), extra={"stoker_event": name, "stoker_fields": fields})


def worker_event(name: str, worker: Worker, **fields: Any) -> None:
    """Log an event about one worker with its id, pool, org, epoch and state."""
    event(
        name,
        worker=worker.id,
        pool=worker.pool,
        org=worker.org,
        epoch=worker.epoch,
        state=worker.state.value,
        **fields,
    )
