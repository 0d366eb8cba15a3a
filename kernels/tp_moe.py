"""Tensor x expert parallel Qwen3-MoE: the expert shard plan and the routed MLP on one shard."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels.qwen3_moe import Qwen3MoeConfig, moe_mlp
from kernels.tp_llama import AXIS, EP_AXIS, TpLayout, tp_forward


def expert_layout(cfg: Qwen3MoeConfig, lay: TpLayout, ep: int) -> TpLayout:
    """`lay` (the attention, dense-layer and lm_head plan over tp, `tp_llama.tp_layout`)
    with the routed experts split too: num_experts / ep whole experts per ep shard, each
    expert's moe_intermediate_size / tp gate|up columns and down rows per tp shard.
    ValueError naming the value that does not divide."""
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    if ep < 1:
        raise ValueError(f"ep={ep} must be >= 1")
    if e % ep:
        raise ValueError(f"ep={ep} does not divide num_experts={e}")
    if f % lay.tp:
        raise ValueError(f"tp={lay.tp} does not divide moe_intermediate_size={f}")
    return dataclasses.replace(lay, ep=ep, experts=e // ep, moe_ffn=f // lay.tp)


def shard_mlp(cfg: Qwen3MoeConfig, lp: dict, x: jnp.ndarray) -> jnp.ndarray:
    """`qwen3_moe.moe_mlp` on one (tp, ep) shard, x: f32[B, T, D] (the same on every shard).

    A routed layer's lp holds ep shard j's experts (j * experts ..) and this tp shard's
    columns of each: the router picks among all E, choices of other shards' experts weigh 0
    here, so the result is this device's partial sum. A dense layer is the tp shard's."""
    first = jax.lax.axis_index(EP_AXIS) * lp["w_gate_up"].shape[0] if "router" in lp else 0
    return moe_mlp(cfg, lp, x, first)


def shard_mlp_reduce(lp: dict, y: jnp.ndarray) -> jnp.ndarray:
    """Sums `shard_mlp`'s partial outputs f32[B, T, D]: a routed layer's span every device
    (its experts, its columns of each): one psum over both axes; a dense layer's the tp
    shards only (each ep shard holds the same copy)."""
    return jax.lax.psum(y, (AXIS, EP_AXIS) if "router" in lp else AXIS)


def shard_forward(cfg, lay: TpLayout, *args):
    """`tp_llama.tp_forward` (same arguments and returns) with the family's MLP: the routed
    experts and their wider sum where `lay` has experts, the dense MLP otherwise."""
    if not lay.experts:
        return tp_forward(cfg, lay, *args)
    return tp_forward(cfg, lay, *args, shard_mlp, shard_mlp_reduce)
