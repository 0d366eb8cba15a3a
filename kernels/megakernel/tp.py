"""The megakernel over tensor-parallel shards: one shard's plan and rings, the step under
shard_map (the kernel all-reduces h by remote DMA; the shards' argmaxes meet after it)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kernels.llama import LlamaConfig
from kernels.megakernel.collective import choose_all_reduce
from kernels.megakernel.pack import pack_megakernel
from kernels.megakernel.plan import LANES, MegaPlan, make_plan, round_up
from kernels.megakernel.step import kernel_logits, run_kernel
from kernels.tp_llama import (
    AXIS,
    KV_SPEC,
    REPLICATED,
    TpLayout,
    local_config,
    param_specs,
    shard_major_params,
    shard_winner,
)


def tp_plan(
    cfg: LlamaConfig, lay: TpLayout, batch: int, page_size: int, pages_per_seq: int, **overrides
) -> MegaPlan:
    """One shard's plan: its heads, intermediate columns and `lay.vocab` lm_head columns.

    Raises:
      ValueError for MoE models (the kernel's routed experts are not split over shards yet).
    """
    if getattr(cfg, "moe_layers", ()):
        raise ValueError(
            f"megakernel tp={lay.tp}: MoE layers are not split over shards yet; "
            "use the xla backend for Qwen3-MoE under tp/ep"
        )
    local = dataclasses.replace(local_config(cfg, lay), vocab_size=lay.vocab)
    reduce = choose_all_reduce(lay.tp, batch, round_up(cfg.hidden_size, LANES))
    over = dict(tp=lay.tp, vocab_global=cfg.vocab_size, all_reduce=reduce) | overrides
    return make_plan(local, batch, page_size, pages_per_seq, **over)


def _block(a: np.ndarray, spec: Any, shard: int, tp: int) -> np.ndarray:
    """Shard `shard`'s block of a shard-major host array split by `spec` (whole if replicated)."""
    for axis, name in enumerate(spec):
        if name == AXIS:
            per = a.shape[axis] // tp
            return np.take(a, np.arange(shard * per, (shard + 1) * per), axis=axis)
    return a


def pack_tp_megakernel(plan: MegaPlan, cfg: LlamaConfig, lay: TpLayout, params: dict) -> dict:
    """`pack_megakernel` of every shard's weights, stacked on a leading [tp] axis (host
    arrays; `place` puts shard i's block on device i).

    params: `llama.pack_params` output of the whole model (host or device).
    """
    host = shard_major_params(cfg, lay, params)
    specs = param_specs(host)
    shards = []
    for i in range(lay.tp):
        local = jax.tree.map(lambda a, s, i=i: _block(a, s, i, lay.tp), host, specs)
        shards.append(pack_megakernel(plan, local))
    return {k: np.stack([np.asarray(s[k]) for s in shards]) for k in shards[0]}


def place(mparams: dict, mesh: Any) -> dict:
    """The stacked rings onto the mesh, shard i's block on the tp axis' device i."""
    sharding = jax.sharding.NamedSharding(mesh, P(AXIS))
    return {k: jax.device_put(a, sharding) for k, a in mparams.items()}


def put_pages(plan: MegaPlan, k, v, k_pages, v_pages, positions, page_table):
    """Writes each live row's new-token page into the pool (in place on a donated pool).

    k, v: [L, pages, page_size, kv_row] this shard's pools; k_pages, v_pages: [L, B,
    page_size, kv_row] the kernel's page outputs (`plan.pages_out`); positions: i32[B]
    (-1 = padding row, whose page is dropped); page_table: i32[B, P].
    """
    last = jnp.maximum(positions, 0) // plan.page_size
    page = jnp.take_along_axis(page_table, last[:, None], axis=1)[:, 0]
    page = jnp.where(positions >= 0, page, k.shape[1])  # out of range: mode="drop"
    k = k.at[:, page].set(k_pages, mode="drop")
    v = v.at[:, page].set(v_pages, mode="drop")
    return k, v


def tp_megakernel_step(
    plan: MegaPlan,
    lay: TpLayout,
    mesh: Any,
    mparams: dict,
    k_cache: jax.Array,
    v_cache: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    page_table: jax.Array,
    interpret: bool = False,
):
    """`step.megakernel_step` over `lay.tp` shards: the same arguments and returns.

    Args:
      plan: `tp_plan` (one shard's); mparams: `place(pack_tp_megakernel(...))`;
      k_cache, v_cache: [L, pages, page_size, tp * kv_row] pools split by KV heads
        (`tp_llama.KV_SPEC`, `megaserve.parallel.tp_pool`'s layout);
      tokens: i32[B]; positions: i32[B] (-1 = padding row); page_table: i32[B, P].
    Returns:
      (i32[B] greedy tokens, f32[B, V] logits or None, k_cache, v_cache, None).
    """
    vocab = plan.vocab_global

    def body(mp, k, v, tokens, positions, page_table):
        mp = {name: a[0] for name, a in mp.items()}  # this shard's [1, ...] block
        res = run_kernel(plan, mp, k, v, tokens, positions, page_table, interpret)
        greedy = shard_winner(res["best"][:, 0], res["tokens"][:, 0], lay)
        k, v = put_pages(plan, k, v, res["k_pages"], res["v_pages"], positions, page_table)
        outs = (greedy, k, v)
        if not plan.emit_logits:
            return outs
        whole = jax.lax.all_gather(kernel_logits(plan, res), AXIS, axis=1, tiled=True)
        whole = whole[:, :vocab]
        return (*outs, whole)

    specs = {name: P(AXIS) for name in mparams}
    out_specs = (REPLICATED, KV_SPEC, KV_SPEC) + ((REPLICATED,) if plan.emit_logits else ())
    # check_vma=False: pallas_call outputs carry no varying-axis type for shard_map to check.
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, KV_SPEC, KV_SPEC, REPLICATED, REPLICATED, REPLICATED),
        out_specs=out_specs,
        check_vma=False,
    )
    out = fn(mparams, k_cache, v_cache, tokens, positions, page_table)
    logits = out[3] if plan.emit_logits else None
    return out[0], logits, out[1], out[2], None
