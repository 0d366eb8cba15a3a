"""Background futures whose failure is left to the caller's own path."""

from __future__ import annotations

import asyncio


def retrieve(fut: asyncio.Future) -> None:
    """Done callback that marks fut's exception seen: asyncio would otherwise log "exception
    was never retrieved" for a failure that another path (a retry, the call's own status)
    already reports or that does not matter."""
    if not fut.cancelled():
        fut.exception()
