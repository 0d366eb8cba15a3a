"""Prefill compute: chunked prompt prefill over this worker's own paged pool + prefix cache."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from decode_service.page_allocator import OutOfPages, PageAllocator
from kernels.kv_cache import KVPool
from kernels.xla_step import SamplingArrays, StepConfig, XlaRunner
from megaserve.block_hash import block_hashes
from megaserve.errors import RequestError
from megaserve.model import LoadedModel
from megaserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class PrefillConfig:
    page_size: int = 16
    kv_budget_bytes: int = 256 * 2**20
    max_context: int = 4096
    chunk: int = 256  # tokens per prefill program; pages are sent after each chunk


class PoolFull(Exception):
    """No pages for this prompt right now (RESOURCE_EXHAUSTED; retry or prefill elsewhere)."""


@dataclass
class PrefillResult:
    first_token: int
    prefix_hit_pages: int
    compute_s: float


class PrefillEngine:
    """One prompt at a time on one device; pages are kept (LRU) as this worker's prefix cache."""

    def __init__(self, model: LoadedModel, cfg: PrefillConfig = PrefillConfig()):
        self.model, self.cfg = model, cfg
        mc = model.cfg
        probe = KVPool.create(mc.num_layers, 2, cfg.page_size, mc.num_kv_heads, mc.head_dim)
        n = KVPool.pages_for_budget(cfg.kv_budget_bytes, probe.bytes_per_page)
        self.pool = KVPool.create(
            mc.num_layers,
            n,
            cfg.page_size,
            mc.num_kv_heads,
            mc.head_dim,
            model.params["embed"].dtype,
        )
        self.alloc = PageAllocator(n, cfg.page_size)
        self.max_pages = math.ceil(cfg.max_context / cfg.page_size)
        buckets = tuple(b for b in (16, 32, 64, 128, 256, 512) if b < cfg.chunk) + (cfg.chunk,)
        self.runner = XlaRunner(
            model.family,
            mc,
            model.params,
            self.pool,
            StepConfig(batch_buckets=(1,), token_buckets=buckets, max_pages_per_seq=self.max_pages),
        )
        self._lock = threading.Lock()

    def validate(self, prompt: list[int]) -> None:
        vocab = self.model.cfg.vocab_size
        if not prompt:
            raise RequestError("prompt_token_ids is empty")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        if len(prompt) > self.cfg.max_context:
            raise RequestError(f"prompt ({len(prompt)} tokens) exceeds {self.cfg.max_context}")

    def prefill(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        skip_pages: int,
        on_pages: Callable[[int, np.ndarray, np.ndarray], None],
    ) -> PrefillResult:
        """Computes the prompt; after each chunk calls on_pages(first_index, K, V) with the
        pages (all layers) completed by it, skipping the first `skip_pages` pages.

        K/V are device arrays [L, n, page_size, Hkv, D]; indices count this prompt's pages.
        """
        import time

        self.validate(prompt)
        ps = self.cfg.page_size
        n_pages = -(-len(prompt) // ps)
        if not 0 <= skip_pages <= n_pages:
            raise RequestError(f"cached_pages={skip_pages} outside [0, {n_pages}]")
        with self._lock:
            hashes = block_hashes(prompt[: len(prompt) - 1], ps)
            hit = self.alloc.match_prefix(hashes)
            self.alloc.acquire(hit)
            try:
                pages = hit + self.alloc.allocate(n_pages - len(hit))
            except OutOfPages as e:
                self.alloc.release(hit)
                raise PoolFull(f"prefill pool: {e}; retry") from e
            try:
                t0 = time.perf_counter()
                table = np.asarray([pages], np.int32)
                rows = SamplingArrays.build(
                    [sampling.as_row()], [(prompt, [])], self.model.cfg.vocab_size
                )
                sent = skip_pages
                # Pages this worker already holds need no compute but may still need sending.
                done = len(hit) * ps
                if done // ps > sent:
                    self._send(pages, sent, done // ps, on_pages)
                    sent = done // ps
                nxt = None
                for start in range(done, len(prompt), self.cfg.chunk):
                    chunk = np.asarray(prompt[start : start + self.cfg.chunk], np.int32)
                    pos = np.arange(start, start + len(chunk), dtype=np.int32)
                    nxt, _ = self.runner.prefill(chunk[None], pos[None], table, rows)
                    end = start + len(chunk)
                    complete = n_pages if end == len(prompt) else end // ps
                    if complete > sent:
                        self._send(pages, sent, complete, on_pages)
                        sent = complete
                if nxt is None:  # the whole prompt was cached: recompute its last token
                    last = len(prompt) - 1
                    nxt, _ = self.runner.prefill(
                        np.asarray([[prompt[last]]], np.int32),
                        np.asarray([[last]], np.int32),
                        table,
                        rows,
                    )
                if sent < n_pages:
                    self._send(pages, sent, n_pages, on_pages)
                compute = time.perf_counter() - t0
                full_hashes = block_hashes(prompt, ps)
                for i in range(len(hit), len(full_hashes)):
                    self.alloc.register(pages[i], full_hashes[i])
                return PrefillResult(int(nxt[0]), len(hit), compute)
            finally:
                self.alloc.release(pages)

    def _send(self, pages, lo, hi, on_pages) -> None:
        # Device arrays (fresh buffers, safe from later donation of the pool): the gRPC path
        # copies them to host, the jax transfer path offers them as they are.
        idx = np.asarray(pages[lo:hi], np.int32)
        on_pages(lo, self.pool.k[:, idx], self.pool.v[:, idx])
