"""Shared test plumbing. Fixtures specific to one subsystem live in that subsystem's file."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Generator
from typing import Any

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, Any, Any]:
    """Give a sync test an event loop of its own and close it afterwards.

    looptime (0.9) asks the policy for the current loop around every test; for a sync test
    that would create a loop nobody closes, whose socket pair surfaces later as a
    ResourceWarning (an error under `filterwarnings = error`) in an unrelated test.
    """
    # pytest-asyncio wraps coroutine tests and marks them; leave their loops to it.
    if pyfuncitem.get_closest_marker("asyncio") or inspect.iscoroutinefunction(pyfuncitem.obj):
        return (yield)
    policy = asyncio.get_event_loop_policy()
    loop = policy.new_event_loop()
    policy.set_event_loop(loop)
    try:
        return (yield)
    finally:
        policy.set_event_loop(None)
        loop.close()
