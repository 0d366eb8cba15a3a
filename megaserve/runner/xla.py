"""The XLA backend: each call one jitted whole-step program (kernels.xla_step), padded to
the shape buckets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from types import ModuleType
from typing import Any

import jax
import numpy as np

from kernels.kv_cache import KVPool
from kernels.programs import Program, ProgramCache, abstract, is_abstract
from kernels.xla_step import decode_program, pick, prefill_logprobs_program, prefill_program
from megaserve.runner.base import PositionLogprobs, Runner
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig, bucket
from megaserve.sampling_params import MAX_LOGPROBS, SamplingArrays


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
    `logprob_programs()` (prompt log-probabilities, decode tier only) is apart from it.
    """

    family: ModuleType
    cfg: Any
    params: dict
    pool: KVPool
    step_cfg: StepConfig = field(default_factory=StepConfig)

    def __post_init__(self):
        if not is_abstract(self.params):
            self.params = self.place_params(self.params)
        self.jit_prefills(self.family)
        self._decode: dict[int, Any] = {}
        self._pick = jax.jit(pick)
        self.programs_run = ProgramCache()
        self.program_keys: set[tuple] = set()

    def place_params(self, params: dict) -> dict:
        """The params on device: host ones (LoadedModel on_device=False) move once."""
        return jax.device_put(params)

    @property
    def compiled_programs(self) -> int:
        return len(self.program_keys)

    def jit_prefills(self, family: Any) -> None:
        """The prefill programs over `family.forward` (the model's, or the megakernel's rings)."""
        self._prefill = jax.jit(partial(prefill_program, family, self.cfg), donate_argnums=(1, 2))
        top_k = min(MAX_LOGPROBS, self.cfg.vocab_size)
        self._prefill_lp = jax.jit(
            partial(prefill_logprobs_program, family, self.cfg, top_k), donate_argnums=(1, 2)
        )

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
        """Every program this runner's calls can need (but `logprob_programs`), abstract."""
        sc, i32, vocab = self.step_cfg, np.int32, self.cfg.vocab_size
        out = []
        for b in sc.batch_buckets:
            out += [self.decode_program(b, w) for w in self.decode_widths()]
        for b in sc.prefill_batch_buckets:
            for t in sc.token_buckets:
                out.append(Program("prefill", (b, t), self._prefill, self._prefill_args(b, t)))
        for b in sorted(set(sc.batch_buckets) | set(sc.prefill_batch_buckets)):
            s = abstract(SamplingArrays.greedy(b).with_zero_counts(vocab).padded(b))
            args = (_sds((b, vocab), np.float32), s, _sds((b,), i32))
            out.append(Program("pick", (b,), self._pick, args))
        return out

    def _prefill_args(self, b: int, t: int) -> tuple:
        i32, kv = np.int32, abstract(self.pool.k)
        return (
            abstract(self.prefill_params()),
            kv,
            kv,
            _sds((b, t), i32),
            _sds((b, t), i32),
            _sds((b, self.step_cfg.max_pages_per_seq), i32),
            _sds((b,), i32),
            abstract(SamplingArrays.greedy(b).padded(b)),
        )

    @property
    def logprob_chunk(self) -> int:
        # One chunk length, not every token bucket: scoring requests are rare, and each
        # program of the set is a compile at every worker start. At least a page, so a chunk
        # recomputing prefix-cache hits (whole pages) always advances.
        return max(self.step_cfg.token_buckets[-1], self.pool.page_size)

    def logprob_programs(self) -> list[Program]:
        """`prefill_logprobs` per prefill row bucket, at `logprob_chunk` tokens."""
        t, out = self.logprob_chunk, []
        for b in self.step_cfg.prefill_batch_buckets:
            args = (*self._prefill_args(b, t), _sds((b, t), np.int32))
            out.append(Program("prefill_logprobs", (b, t), self._prefill_lp, args))
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
        if isinstance(logits, jax.Array) and len(logits.sharding.device_set) > 1:
            # `pick` is built for one device (warm-up lowers it from unsharded shapes): a
            # mesh's logits come through the host (penalized rows are rare). In a multi-host
            # group every process picks alike from the same gathered logits.
            logits = to_host(logits)
        return to_host(self._run("pick", (b,), self._pick, logits, s, pos.astype(np.int32)))

    def _prefill_inputs(self, batch: TokenBatch, tb: int) -> tuple:
        """(rows bucket, tokens, positions, page table, last index) padded for a prefill."""
        sc, n = self.step_cfg, batch.num_seqs
        b = bucket(n, sc.prefill_batch_buckets, "prefill rows")
        tok, pos = batch.padded(b, tb)
        last = np.zeros(b, np.int32)
        last[:n] = batch.num_new - 1
        # Prefill always takes the full page width: one program per (rows, chunk), not per
        # width too (its attention over padding pages is masked).
        return b, tok, pos, batch.page_table(b, sc.max_pages_per_seq), last

    def prefill(self, batch: TokenBatch, sampling: SamplingArrays) -> tuple[np.ndarray, np.ndarray]:
        n = batch.num_seqs
        tb = bucket(int(batch.num_new.max()), self.step_cfg.token_buckets, "prefill chunk")
        b, tok, pos, pt, last = self._prefill_inputs(batch, tb)
        nxt, logits, self.pool.k, self.pool.v = self._run(
            "prefill", (b, tb), self._prefill, self.prefill_params(), self.pool.k, self.pool.v,
            tok, pos, pt, last, sampling.without_counts().padded(b),
        )  # fmt: skip
        if sampling.counts is not None:
            nxt = self._penalized_pick(logits, sampling, pos[np.arange(b), last] + 1)
        return to_host(nxt)[:n], to_host(logits)[:n]

    def prefill_with_logprobs(
        self, batch: TokenBatch, sampling: SamplingArrays, targets: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, PositionLogprobs]:
        n, tb = batch.num_seqs, self.logprob_chunk
        bucket(int(batch.num_new.max()), (tb,), "prefill chunk (with log-probabilities)")
        b, tok, pos, pt, last = self._prefill_inputs(batch, tb)
        tgt, _ = replace(batch, tokens=np.asarray(targets, np.int32)).padded(b, tb)
        nxt, logits, target, top_ids, top, self.pool.k, self.pool.v = self._run(
            "prefill_logprobs", (b, tb), self._prefill_lp, self.prefill_params(), self.pool.k,
            self.pool.v, tok, pos, pt, last, sampling.without_counts().padded(b), tgt,
        )  # fmt: skip
        if sampling.counts is not None:
            nxt = self._penalized_pick(logits, sampling, pos[np.arange(b), last] + 1)
        scores = PositionLogprobs(to_host(target)[:n], to_host(top_ids)[:n], to_host(top)[:n])
        return to_host(nxt)[:n], to_host(logits)[:n], scores

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
        while_running: Callable[[Callable[[], bool]], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        n_steps = n_steps or self.step_cfg.steps_per_call
        p = self.pad_decode(batch)
        b = len(p.tokens)
        while_running = while_running or _nothing
        if sampling.counts is None:
            toks, logits = self.decode_call(p, sampling.padded(b), n_steps)
            while_running(toks.is_ready)  # dispatch is asynchronous: the step runs meanwhile
            toks = to_host(toks)[:, : p.rows]
            return toks, (to_host(logits)[:, : p.rows] if want_logits else None)
        # Penalized rows: one step per call, the next token picked from the logits with the
        # counts so far, which then count it.
        plain = sampling.without_counts().padded(b)
        out_t, out_l = [], []
        for _ in range(n_steps):
            _, logits = self.decode_call(p, plain, 1)
            while_running(logits.is_ready)
            while_running = _nothing
            nxt = self._penalized_pick(logits[0], sampling, p.positions + 1)
            out_t.append(nxt[: p.rows])
            if want_logits:
                out_l.append(to_host(logits[0])[: p.rows])
            sampling = sampling.counted(nxt[: p.rows])
            pos = np.where(p.positions >= 0, p.positions + 1, -1).astype(np.int32)
            p = replace(p, tokens=nxt.astype(np.int32), positions=pos)
        return np.stack(out_t), (np.stack(out_l) if want_logits else None)


def _nothing(done: Callable[[], bool]) -> None:
    return None


def to_host(x) -> np.ndarray:
    """A program output on the host. One spread over several processes' devices (a multi-host
    group's vocab-sharded logits) is all-gathered first: a collective, which every process
    of the group reaches too, since they all run the same runner calls."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _sds(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)
