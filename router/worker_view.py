"""One worker as a router sees it: its advertised record, the blocks it holds or is about
to, and this router's own load on it."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from megaserve.kv.block_hash import block_hashes
from megaserve.state_keys import WorkerInfo, block_hex

# Blocks a router predicts a worker now holds (it just sent a prompt there) are trusted this
# long before the worker's own published set must confirm them. Routers share them through
# Redis, timed by Redis's clock (a placement stream entry's id), so router clocks do not
# matter.
OPTIMISTIC_S = 5.0


def text(v: bytes | str) -> str:
    """A Redis reply's value as text (redis-py returns bytes unless decode_responses)."""
    return v.decode() if isinstance(v, bytes) else v


class _PrefixHexes:
    """Hex block hashes of recent prompts: placing one request asks for the same prompt's
    several times (each policy, each worker, the dispatcher), and a long prompt's hashes
    cost milliseconds. Keyed by the list object (held, so its id stays unique); placement
    never mutates a prompt list. One attempt's lookups come without an await between them,
    so a few entries do (and few long prompts are held)."""

    def __init__(self, size: int = 8):
        self.size = size
        self._by_id: OrderedDict[tuple[int, int], tuple[list[int], int, list[str]]] = OrderedDict()

    def get(self, prompt: list[int], page_size: int) -> list[str]:
        key = (id(prompt), page_size)
        hit = self._by_id.get(key)
        if hit is not None and hit[0] is prompt and hit[1] == len(prompt):
            return hit[2]
        # The decode tier matches prompt[:-1] (the last token's KV comes from the first step).
        hexes = [block_hex(h) for h in block_hashes(prompt[: len(prompt) - 1], page_size)]
        self._by_id[key] = (prompt, len(prompt), hexes)
        if len(self._by_id) > self.size:
            self._by_id.popitem(last=False)
        return hexes


_prefix_hexes = _PrefixHexes()


@dataclass
class WorkerView:
    """One worker as the router sees it: its advertised record plus this router's own load."""

    info: WorkerInfo
    blocks: frozenset[str] = frozenset()  # hex block hashes the worker published
    blocks_version: str | None = None  # the worker hash's BLOCKS_VERSION `blocks` was read at
    placed_seen: str | None = None  # the last placed_blocks_key entry read (its stream id)
    optimistic: dict[str, float] = field(default_factory=dict)  # hex -> expiry (monotonic)
    inflight: int = 0  # requests this router has running there
    inflight_pages: int = 0  # pages those requests hold (prompt + max output)

    @property
    def id(self) -> str:
        return self.info.worker_id

    @property
    def address(self) -> str:
        return self.info.address

    @property
    def load(self) -> int:
        """Requests running or queued; our own count covers the heartbeat's staleness."""
        return max(self.info.running + self.info.waiting, self.inflight)

    @property
    def active_pages(self) -> int:
        used = self.info.total_pages - self.info.free_pages
        return max(used, self.inflight_pages)

    @property
    def kv_usage(self) -> float:
        return self.active_pages / max(self.info.total_pages, 1)

    @property
    def cached_blocks(self) -> int:
        """Blocks the worker holds or is about to (the size of its prefix tree)."""
        return len(self.blocks) + len(self.optimistic)

    def has_block(self, h: str, now: float) -> bool:
        return h in self.blocks or self.optimistic.get(h, 0.0) > now

    def cached_prefix_blocks(self, prompt: list[int]) -> int:
        """How many leading full blocks of prompt this worker holds (what it will not prefill).

        The decode tier matches prompt[:-1] (the last token's KV comes from the first step).
        """
        n, now = 0, time.monotonic()
        for h in _prefix_hexes.get(prompt, self.info.page_size):
            if not self.has_block(h, now):
                break
            n += 1
        return n

    def expect_blocks(self, prompt: list[int]) -> list[str]:
        """Records that this worker is about to cache prompt's full blocks; returns those to
        share: not in its published set, and not expected (here or by a router that shared
        them) for at least half of OPTIMISTIC_S more. A request's finish re-expects its
        prompt's blocks: without the second rule every request wrote them to Redis twice."""
        now = time.monotonic()
        until, fresh = now + OPTIMISTIC_S, now + OPTIMISTIC_S / 2
        new = [h for h in _prefix_hexes.get(prompt, self.info.page_size) if h not in self.blocks]
        share = [h for h in new if self.optimistic.get(h, 0.0) < fresh]
        for h in new:
            self.optimistic[h] = until
        return share

    def merge_placed(self, entries: list, now: float, now_ms: float) -> None:
        """Adds the blocks of placements routers shared (placed_blocks_key's entries after
        `placed_seen`, read when Redis's clock said now_ms) that the worker's own set does
        not confirm yet, for what is left of OPTIMISTIC_S from each entry's id."""
        for eid, fields in entries:
            eid = text(eid)
            self.placed_seen = eid
            until = now + (int(eid.partition("-")[0]) + OPTIMISTIC_S * 1000 - now_ms) / 1000
            if until <= now:
                continue
            for h in text(fields.get(b"b", fields.get("b", b""))).split(","):
                if h and h not in self.blocks and until > self.optimistic.get(h, 0.0):
                    self.optimistic[h] = until
