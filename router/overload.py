"""Every worker that could take a request was full: the RESOURCE_EXHAUSTED the client gets,
with the `retry-after-ms` hint a worker gave."""

from __future__ import annotations

import grpc

from megaserve.status import retry_after_ms_of
from router.frontend import RouterError


class Overloaded(RouterError):
    """Every worker that could take the request was full: RESOURCE_EXHAUSTED, with the
    `retry-after-ms` hint the client gets."""

    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_ms = retry_after_ms


def retry_after_of(e: BaseException, default: int) -> int:
    """The `retry-after-ms` hint of the worker error behind e (its cause chain), or default."""
    while e is not None:
        err = getattr(e, "error", e)  # HandoffFailed carries the call's error
        if isinstance(err, grpc.RpcError):
            hint = retry_after_ms_of(err)
            if hint is not None:
                return hint
        e = e.__cause__
    return default
