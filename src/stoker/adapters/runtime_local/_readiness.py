"""Readiness of a local worker: its `/healthz` answers 200.

A local process has no kubelet to tell when it listens: the runtime probes it, on one
aiohttp session shared by every probe.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp

from stoker.ports.clock import Clock

#: One readiness probe may take this long before it counts as "not ready yet".
PROBE_TIMEOUT_S = 1.0


def probe_client() -> aiohttp.ClientSession:
    """The session for readiness probes (opened inside the running loop)."""
    return aiohttp.ClientSession(
        # Each worker is its own origin; keep its connection alive, with no cap.
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30),
        timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
        # Workers listen on this machine: a proxy from the environment must not apply.
        trust_env=False,
    )


async def probe_until_ready(
    client: aiohttp.ClientSession,
    clock: Clock,
    endpoint: str,
    *,
    timeout_s: float,
    poll_s: float,
    gone: Callable[[], bool],
) -> bool | None:
    """Probe `{endpoint}/healthz` every `poll_s` until it answers 200.

    True once it does, False when `timeout_s` passes first, None when `gone()` turns true
    (the process exited) before either.
    """
    url = f"{endpoint}/healthz"
    deadline = clock.monotonic() + timeout_s
    while not gone():
        remaining = deadline - clock.monotonic()
        if await _probe(client, url, min(PROBE_TIMEOUT_S, max(remaining, poll_s))):
            return True
        if clock.monotonic() >= deadline:
            return False
        await clock.sleep(min(poll_s, max(0.0, remaining)))
    return None


async def _probe(client: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """True when `url` answers 200 within `timeout_s`."""
    try:
        async with client.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            await response.read()
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        # Not listening yet, or too slow to answer: try again on the next tick.
        return False
