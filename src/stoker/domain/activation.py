"""The fleet activation key and the per-worker activation secrets derived from it.

A worker accepts `/activate` only when it is signed with its activation secret
(`docs/worker-protocol.md`, "The activation secret"). The secret is
HMAC-SHA256(fleet key, worker id), hex-encoded: nothing per worker is stored, every
replica sharing the key derives the same secret, and a secret opens one worker only.
"""

from __future__ import annotations

import hmac

#: Shortest fleet key accepted, in bytes (`openssl rand -hex 32` gives 64).
MIN_KEY_BYTES = 32


class ActivationKey:
    """The fleet's activation key; derives each worker's secret, and never shows itself."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"an activation key needs at least {MIN_KEY_BYTES} bytes")
        self._key = key

    def worker_secret(self, worker_id: str) -> str:
        """The activation secret of `worker_id`: HMAC-SHA256(key, worker id) in hex."""
        return hmac.digest(self._key, worker_id.encode(), "sha256").hex()

    def __repr__(self) -> str:
        return "ActivationKey(<hidden>)"
