"""Background futures whose failure is left to the caller's own path."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


def retrieve(fut: asyncio.Future) -> None:
    """Done callback that marks fut's exception seen: asyncio would otherwise log "exception
    was never retrieved" for a failure that another path (a retry, the call's own status)
    already reports or that does not matter."""
    if not fut.cancelled():
        fut.exception()


def spawn(coro: Coroutine, tasks: set) -> asyncio.Task:
    """Runs coro as a task held in `tasks` until it ends: the event loop keeps only a weak
    reference to a task, so one nobody holds can vanish mid-run."""
    task = asyncio.ensure_future(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
