"""Shape buckets: every device call is padded up to one, so compiled programs stay bounded."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512)
MIN_PAGE_WIDTH = 8
# A prefill call's fixed cost in tokens of work: SmolLM2 f32 on 2 CPU cores fits
# ms ~= 39 + 1.22 x padded tokens per call (one call of 64 tokens 117 ms, of 512 663 ms; 256 +
# 64 in two calls 481 ms: `megaserve bench prefill --lengths 64,300 --chunk 512|256`).
SPLIT_COST_TOKENS = 32


def buckets_up_to(limit: int, candidates: tuple[int, ...]) -> tuple[int, ...]:
    """The candidates below `limit`, then `limit` itself (the largest bucket is the limit)."""
    return tuple(b for b in candidates if b < limit) + (limit,)


@dataclass(frozen=True)
class StepConfig:
    """The buckets one runner pads to."""

    batch_buckets: tuple[int, ...] = BATCH_BUCKETS
    token_buckets: tuple[int, ...] = TOKEN_BUCKETS
    # Page-table widths are powers of two up to the pages one sequence may hold.
    max_pages_per_seq: int = 512
    steps_per_call: int = 1
    # Rows one prefill call takes at most (both tiers batch prompt pieces under the token
    # budget, `prefill_pieces`): None = the batch buckets.
    prefill_rows: int | None = None

    def __post_init__(self):
        if self.steps_per_call < 1:
            raise ValueError(f"steps_per_call={self.steps_per_call} must be >= 1")

    @classmethod
    def for_limits(
        cls,
        max_batch: int,
        max_chunk: int,
        max_pages_per_seq: int,
        steps_per_call: int = 1,
        prefill_rows: int | None = None,
    ) -> StepConfig:
        """Buckets for an engine that runs at most max_batch rows and max_chunk new tokens."""
        return cls(
            batch_buckets=buckets_up_to(max_batch, BATCH_BUCKETS),
            token_buckets=buckets_up_to(max_chunk, TOKEN_BUCKETS),
            max_pages_per_seq=max_pages_per_seq,
            steps_per_call=steps_per_call,
            prefill_rows=prefill_rows,
        )

    @property
    def prefill_batch_buckets(self) -> tuple[int, ...]:
        if self.prefill_rows is None:
            return self.batch_buckets
        return buckets_up_to(self.prefill_rows, BATCH_BUCKETS)

    @property
    def prefill_budget(self) -> int:
        """Padded tokens (rows bucket x token bucket) one prefill call may take: the largest
        token bucket, the cost of one full-width row."""
        return self.token_buckets[-1]

    def prefill_cap(self, rows: int) -> int:
        """Tokens each row takes when `rows` sequences share one prefill call: the largest
        token bucket T with bucket(rows) x T within the budget; 0 when none is."""
        if rows > self.prefill_batch_buckets[-1]:
            return 0
        b = bucket(rows, self.prefill_batch_buckets, "prefill rows")
        return max((t for t in self.token_buckets if b * t <= self.prefill_budget), default=0)

    def prefill_in_budget(self, rows: int, tokens: int) -> bool:
        """Whether a (rows, tokens) prefill program is a shape `prefill_pieces` can ask for."""
        return rows * tokens <= self.prefill_budget

    def prefill_pieces(self, needs: list[int]) -> list[int]:
        """Tokens each candidate computes in one prefill call, given each one's remaining
        prompt tokens in admission order (oldest first); 0 = not in this call.

        The oldest always runs (no prompt starves). A later one joins when its whole
        remaining prompt fits the per-row cap of the call with it added, every row already
        in still fitting too: it finishes in this call, so a short prompt gets its first
        token beside a long one instead of behind it. Every row then takes min(its need,
        cap), and the oldest's piece is cut to a bucket boundary where that pads less
        (`_split_padded`). A prompt too long to finish in one shared piece waits for the
        ones before it (first come, first served): long prompts prefill one at a time at
        the full budget, the shape that reads their context least often per token. Rows are
        padded to the longest piece (the programs take a [rows, tokens] batch), so the cap
        keeps the padded call within the budget, and the real tokens with it.
        """
        rows = [0] if needs else []
        for i in range(1, len(needs)):
            cap = self.prefill_cap(len(rows) + 1)
            if cap == 0:
                break  # the cap only shrinks with more rows
            if max(needs[j] for j in [*rows[1:], i]) <= cap:
                rows.append(i)
        cap = self.prefill_cap(len(rows)) if rows else 0
        out = [0] * len(needs)
        for j in rows:
            out[j] = min(needs[j], cap)
        return self._split_padded(out)

    def _split_padded(self, out: list[int]) -> list[int]:
        """Cuts the oldest row's piece down to the token bucket below the call's when the
        rest in a later call pads less than the one call would (e.g. 300 tokens: 256 + 64
        instead of 512), counting a call's fixed cost as SPLIT_COST_TOKENS; the other rows
        must still finish in the narrower call."""
        if not out or not out[0]:
            return out
        width = bucket(max(out), self.token_buckets, "prefill tokens")
        lower = [t for t in self.token_buckets if t < width]
        if not lower or out[0] <= lower[-1] or max(out[1:], default=0) > lower[-1]:
            return out
        rest = bucket(out[0] - lower[-1], self.token_buckets, "prefill tokens")
        if lower[-1] + rest + SPLIT_COST_TOKENS < width:
            return [lower[-1], *out[1:]]
        return out

    @property
    def page_buckets(self) -> tuple[int, ...]:
        """Powers of two from MIN_PAGE_WIDTH up to max_pages_per_seq (itself the last): below
        that width a narrower table saves too little to be worth one more program per batch."""
        out, p = [], min(MIN_PAGE_WIDTH, self.max_pages_per_seq)
        while p < self.max_pages_per_seq:
            out.append(p)
            p *= 2
        out.append(self.max_pages_per_seq)
        return tuple(out)


def bucket(n: int, buckets: tuple[int, ...], what: str) -> int:
    """Smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
