"""PostgreSQL advisory locks: transaction-scoped, and never held by an idle transaction for
long.

The statement that takes a lock also bounds how long its transaction may sit idle
(`idle_in_transaction_session_timeout`, transaction-local): a replica stopped while holding
a pool's lock (SIGSTOP, a frozen VM) would otherwise block every other replica's spawns in
that pool until it ran again; PostgreSQL ends its transaction instead.
"""

from __future__ import annotations

import hashlib

#: Takes a transaction-scoped advisory lock, and ends the transaction should it then sit
#: idle for the given milliseconds (set per transaction: a pooler forwards no options).
LOCK = (
    "SELECT set_config('idle_in_transaction_session_timeout', %s, true), pg_advisory_xact_lock(%s)"
)


def lock_key(*parts: str) -> int:
    """A signed 64-bit advisory lock key for `parts`, the same in every process."""
    digest = hashlib.blake2b("\x00".join(("stoker", *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
