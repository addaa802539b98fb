"""Identifiers and secrets minted by the control plane (seedable for deterministic runs)."""

from __future__ import annotations

import random
import secrets


class Ids:
    """Mints worker, claim and instance ids and claim tokens.

    With a `seed` the sequence is reproducible (the simulator's byte-identical summaries);
    without one, ids and tokens come from `secrets`.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed) if seed is not None else None

    def _hex(self, nbytes: int) -> str:
        if self._rng is None:
            return secrets.token_hex(nbytes)
        return self._rng.getrandbits(nbytes * 8).to_bytes(nbytes, "big").hex()

    def worker(self) -> str:
        """A new worker id."""
        return "w-" + self._hex(6)

    def claim(self) -> str:
        """A new claim id."""
        return "c-" + self._hex(8)

    def rollout(self) -> str:
        """A new rollout id."""
        return "ro-" + self._hex(6)

    def instance(self) -> str:
        """A new control-plane instance id (one per start)."""
        return "cp-" + self._hex(6)

    def token(self) -> str:
        """A fresh session credential for one claim."""
        if self._rng is None:
            return secrets.token_urlsafe(24)
        return self._hex(18)
