"""XLA whole-step programs: prefill chunks and (multi-)step decode over a donated KV pool."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels.kv_cache import KVPool
from kernels.sampling import apply_penalties, sample


@dataclass(frozen=True)
class StepConfig:
    """Shape buckets: every call is padded up to one, so compiled programs stay bounded."""

    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    # Page-table widths are powers of two up to the pages one sequence may hold.
    max_pages_per_seq: int = 512
    steps_per_call: int = 1

    def __post_init__(self):
        if self.steps_per_call < 1:
            raise ValueError(f"steps_per_call={self.steps_per_call} must be >= 1")

    @property
    def page_buckets(self) -> tuple[int, ...]:
        out, p = [], 1
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


@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters, host side; see kernels.sampling.

    `counts`/`seen` are only built when some row uses a penalty: the programs then take the
    penalized variant (a separate executable), so unpenalized batches pay nothing.
    """

    temperature: np.ndarray  # f32[B]
    top_k: np.ndarray  # i32[B]
    top_p: np.ndarray  # f32[B]
    min_p: np.ndarray  # f32[B]
    seed: np.ndarray  # u32[B]
    presence: np.ndarray  # f32[B]
    frequency: np.ndarray  # f32[B]
    repetition: np.ndarray  # f32[B], 1 = off
    counts: np.ndarray | None = None  # i32[B, V] occurrences of each token in the output
    seen: np.ndarray | None = None  # bool[B, V] token appears in prompt or output

    _FILL = {
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "seed": 0,
        "presence": 0.0,
        "frequency": 0.0,
        "repetition": 1.0,
    }
    _DTYPES = {
        "temperature": np.float32,
        "top_k": np.int32,
        "top_p": np.float32,
        "min_p": np.float32,
        "seed": np.uint32,
        "presence": np.float32,
        "frequency": np.float32,
        "repetition": np.float32,
    }

    @classmethod
    def greedy(cls, batch: int) -> SamplingArrays:
        return cls.build([{}] * batch)

    @classmethod
    def build(
        cls,
        rows: list[dict],
        histories: list[tuple[list[int], list[int]]] | None = None,
        vocab: int = 0,
    ) -> SamplingArrays:
        """rows: per-row params; histories: (prompt, output) per row, needed for penalties."""
        cols = {
            k: np.array([r.get(k, f) for r in rows], cls._DTYPES[k]) for k, f in cls._FILL.items()
        }
        penalized = any(
            r.get("presence", 0) or r.get("frequency", 0) or r.get("repetition", 1) != 1
            for r in rows
        )
        counts = seen = None
        if penalized:
            assert histories is not None and vocab > 0, "penalties need token histories"
            counts = np.zeros((len(rows), vocab), np.int32)
            seen = np.zeros((len(rows), vocab), bool)
            for i, (prompt, output) in enumerate(histories):
                np.add.at(counts[i], np.asarray(output, np.int64), 1)
                seen[i, np.asarray(prompt + output, np.int64)] = True
        return cls(**cols, counts=counts, seen=seen)

    def padded(self, b: int) -> dict[str, np.ndarray]:
        n = b - len(self.temperature)
        out = {
            k: np.concatenate([getattr(self, k), np.full(n, f, self._DTYPES[k])])
            for k, f in self._FILL.items()
        }
        if self.counts is not None:
            v = self.counts.shape[1]
            out["counts"] = np.concatenate([self.counts, np.zeros((n, v), np.int32)])
            out["seen"] = np.concatenate([self.seen, np.zeros((n, v), bool)])
        return out


