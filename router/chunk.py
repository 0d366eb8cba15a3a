"""What the router streams for one request: tokens from one worker message, in the public
request's terms."""

from __future__ import annotations

from dataclasses import dataclass, field

from megaserve.finish import FinishReason


@dataclass
class Chunk:
    """Tokens from one worker message, in the public request's terms."""

    token_ids: list[int]
    finish_reason: FinishReason | None
    cached_tokens: int = 0  # set on the request's first chunk
    worker_id: str = ""
    logprobs: list = field(default_factory=list)  # decode_pb2.TokenLogprobs each
    prompt_logprobs: list = field(default_factory=list)  # the same, on the first chunk
