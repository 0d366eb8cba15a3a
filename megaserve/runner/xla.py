"""The XLA backend: each call one jitted whole-step program (kernels.xla_step), padded to
the shape buckets."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any

import jax
import numpy as np

from kernels.kv_cache import KVPool
from kernels.xla_step import decode_program, prefill_program
from megaserve.runner.base import Runner
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig, bucket
from megaserve.sampling_params import SamplingArrays


@dataclass(frozen=True)
class PaddedDecode:
    """A decode batch padded to its buckets (padding rows: token 0 at position -1)."""

    rows: int  # real rows
    tokens: np.ndarray  # i32[B]
    positions: np.ndarray  # i32[B]
    page_table: np.ndarray  # i32[B, P]


@dataclass
class XlaRunner(Runner):
    """Runs prefill pieces and decode steps as jitted programs (keyed by bucketed shapes)."""

    family: ModuleType
    cfg: Any
    params: dict
    pool: KVPool
    step_cfg: StepConfig = field(default_factory=StepConfig)

    def __post_init__(self):
        self._prefill = jax.jit(
            partial(prefill_program, self.family, self.cfg), donate_argnums=(1, 2)
        )
        self._decode: dict[tuple[int, bool], Any] = {}
        self.program_keys: set[tuple] = set()

    @property
    def compiled_programs(self) -> int:
        return len(self.program_keys)

    def _table(self, batch: TokenBatch, rows: int) -> np.ndarray:
        width = bucket(max(batch.max_pages, 1), self.step_cfg.page_buckets, "pages per seq")
        return batch.page_table(rows, width)

    def pad_decode(self, batch: TokenBatch) -> PaddedDecode:
        """The decode batch padded to the batch and page-width buckets."""
        n = batch.num_seqs
        b = bucket(n, self.step_cfg.batch_buckets, "batch")
        tok = np.zeros(b, np.int32)
        pos = np.full(b, -1, np.int32)
        tok[:n], pos[:n] = batch.tokens, batch.num_cached
        return PaddedDecode(n, tok, pos, self._table(batch, b))

    def prefill(self, batch: TokenBatch, sampling: SamplingArrays) -> tuple[np.ndarray, np.ndarray]:
        n = batch.num_seqs
        b = bucket(n, self.step_cfg.batch_buckets, "batch")
        tb = bucket(int(batch.num_new.max()), self.step_cfg.token_buckets, "prefill chunk")
        tok, pos = batch.padded(b, tb)
        last = np.zeros(b, np.int32)
        last[:n] = batch.num_new - 1
        pt = self._table(batch, b)
        self.program_keys.add(("prefill", b, tb, pt.shape[1], sampling.counts is not None))
        nxt, logits, self.pool.k, self.pool.v = self._prefill(
            self.params, self.pool.k, self.pool.v, tok, pos, pt, last, sampling.padded(b)
        )
        return np.asarray(nxt)[:n], np.asarray(logits)[:n]

    def decode(
        self,
        batch: TokenBatch,
        sampling: SamplingArrays,
        n_steps: int | None = None,
        want_logits: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        n_steps = n_steps or self.step_cfg.steps_per_call
        p = self.pad_decode(batch)
        key = (n_steps, want_logits)
        if key not in self._decode:
            self._decode[key] = jax.jit(
                partial(decode_program, self.family, self.cfg, n_steps, want_logits),
                donate_argnums=(1, 2),
            )
        b = len(p.tokens)
        penalized = sampling.counts is not None
        self.program_keys.add(("decode", b, p.page_table.shape[1], n_steps, want_logits, penalized))
        toks, logits, self.pool.k, self.pool.v = self._decode[key](
            self.params,
            self.pool.k,
            self.pool.v,
            p.tokens,
            p.positions,
            p.page_table,
            sampling.padded(b),
        )
        toks = np.asarray(toks)[:, : p.rows]
        return toks, (np.asarray(logits)[:, : p.rows] if want_logits else None)
