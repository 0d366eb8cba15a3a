"""What the decode engine hands back per step: token events, with optional log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megaserve.finish import FinishReason

# Per token: (token, logprob, top ids, top logprobs).
TokenLogprobs = tuple[int, float, list[int], list[float]]


@dataclass(frozen=True)
class TokenEvent:
    """Tokens a request produced in one step; `finish_reason` set on its last event."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    step: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # when the request asked for them
    error: str = ""  # with FinishReason.ERROR: what failed, for the INTERNAL status message
    # On the first event of a request that asked: prompt tokens 1.. given the tokens before.
    prompt_logprobs: list[TokenLogprobs] | None = None


def top_logprobs(logits: np.ndarray, token: int, n: int) -> TokenLogprobs:
    """(token, logprob, top-n ids, top-n logprobs) of raw f32[V] logits, natural log."""
    x = logits.astype(np.float64)
    lse = x.max() + np.log(np.exp(x - x.max()).sum())
    lp = x - lse
    top = np.argsort(-lp, kind="stable")[:n]
    return int(token), float(lp[token]), top.tolist(), lp[top].tolist()
