"""Error types shared by every tier; each message names the offending value."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as-is: missing, truncated, corrupt or unsupported."""


class RequestError(ValueError):
    """A caller's request that cannot be served (bad ids, too long, bad sampling values)."""


class DuplicateRequest(RequestError):
    """A request id that is already reserved or running here (ALREADY_EXISTS)."""


class NoCapacity(Exception):
    """No room for this work right now: KV pages, queue slots or batch rows are all taken.

    The one capacity error of every tier (RESOURCE_EXHAUSTED on the wire): the caller may
    retry later or elsewhere. `source` names what was full, for the router's own bookkeeping
    (it carries the worker whose answer said so).
    """

    def __init__(self, message: str, source: object = None):
        super().__init__(message)
        self.source = source


def check_prompt_ids(prompt: list[int], vocab_size: int, what: str = "prompt_token_ids") -> None:
    """RequestError unless prompt is a non-empty list of ids in [0, vocab_size)."""
    if not prompt:
        raise RequestError(f"{what} is empty")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )


class BackendError(ValueError):
    """The requested backend cannot run this model config (the message says why)."""


class ReservationGone(Exception):
    """KV arrived for a reservation that expired or was dropped meanwhile (the decode worker
    was too slow to take it, or released it): the request is fine, retry the hand-off."""


class MeshError(ValueError):
    """A device mesh this model or this process cannot take (--tp/--ep): the message names the
    numbers that do not fit."""
