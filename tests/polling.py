"""Waiting in tests for a condition to hold: a generous deadline, never a timing claim."""

from __future__ import annotations

import asyncio
import time


def until(pred, what: str, timeout: float = 60.0, interval: float = 0.05):
    """pred()'s first truthy value; AssertionError naming `what` once `timeout` s passed."""
    end = time.monotonic() + timeout
    while not (got := pred()):
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(interval)
    return got


async def until_async(pred, what: str, timeout: float = 60.0, interval: float = 0.01):
    """until() on the event loop: other tasks run while it waits."""
    end = time.monotonic() + timeout
    while not (got := pred()):
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        await asyncio.sleep(interval)
    return got
