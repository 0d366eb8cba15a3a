"""Shape buckets: every device call is padded up to one, so compiled programs stay bounded."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512)
MIN_PAGE_WIDTH = 8


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
    # Rows one prefill call takes (the decode tier prefills one sequence at a time; the
    # prefill tier batches prompts): None = the batch buckets.
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
