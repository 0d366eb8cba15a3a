"""The `pallas` backend: XLA prefill programs, each decode step one megakernel call."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels.megakernel.pack import abstract_params, pack_megakernel
from kernels.megakernel.plan import MegaPlan, make_plan
from kernels.megakernel.ring_forward import ring_forward
from kernels.megakernel.step import megakernel_step
from kernels.programs import Program, is_abstract
from kernels.xla_step import pick
from megaserve.errors import BackendError
from megaserve.runner.xla import PaddedDecode, XlaRunner


def pallas_decode(step, interpret: bool, mparams, k, v, tok, pos, pt, s):
    """One decode step through `step` (`megakernel_step` with its plan bound, or the tp
    step): (i32[B] next tokens, f32[B, V] logits, k, v)."""
    toks, logits, k, v, _ = step(mparams, k, v, tok, pos, pt, interpret)
    # Greedy rows keep the kernel's in-kernel argmax; sampled rows are picked from the
    # kernel's logits in XLA (the same `pick` as the XLA backend; penalties run after, in
    # the runner's separate `pick` program).
    nxt = jnp.where(s["temperature"] > 0, pick(logits, s, pos + 1), toks)
    return nxt, logits, k, v


@dataclass(frozen=True)
class RingFamily:
    """What `prefill_program` calls as `family.forward`: the XLA forward over the rings."""

    plan: MegaPlan
    dtype: Any  # activations, as the family's forward takes them from its params

    def forward(self, cfg, mparams, tokens, positions, k, v, page_table, logits_index):
        del cfg  # the plan holds every size
        return ring_forward(
            self.plan, mparams, tokens, positions, k, v, page_table, logits_index, self.dtype
        )


@dataclass
class MegakernelRunner(XlaRunner):
    """Prefill (and its scoring variant) stays the XLA program over the rings; decode runs the
    megakernel (interpreted off TPU).

    Decode programs are keyed by batch bucket only: every call passes the full page table
    (max pages per sequence) and the kernel's read loop runs over the pages each row really
    holds (a count it computes from the positions), so the width costs no reads.
    """

    interpret: bool | None = None
    vmem_budget: int | None = None  # bytes the plan may take (None: the tpu7x default)
    # The kernel's matmul input dtype: None = the plan's (bf16); float32 is the exactness
    # mode tests compare the XLA backend with.
    matmul_dtype: Any = None

    def __post_init__(self):
        if self.interpret is None:
            self.interpret = jax.default_backend() != "tpu"
        self.kv_dtype = self.pool.k.dtype
        # The rings hold the serving dtype (--dtype): bf16 by default on TPU, f32 where the
        # parity tests run, so prefill over the rings computes what the XLA backend does.
        act_dtype = self.weight_dtype = self.params["embed"].dtype
        base = self.plan_for(1, 1)
        # One resident copy of the weights: the rings, packed from the host params when the
        # model was loaded for this backend (LoadedModel.load_for); prefill reads them too.
        if is_abstract(self.params):  # compile-worker: shapes, no weights
            self.mparams = abstract_params(base)
        else:
            self.mparams = pack_megakernel(base, self.params)
        self.params = None
        super().__post_init__()
        self.jit_prefills(RingFamily(base, act_dtype))  # prefill (and scoring) over the rings
        self._pallas: dict[int, Any] = {}

    def prefill_params(self) -> Any:
        return self.mparams

    def plan_for(self, batch: int, pages: int) -> MegaPlan:
        over = self.plan_overrides(self.pool.k.shape[-1])
        return make_plan(self.cfg, batch, self.pool.page_size, pages, **over)

    def plan_overrides(self, kv_row: int) -> dict:
        """The plan fields this runner sets (dtypes, its pool's row, VMEM budget, matmul
        inputs); `TpMegakernelRunner` passes its shard's row."""
        over = dict(kv_dtype=self.kv_dtype, weight_dtype=self.weight_dtype, kv_row=kv_row)
        if self.vmem_budget is not None:
            over["vmem_budget"] = self.vmem_budget
        if self.matmul_dtype is not None:
            over["act_dtype"] = self.matmul_dtype
        return over

    def max_batch(self) -> tuple[int, str]:
        """The largest batch bucket whose plan fits VMEM at the widest page table."""
        widest = self.step_cfg.max_pages_per_seq
        refused = None
        for b in reversed(self.step_cfg.batch_buckets):
            try:
                self.plan_for(b, widest)
            except ValueError as e:
                refused = refused or f"batch {b}: {e}"
                continue
            return b, refused or "the largest batch bucket"
        raise BackendError(f"no batch bucket plans at {widest} pages per sequence: {refused}")

    def decode_widths(self) -> tuple[int, ...]:
        return (self.step_cfg.max_pages_per_seq,)

    def decode_params(self) -> Any:
        return self.mparams

    def _pallas_fn(self, b: int):
        if b not in self._pallas:
            plan = self.plan_for(b, self.step_cfg.max_pages_per_seq)
            step = partial(megakernel_step, plan)
            self._pallas[b] = jax.jit(
                partial(pallas_decode, step, self.interpret), donate_argnums=(1, 2)
            )
        return self._pallas[b]

    def decode_program(self, b: int, w: int) -> Program:
        p = super().decode_program(b, w)
        return Program("pallas_decode", (b,), self._pallas_fn(b), p.args)

    def decode_call(self, p: PaddedDecode, s: dict, n_steps: int):
        """n_steps kernel calls (one step each): (i32[n, B] tokens, f32[n, B, V] logits)."""
        b = len(p.tokens)
        tok, pos = p.tokens, p.positions
        out_t, out_l = [], []
        for i in range(n_steps):
            nxt, logits, self.pool.k, self.pool.v = self._run(
                "pallas_decode", (b,), self._pallas_fn(b), self.mparams, self.pool.k,
                self.pool.v, tok, pos, p.page_table, s,
            )  # fmt: skip
            out_t.append(nxt)
            out_l.append(logits)
            if i + 1 < n_steps:  # the last step's tokens stay on the device: no wait here
                tok = np.asarray(nxt).astype(np.int32)
                pos = np.where(pos >= 0, pos + 1, -1).astype(np.int32)
        return jnp.stack(out_t), jnp.stack(out_l)
