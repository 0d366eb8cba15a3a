"""One request's state inside a decode worker."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from megaserve.finish import FinishReason
from megaserve.kv.block_hash import GrowingHashes
from megaserve.kv.pages import pages_for_tokens
from megaserve.sampling_params import SamplingParams


class SeqState(enum.Enum):
    WAITING = "waiting"  # queued; owns no pages
    PREFILL = "prefill"  # admitted; prompt KV being computed chunk by chunk
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@dataclass
class Sequence:
    """Tokens, pages and stopping state of one request."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pages
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    num_registered: int = 0  # full pages already published to the prefix cache
    state: SeqState = SeqState.WAITING
    finish_reason: FinishReason | None = None
    arrival_step: int = 0
    logprobs: int = 0  # top-n log-probabilities to return per token (0 = none)
    resumed: int = 0  # trailing prompt tokens generated before a migration (output for penalties)
    hashes: GrowingHashes | None = None  # block hashes of tokens, made on first use

    def block_hashes(self, n_blocks: int, page_size: int) -> list[int]:
        """Hashes of the first n_blocks full blocks of tokens (prefix-cache keys)."""
        if self.hashes is None:
            self.hashes = GrowingHashes(page_size)
        if len(self.hashes.hashes) >= n_blocks:  # no tokens list built on the hot path
            return self.hashes.hashes[:n_blocks]
        return self.hashes.first(self.tokens, n_blocks)

    @property
    def tokens(self) -> list[int]:
        """Prompt plus output: what the KV must cover (the last token's KV comes next step)."""
        return self.prompt + self.output

    def penalty_split(self) -> tuple[list[int], list[int]]:
        """(prompt, output) as penalties see them: resumed tokens count as output."""
        cut = len(self.prompt) - self.resumed
        return self.prompt[:cut], self.prompt[cut:] + self.output

    @property
    def is_prefill(self) -> bool:
        return self.state == SeqState.PREFILL

    def pages_needed(self, num_tokens: int, page_size: int) -> int:
        return pages_for_tokens(num_tokens, page_size) - len(self.pages)
