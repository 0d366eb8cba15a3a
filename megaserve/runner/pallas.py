"""The `pallas` backend: XLA prefill programs, each decode step one megakernel call."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels.megakernel.pack import pack_megakernel
from kernels.megakernel.plan import MegaPlan, make_plan
from kernels.megakernel.step import megakernel_step
from kernels.xla_step import pick
from megaserve.errors import BackendError
from megaserve.runner.batch import TokenBatch
from megaserve.runner.xla import XlaRunner
from megaserve.sampling_params import SamplingArrays


def _pallas_decode(plan: MegaPlan, interpret: bool, mparams, k, v, tok, pos, pt, s):
    toks, logits, k, v, _ = megakernel_step(plan, mparams, k, v, tok, pos, pt, interpret)
    # Greedy rows keep the kernel's in-kernel argmax; sampled or penalized rows are picked
    # from the kernel's logits in XLA (the same `pick` as the XLA backend).
    if "counts" in s:
        nxt = pick(logits, s, pos + 1)
    else:
        nxt = jnp.where(s["temperature"] > 0, pick(logits, s, pos + 1), toks)
    return nxt, logits, k, v


@dataclass
class MegakernelRunner(XlaRunner):
    """Prefill stays the XLA program; decode runs the megakernel (interpreted off TPU).

    The pool keeps the decode tier's [L, pages, page_size, Hkv, D] arrays: the kernel views
    them as [.., Hkv * D], which is free on CPU (see `megakernel_step` for TPU).
    """

    interpret: bool | None = None
    vmem_budget: int | None = None  # bytes the plan may take (None: the tpu7x default)

    def __post_init__(self):
        super().__post_init__()
        if self.interpret is None:
            self.interpret = jax.default_backend() != "tpu"
        self.kv_dtype = self.pool.k.dtype
        base = make_plan(self.cfg, 1, self.pool.page_size, 1, kv_dtype=self.kv_dtype)
        self.mparams = pack_megakernel(base, self.params)
        self._pallas: dict[tuple[int, int], Any] = {}

    def plan_for(self, batch: int, pages: int) -> MegaPlan:
        budget = {} if self.vmem_budget is None else {"vmem_budget": self.vmem_budget}
        return make_plan(
            self.cfg, batch, self.pool.page_size, pages, kv_dtype=self.kv_dtype, **budget
        )

    def max_batch(self) -> tuple[int, str]:
        """The largest batch bucket whose plan fits VMEM at the widest page table."""
        widest = self.step_cfg.page_buckets[-1]
        refused = None
        for b in reversed(self.step_cfg.batch_buckets):
            try:
                self.plan_for(b, widest)
            except ValueError as e:
                refused = refused or f"batch {b}: {e}"
                continue
            return b, refused or "the largest batch bucket"
        raise BackendError(f"no batch bucket plans at {widest} pages per sequence: {refused}")

    def decode(
        self,
        batch: TokenBatch,
        sampling: SamplingArrays,
        n_steps: int | None = None,
        want_logits: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """As `XlaRunner.decode`; n_steps > 1 runs one kernel call per step."""
        n_steps = n_steps or self.step_cfg.steps_per_call
        p = self.pad_decode(batch)
        b = len(p.tokens)
        key = (b, p.page_table.shape[1])
        if key not in self._pallas:
            plan = self.plan_for(*key)
            self._pallas[key] = jax.jit(
                partial(_pallas_decode, plan, self.interpret), donate_argnums=(1, 2)
            )
        self.program_keys.add(("pallas_decode", *key, sampling.counts is not None))
        s = sampling.padded(b)
        rows = np.arange(b)
        tok, pos = p.tokens, p.positions
        out_t, out_l = [], []
        for _ in range(n_steps):
            nxt, logits, self.pool.k, self.pool.v = self._pallas[key](
                self.mparams, self.pool.k, self.pool.v, tok, pos, p.page_table, s
            )
            nxt = np.asarray(nxt)
            out_t.append(nxt[: p.rows])
            if want_logits:
                out_l.append(np.asarray(logits)[: p.rows])
            if "counts" in s:
                s = s | {"counts": s["counts"].copy(), "seen": s["seen"].copy()}
                s["counts"][rows, nxt] += 1
                s["seen"][rows, nxt] = True
            tok = nxt.astype(np.int32)
            pos = np.where(pos >= 0, pos + 1, -1).astype(np.int32)
        return np.stack(out_t), (np.stack(out_l) if want_logits else None)
