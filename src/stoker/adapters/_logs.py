"""One `key=value` log line per event, as the rest of stoker logs (shared by the adapters)."""

from __future__ import annotations

import logging
from typing import Any


class EventLog:
    """Logs events to the logger `name`: `log("worker_ready", worker=..., pool=...)`."""

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)

    def __call__(self, event: str, *, level: int = logging.INFO, **fields: Any) -> None:
        """Log `event=<event>` with the fields as key=value pairs (None values left out)."""
        if self.logger.isEnabledFor(level):
            # The fields travel with the record too, typed, for the JSON format.
            extra = {"stoker_event": event, "stoker_fields": fields}
            self.logger.log(level, kv_line(event, fields), extra=extra)


def kv_line(event: str, fields: dict[str, Any]) -> str:
    """`event=<event> key=value ...` (None values left out), as every stoker line reads."""
    parts = [f"event={event}"]
    parts += [f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None]
    return " ".join(parts)


def _fmt(value: Any) -> str:
    """A value as it appears after `key=`: quoted when empty or holding a space, `=` or `"`."""
    text = str(value)
    if not text or any(c in text for c in ' ="'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text