def _pick(logits, s, pos):
    """Penalties (when present) then sampling, for f32[B, V] logits."""
    if "counts" in s:
        logits = apply_penalties(
            logits, s["counts"], s["seen"], s["presence"], s["frequency"], s["repetition"]
        )
    return sample(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seed"], pos)


def _prefill_program(family, cfg, params, k, v, tokens, positions, page_table, logits_index, s):
    logits, k, v = family.forward(cfg, params, tokens, positions, k, v, page_table, logits_index)
    pos = jnp.take_along_axis(positions, logits_index[:, None], axis=1)[:, 0] + 1
    return _pick(logits, s, pos), logits, k, v


def _decode_program(family, cfg, n_steps, want_logits, params, k, v, tokens, positions, pt, s):
    zeros = jnp.zeros(tokens.shape, jnp.int32)

    rows = jnp.arange(tokens.shape[0])

    def step(carry, _):
        k, v, tok, pos, s = carry
        logits, k, v = family.forward(cfg, params, tok[:, None], pos[:, None], k, v, pt, zeros)
        nxt = _pick(logits, s, pos + 1)
        if "counts" in s:  # later steps of a multi-step call see this step's token
            s = s | {
                "counts": s["counts"].at[rows, nxt].add(1),
                "seen": s["seen"].at[rows, nxt].set(True),
            }
        pos = jnp.where(pos >= 0, pos + 1, -1)
        return (k, v, nxt, pos, s), (nxt, logits if want_logits else None)

    (k, v, _, _, _), (toks, logits) = jax.lax.scan(
        step, (k, v, tokens, positions, s), None, length=n_steps
    )
    return toks, logits, k, v


@dataclass
class XlaRunner:
    """Runs prefill chunks and decode steps for one model over one KV pool.

    Each call is one device program (a jitted executable, keyed by its bucketed shapes); the
    pool is donated, so the step writes K/V in place and never copies the pool.
    """

    family: ModuleType
    cfg: Any
    params: dict
    pool: KVPool
    step_cfg: StepConfig = field(default_factory=StepConfig)

    def __post_init__(self):
        self._prefill = jax.jit(
            partial(_prefill_program, self.family, self.cfg), donate_argnums=(1, 2)
        )
        self._decode: dict[tuple[int, bool], Any] = {}
        self.program_keys: set[tuple] = set()

    @property
    def compiled_programs(self) -> int:
        """Distinct executables built so far (bounded by the bucket product)."""
        return len(self.program_keys)

    def _pad_table(self, page_table: np.ndarray, b: int) -> np.ndarray:
        p = bucket(max(page_table.shape[1], 1), self.step_cfg.page_buckets, "pages per seq")
        out = np.zeros((b, p), np.int32)
        out[: page_table.shape[0], : page_table.shape[1]] = page_table
        return out

    def _pad_decode_batch(self, tokens: np.ndarray, positions: np.ndarray, page_table):
        """i32[B] tokens/positions and i32[B, P] table padded to the batch and page buckets
        (padding rows: token 0, position -1); returns (n, b, tok, pos, pt)."""
        n = tokens.shape[0]
        b = bucket(n, self.step_cfg.batch_buckets, "batch")
        tok = np.zeros(b, np.int32)
        pos = np.full(b, -1, np.int32)
        tok[:n], pos[:n] = tokens, positions
        return n, b, tok, pos, self._pad_table(page_table, b)

    def prefill(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        page_table: np.ndarray,
        sampling: SamplingArrays,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Writes KV for a chunk of new tokens and samples each row's next token.

        Args:
          tokens: i32[B, T]; positions: i32[B, T] (-1 = padding, which must come last in a row);
          page_table: i32[B, P]; sampling: B rows.
        Returns:
          (i32[B] next tokens, f32[B, V] logits at each row's last real position).
        """
        n, t = tokens.shape
        b = bucket(n, self.step_cfg.batch_buckets, "batch")
        tb = bucket(t, self.step_cfg.token_buckets, "prefill chunk")
        tok = np.zeros((b, tb), np.int32)
        pos = np.full((b, tb), -1, np.int32)
        tok[:n, :t], pos[:n, :t] = tokens, positions
        last = np.maximum((positions >= 0).sum(axis=1) - 1, 0).astype(np.int32)
        last = np.concatenate([last, np.zeros(b - n, np.int32)])
        pt = self._pad_table(page_table, b)
        self.program_keys.add(("prefill", b, tb, pt.shape[1], sampling.counts is not None))
        nxt, logits, self.pool.k, self.pool.v = self._prefill(
            self.params, self.pool.k, self.pool.v, tok, pos, pt, last, sampling.padded(b)
        )
        return np.asarray(nxt)[:n], np.asarray(logits)[:n]

    def decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        page_table: np.ndarray,
        sampling: SamplingArrays,
        n_steps: int | None = None,
        want_logits: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Runs n_steps decode steps in one device call.

        Args:
          tokens: i32[B] last token of each sequence; positions: i32[B] its position;
          page_table: i32[B, P] covering positions up to position + n_steps.
        Returns:
          (i32[n_steps, B] sampled tokens, f32[n_steps, B, V] logits or None).
        """
        n_steps = n_steps or self.step_cfg.steps_per_call
        n, b, tok, pos, pt = self._pad_decode_batch(tokens, positions, page_table)
        key = (n_steps, want_logits)
        if key not in self._decode:
            self._decode[key] = jax.jit(
                partial(_decode_program, self.family, self.cfg, n_steps, want_logits),
                donate_argnums=(1, 2),
            )
        penalized = sampling.counts is not None
        self.program_keys.add(("decode", b, pt.shape[1], n_steps, want_logits, penalized))
        toks, logits, self.pool.k, self.pool.v = self._decode[key](
            self.params, self.pool.k, self.pool.v, tok, pos, pt, sampling.padded(b)
        )
        toks = np.asarray(toks)[:, :n]
        return toks, (np.asarray(logits)[:, :n] if want_logits else None)


BACKENDS = ("xla", "pallas")


def default_backend() -> str:
    """`pallas` (the megakernel) on TPU, `xla` everywhere else."""
    return "pallas" if jax.default_backend() == "tpu" else "xla"


def make_runner(
    family: ModuleType,
    cfg: Any,
    params: dict,
    pool: KVPool,
    step_cfg: StepConfig | None = None,
    backend: str | None = None,
) -> XlaRunner:
    """The decode step's runner for a backend; `pallas` off TPU runs the TPU interpreter."""
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    step_cfg = step_cfg or StepConfig()
    if backend == "pallas":
        from kernels.megakernel.runner import MegakernelRunner

        return MegakernelRunner(family, cfg, params, pool, step_cfg)
    return XlaRunner(family, cfg, params, pool, step_cfg)
