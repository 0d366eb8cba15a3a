"""The XLA backend: each call one jitted whole-step program (kernels.xla_step), padded to
the shape buckets."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from types import ModuleType
from typing import Any

import jax
import numpy as np

from kernels.kv_cache import KVPool
from kernels.programs import Program, ProgramCache, abstract, is_abstract
from kernels.xla_step import decode_program, pick, prefill_program
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
    """Runs prefill pieces and decode steps as jitted programs (keyed by bucketed shapes).

    Its whole program set is `programs()`: decode per (batch, page width), prefill per
    (rows, chunk) at the full page width, and `pick` (penalized sampling from the logits)
    per batch. Penalties run as that separate small program so they do not double the
    decode and prefill sets. `megaserve.runner.warm` compiles the set before serving.
    """

    family: ModuleType
    cfg: Any
    params: dict
    pool: KVPool
    step_cfg: StepConfig = field(default_factory=StepConfig)

    def __post_init__(self):
        if not is_abstract(self.params):  # host params (LoadedModel on_device=False) move once
            self.params = jax.device_put(self.params)
        self._prefill = jax.jit(
            partial(prefill_program, self.family, self.cfg), donate_argnums=(1, 2)
        )
        self._decode: dict[int, Any] = {}
        self._pick = jax.jit(pick)
        self.programs_run = ProgramCache()
        self.program_keys: set[tuple] = set()

    @property
    def compiled_programs(self) -> int:
        return len(self.program_keys)

    # -- the program set ------------------------------------------------------------------
    def decode_fn(self, n_steps: int):
        if n_steps not in self._decode:
            self._decode[n_steps] = jax.jit(
                partial(decode_program, self.family, self.cfg, n_steps, True),
                donate_argnums=(1, 2),
            )
        return self._decode[n_steps]

    def decode_widths(self) -> tuple[int, ...]:
        """Page-table widths decode programs take (XLA attends over the whole width)."""
        return self.step_cfg.page_buckets

    def decode_params(self) -> Any:
        return self.params

    def prefill_params(self) -> Any:
        return self.params

    def decode_program(self, b: int, w: int) -> Program:
        i32 = np.int32
        kv = abstract(self.pool.k)
        args = (
            abstract(self.decode_params()),
            kv,
            kv,
            _sds((b,), i32),
            _sds((b,), i32),
            _sds((b, w), i32),
            abstract(SamplingArrays.greedy(b).padded(b)),
        )
        return Program("decode", (b, w, 1), self.decode_fn(1), args)

    def programs(self) -> list[Program]:
        """Every program this runner's calls can need, as abstract programs."""
        sc, i32 = self.step_cfg, np.int32
        vocab, width = self.cfg.vocab_size, sc.max_pages_per_seq
        out = []
        for b in sc.batch_buckets:
            out += [self.decode_program(b, w) for w in self.decode_widths()]
        kv = abstract(self.pool.k)
        params = abstract(self.prefill_params())
        for b in sc.prefill_batch_buckets:
            for t in sc.token_buckets:
                args = (
                    params,
                    kv,
                    kv,
                    _sds((b, t), i32),
                    _sds((b, t), i32),
                    _sds((b, width), i32),
                    _sds((b,), i32),
                    abstract(SamplingArrays.greedy(b).padded(b)),
                )
                out.append(Program("prefill", (b, t), self._prefill, args))
        for b in sorted(set(sc.batch_buckets) | set(sc.prefill_batch_buckets)):
            s = abstract(SamplingArrays.greedy(b).with_zero_counts(vocab).padded(b))
            args = (_sds((b, vocab), np.float32), s, _sds((b,), i32))
            out.append(Program("pick", (b,), self._pick, args))
        return out

    def _run(self, name: str, key: tuple, fn, *args):
        self.program_keys.add((name, *key))
        return self.programs_run.call(name, key, fn, *args)

    # -- calls ----------------------------------------------------------------------------
    def _table(self, batch: TokenBatch, rows: int) -> np.ndarray:
        width = bucket(max(batch.max_pages, 1), self.decode_widths(), "pages per seq")
        return batch.page_table(rows, width)

    def pad_decode(self, batch: TokenBatch) -> PaddedDecode:
        """The decode batch padded to the batch and page-width buckets."""
        n = batch.num_seqs
        b = bucket(n, self.step_cfg.batch_buckets, "batch")
        tok = np.zeros(b, np.int32)
        pos = np.full(b, -1, np.int32)
        tok[:n], pos[:n] = batch.tokens, batch.num_cached
        return PaddedDecode(n, tok, pos, self._table(batch, b))

    def _penalized_pick(self, logits, sampling: SamplingArrays, pos: np.ndarray) -> np.ndarray:
        """Next tokens of penalized rows: the `pick` program on the step's logits."""
        b = logits.shape[0]
        s = sampling.padded(b)
        return np.asarray(self._run("pick", (b,), self._pick, logits, s, pos.astype(np.int32)))

    def prefill(self, batch: TokenBatch, sampling: SamplingArrays) -> tuple[np.ndarray, np.ndarray]:
        sc = self.step_cfg
        n = batch.num_seqs
        b = bucket(n, sc.prefill_batch_buckets, "prefill rows")
        tb = bucket(int(batch.num_new.max()), sc.token_buckets, "prefill chunk")
        tok, pos = batch.padded(b, tb)
        last = np.zeros(b, np.int32)
        last[:n] = batch.num_new - 1
        # Prefill always takes the full page width: one program per (rows, chunk), not per
        # width too (its attention over padding pages is masked).
        pt = batch.page_table(b, sc.max_pages_per_seq)
        nxt, logits, self.pool.k, self.pool.v = self._run(
            "prefill", (b, tb), self._prefill, self.prefill_params(), self.pool.k, self.pool.v,
            tok, pos, pt, last, sampling.without_counts().padded(b),
        )  # fmt: skip
        if sampling.counts is not None:
            nxt = self._penalized_pick(logits, sampling, pos[np.arange(b), last] + 1)
        return np.asarray(nxt)[:n], np.asarray(logits)[:n]

    def decode_call(self, p: PaddedDecode, s: dict, n_steps: int):
        """One decode program call: (i32[n, B] tokens, f32[n, B, V] logits); pool updated."""
        b, w = p.page_table.shape
        toks, logits, self.pool.k, self.pool.v = self._run(
            "decode", (b, w, n_steps), self.decode_fn(n_steps), self.decode_params(),
            self.pool.k, self.pool.v, p.tokens, p.positions, p.page_table, s,
        )  # fmt: skip
        return toks, logits

    def decode(
        self,
        batch: TokenBatch,
        sampling: SamplingArrays,
        n_steps: int | None = None,
        want_logits: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        n_steps = n_steps or self.step_cfg.steps_per_call
        p = self.pad_decode(batch)
        b = len(p.tokens)
        if sampling.counts is None:
            toks, logits = self.decode_call(p, sampling.padded(b), n_steps)
            toks = np.asarray(toks)[:, : p.rows]
            return toks, (np.asarray(logits)[:, : p.rows] if want_logits else None)
        # Penalized rows: one step per call, the next token picked from the logits with the
        # counts so far, which then count it.
        plain = sampling.without_counts().padded(b)
        out_t, out_l = [], []
        for _ in range(n_steps):
            _, logits = self.decode_call(p, plain, 1)
            nxt = self._penalized_pick(logits[0], sampling, p.positions + 1)
            out_t.append(nxt[: p.rows])
            if want_logits:
                out_l.append(np.asarray(logits[0])[: p.rows])
            sampling = sampling.counted(nxt[: p.rows])
            pos = np.where(p.positions >= 0, p.positions + 1, -1).astype(np.int32)
            p = replace(p, tokens=nxt.astype(np.int32), positions=pos)
        return np.stack(out_t), (np.stack(out_l) if want_logits else None)


def _sds(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)
