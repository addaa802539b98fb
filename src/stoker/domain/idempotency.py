"""Idempotent claims: what the store keeps of a client's `Idempotency-Key`.

A claim sent with a key is stored with the key's digest (unique per org), the digest of
the request, and its session token sealed with the key. A retry that carries the key on
any replica finds the claim by the digest and unseals the token with the key; reading the
store yields neither the key nor the token. Keys should be random (the SDK sends a UUID4):
the seal is only as strong as the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from stoker.domain.records import ClaimRequest

#: Longest key accepted (the header's value).
KEY_MAX = 255
_SEAL_PREFIX = "v1:"


def check_key(key: str) -> str | None:
    """What is wrong with `key` as an `Idempotency-Key`, or None when it is fine."""
    if not key:
        return "Idempotency-Key must not be empty"
    if len(key) > KEY_MAX:
        return f"Idempotency-Key must be at most {KEY_MAX} characters"
    if not key.isascii() or not key.isprintable():
        return "Idempotency-Key must be printable ASCII"
    return None


def key_digest(key: str) -> str:
    """What the store keeps of a key (looked up with the claim's org)."""
    return "sha256:" + hashlib.sha256(b"stoker-idempotency-key\0" + key.encode()).hexdigest()


def request_digest(req: ClaimRequest) -> str:
    """The digest of what a claim asks for. The wait (`timeout_s`) is left out: a retry
    may wait less, and still asks for the same claim."""
    what: dict[str, Any] = {
        "pool": req.pool,
        "org": req.org,
        "mode": req.mode.value,
        "lease_s": req.lease_s,
        "ttl_s": req.ttl_s,
        "config": req.config,
    }
    text = json.dumps(what, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _keystream(key: str, claim_id: str, size: int) -> bytes:
    stream = b""
    block = 0
    while len(stream) < size:
        message = f"stoker-claim-token\0{claim_id}\0{block}".encode()
        stream += hmac.digest(key.encode(), message, "sha256")
        block += 1
    return stream[:size]


def seal(token: str, key: str, claim_id: str) -> str:
    """`token` sealed with `key` for claim `claim_id` ("" stays "")."""
    if not token:
        return ""
    data = token.encode()
    sealed = bytes(a ^ b for a, b in zip(data, _keystream(key, claim_id, len(data)), strict=True))
    return _SEAL_PREFIX + sealed.hex()


def unseal(sealed: str, key: str, claim_id: str) -> str:
    """The token `seal` sealed (a key other than the sealing one yields garbage, which the
    caller never gets: it finds the claim by the key's digest first)."""
    if not sealed.startswith(_SEAL_PREFIX):
        return ""
    data = bytes.fromhex(sealed[len(_SEAL_PREFIX) :])
    plain = bytes(a ^ b for a, b in zip(data, _keystream(key, claim_id, len(data)), strict=True))
    return plain.decode(errors="replace")
