"""The change feed of the workers table: LISTEN/NOTIFY.

A trigger (schema version 10, `schema.feed_statements`) announces, on one channel per
schema, every worker row that enters `warm`, as the row itself (a
JSON array in `WORKER_COLUMNS` order); the notification is sent when the writing
transaction commits, so it costs the writer no round trip. A replica follows the channel
on a connection of its own, outside the pool: it reconnects after any failure (with a
capped back-off) and, each time it is listening again, first reads the claimable rows
from the store (what it may have missed while it was not listening), then hands on every
notification.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

import psycopg

from stoker.adapters._logs import EventLog
from stoker.adapters._rows import worker_from_row
from stoker.domain.records import Worker

_log = EventLog("stoker.store")

#: Back-off between reconnections: doubled after each failure, up to the cap.
_RETRY_S, _RETRY_MAX_S = 0.2, 5.0


async def follow(
    url: str,
    channel: str,
    on_worker: Callable[[Worker], None],
    on_listening: Callable[[], Awaitable[None]],
    on_lost: Callable[[], None],
) -> None:
    """Hand every announced worker row to `on_worker` until cancelled; after each
    (re)connection, await `on_listening` first (a resync from the store); call `on_lost`
    when the connection failed."""
    delay = _RETRY_S
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(
                url, autocommit=True, connect_timeout=10
            ) as conn:
                await conn.execute(f'LISTEN "{channel}"')
                await on_listening()
                _log("store_feed_listening", channel=channel)
                delay = _RETRY_S
                async for note in conn.notifies():
                    on_worker(worker_from_row(json.loads(note.payload)))
        except (psycopg.Error, OSError, ValueError) as exc:
            _log("store_feed_lost", channel=channel, error=str(exc), level=logging.WARNING)
        on_lost()
        await asyncio.sleep(delay)
        delay = min(_RETRY_MAX_S, delay * 2)
