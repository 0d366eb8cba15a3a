"""The XLA backend over a tensor-parallel mesh: weights and KV pool split by heads."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from kernels.kv_cache import KVPool
from kernels.tp_llama import (
    KV_SPEC,
    local_pool_row,
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


def tp_pool(
    cfg: Any, parallel: ParallelConfig, num_pages: int, page_size: int, dtype: Any
) -> KVPool:
    """A zero KV pool split by KV heads over `make_mesh(parallel)`.

    Global arrays [L, num_pages, page_size, tp * row_local], device i holding columns i (its
    KV heads: with Hkv >= tp the global row is the one-device row, heads in order; with
    replicated heads it holds tp heads, each Hkv-th repeated). `num_kv_heads` is the stored
    count (`TpLayout.stored_kv_heads`), so page reads and writes see whole global rows.
    """
    lay = parallel.check_model(cfg)
    mesh = make_mesh(parallel)
    row = local_pool_row(cfg, lay, mesh.devices.flat[0].platform)
    shape = (cfg.num_layers, num_pages, page_size, lay.tp * row)
    # Made in place on each device: no whole pool on one device first.
    zeros = jax.jit(partial(jnp.zeros, shape, dtype), out_shardings=NamedSharding(mesh, KV_SPEC))
    return KVPool(zeros(), zeros(), lay.stored_kv_heads, cfg.head_dim)


@dataclass
class TpXlaRunner(XlaRunner):
    """`XlaRunner` whose programs run under shard_map over `parallel.tp` devices.

    The pool must come from `tp_pool` (same config). Its calls, buckets and program set are
    XlaRunner's; returned logits are the gathered rows, as on one device.
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
