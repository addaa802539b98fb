"""The API's conventions for what it is sent and what it answers (README, "Errors").

JSON bodies only (415 otherwise), no key named twice (400), validation errors in stoker's
own words, a 429 whose `Retry-After` follows from what the org holds, and one log line
for each claim refused (429/503) or abandoned by its client. Same harness as test_api:
the real app and SQLite store, `MemoryRuntime` workers, virtual time (looptime).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
from test_api import assert_problem, pool, running

pytestmark = pytest.mark.looptime

# -- the 429's Retry-After ------------------------------------------------------------------


async def test_retry_after_is_when_the_org_s_lease_runs_out(tmp_path: Path) -> None:
    async with running(tmp_path, [pool(max_workers_per_org=1)]) as api:
        assert (await api.claim(lease_s=20)).status_code == 201
        await asyncio.sleep(4)
        capped = await api.claim(timeout_s=1)
        body = assert_problem(capped, 429)
        # The lease ends 20 s after the claim; 5 s of it have gone by.
        assert 14 <= body["retry_after"] <= 15.5, body
        assert capped.headers["retry-after"] == str(math.ceil(body["retry_after"]))


async def test_retry_after_is_when_the_org_s_idle_worker_expires(tmp_path: Path) -> None:
    async with running(
        tmp_path, [pool(max_workers_per_org=1, reuse="same_org", hot_idle_ttl=30)]
    ) as api:
        claim = (await api.claim()).json()
        assert (await api.http.delete(f"/v1/claims/{claim['id']}")).status_code == 200
        await asyncio.sleep(10)
        # A cold claim does not reuse the parked worker, which still counts against the cap.
        capped = await api.claim(mode="cold", timeout_s=1)
        body = assert_problem(capped, 429)
        assert 18 <= body["retry_after"] <= 20, body


async def test_retry_after_is_bounded_by_the_configured_longest(tmp_path: Path) -> None:
    async with running(
        tmp_path, [pool(max_workers_per_org=1)], intervals={"org_cap_retry_after_s": 10}
    ) as api:
        assert (await api.claim(lease_s=3600)).status_code == 201
        capped = await api.claim(timeout_s=1)
        assert assert_problem(capped, 429)["retry_after"] == 10
        assert capped.headers["retry-after"] == "10"
