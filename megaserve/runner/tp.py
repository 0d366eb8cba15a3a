"""The XLA backend over a tensor-parallel mesh: weights and KV pool split by heads."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
from jax.sharding import NamedSharding

from kernels.tp_llama import (
    KV_SPEC,
    param_specs,
    shard_major_params,
    shard_params,
)
from kernels.tp_step import (
    tp_decode_program,
    tp_jit,
    tp_prefill_logprobs_program,
    tp_prefill_program,
)
from megaserve.parallel.mesh import ParallelConfig, make_mesh
from megaserve.runner.xla import XlaRunner
from megaserve.sampling_params import MAX_LOGPROBS


@dataclass
class TpXlaRunner(XlaRunner):
    """`XlaRunner` whose programs run under shard_map over `parallel.tp` x `parallel.ep`
    devices (ep > 1: Qwen3-MoE's experts split over ep, `kernels.tp_moe`).

    The pool must come from `megaserve.parallel.tp_pool.tp_pool` (same config). Its calls,
    buckets and program set are XlaRunner's; returned logits are the gathered rows, as on
    one device.
    """

    parallel: ParallelConfig = ParallelConfig()

    def __post_init__(self):
        self.layout = self.parallel.check_model(self.cfg)
        self.mesh = make_mesh(self.parallel)
        want = NamedSharding(self.mesh, KV_SPEC)
        got = getattr(self.pool.k, "sharding", None)
        if got is None or not got.is_equivalent_to(want, self.pool.k.ndim):
            raise ValueError(f"a tp={self.parallel.tp} runner needs a pool from tp_pool")
        self.specs = param_specs(self.params)
        super().__post_init__()

    def place_params(self, params: dict) -> dict:
        """Host params (`pack_params`' layout) re-ordered shard-major and split over the
        mesh; params already split over it (`LoadedModel.load_sharded`) kept as they are."""
        if _split_over(params, self.specs, self.mesh):
            return params
        host = shard_major_params(self.cfg, self.layout, params)
        return shard_params(host, self.specs, self.mesh)

    def _jit(self, program, n_rest: int, *static):
        fn = partial(program, self.cfg, self.layout, self.mesh, self.specs, *static)
        return tp_jit(fn, self.mesh, self.specs, n_rest)

    def jit_prefills(self, family: Any) -> None:
        self._prefill = self._jit(tp_prefill_program, 5)
        top_k = min(MAX_LOGPROBS, self.cfg.vocab_size)
        self._prefill_lp = self._jit(tp_prefill_logprobs_program, 6, top_k)

    def decode_fn(self, n_steps: int):
        if n_steps not in self._decode:
            self._decode[n_steps] = self._jit(tp_decode_program, 4, n_steps, True)
        return self._decode[n_steps]


def _split_over(params: dict, specs: dict, mesh: Any) -> bool:
    """True when every leaf is a jax.Array laid out over mesh by its spec."""
    laid = jax.tree.map(
        lambda a, s: (
            isinstance(a, jax.Array) and a.sharding.is_equivalent_to(NamedSharding(mesh, s), a.ndim)
        ),
        params,
        specs,
    )
    return all(jax.tree.leaves(laid))
