"""Mixture-of-experts MLP: top-k softmax router; compute that reads only selected experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(
    router: jnp.ndarray, x: jnp.ndarray, top_k: int, norm_topk_prob: bool
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Top-k of the softmax router, as transformers' Qwen3-MoE.

    Args:
      router: f32[D, E]; x: f32[N, D].
    Returns:
      (f32[N, k] weights, i32[N, k] expert ids); ties go to the lower expert id (lax.top_k,
      like torch.topk on CPU).
    """
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(x.dtype), idx


def local_experts(
    weights: jnp.ndarray, idx: jnp.ndarray, first: jnp.ndarray | int, count: int
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`route`'s choices restricted to the experts [first, first + count) one expert-parallel
    shard holds: their ids renumbered from 0, every other choice given weight 0 and the id
    `count` (out of range: `moe_gather` gathers zeros for it, `moe_dense` matches no expert,
    the prefill paths sort it after every expert's rows and `combine` weighs it by 0).

    Args: weights: f32[N, k]; idx: i32[N, k]; first: i32 scalar (traced under shard_map).
    Returns: (f32[N, k], i32[N, k]).
    """
    local = idx - first
    mine = (local >= 0) & (local < count)
    return jnp.where(mine, weights, 0), jnp.where(mine, local, count)


def swiglu(gu: jnp.ndarray) -> jnp.ndarray:
    """silu(gate) * up of f32[..., 2I] (gate first, as `w_gate_up` is packed): f32[..., I]."""
    f = gu.shape[-1] // 2
    return jax.nn.silu(gu[..., :f]) * gu[..., f:]


def moe_gather(w_gate_up, w_down, weights, idx, x) -> jnp.ndarray:
    """Decode path: fetch each distinct selected expert once, then mix.

    The batch's distinct expert ids are gathered (padding slots use an out-of-range id, so the
    gather fills zeros instead of reading an expert): bytes read = distinct experts x expert
    size, never the whole expert stack.

    Args:
      w_gate_up: f32[E, D, 2I]; w_down: f32[E, I, D]; weights/idx: [N, k]; x: f32[N, D].
    Returns:
      f32[N, D].
    """
    e = w_gate_up.shape[0]
    n, k = idx.shape
    u = min(e, n * k)
    uniq = jnp.unique(idx.reshape(-1), size=u, fill_value=e)  # sorted, padded with e
    wgu = jnp.take(w_gate_up, uniq, axis=0, mode="fill", fill_value=0)  # [U, D, 2I]
    wdn = jnp.take(w_down, uniq, axis=0, mode="fill", fill_value=0)  # [U, I, D]
    # coef[n, u]: routing weight token n gives the expert in slot u (0 if not selected).
    coef = jnp.sum(weights[:, :, None] * (idx[:, :, None] == uniq[None, None, :]), axis=1)
    # Expert-major batched matmuls (batch dim leading on both sides) keep XLA from re-laying
    # out the gathered weights; x is broadcast, which costs U x N x D floats, not weights.
    xb = jnp.broadcast_to(x[None], (u, n, x.shape[-1]))
    act = swiglu(jnp.einsum("und,udi->uni", xb, wgu))
    y = jnp.einsum("uni,uid->und", act, wdn)
    # Summing slots in ascending expert order matches transformers' per-expert index_add.
    return jnp.einsum("nu,und->nd", coef, y)


def moe_grouped(w_gate_up, w_down, weights, idx, x) -> jnp.ndarray:
    """(token, expert) pairs sorted by expert, one `lax.ragged_dot` grouped matmul per weight.

    No longer served: CPU XLA expands ragged_dot densely (every expert on every token). The
    prefill programs run `kernels.moe_prefill.moe_prefill`; this stays as the comparison.

    Args/Returns: as `moe_gather`.
    """
    e = w_gate_up.shape[0]
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    act = swiglu(jax.lax.ragged_dot(x[token], w_gate_up, sizes))
    y = jax.lax.ragged_dot(act, w_down, sizes) * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y)


def moe_dense(w_gate_up, w_down, weights, idx, x) -> jnp.ndarray:
    """Reference: every expert on every token, masked by the routing (reads all experts)."""
    e = w_gate_up.shape[0]
    coef = jnp.sum(weights[:, :, None] * (idx[:, :, None] == jnp.arange(e)), axis=1)  # [N, E]
    act = swiglu(jnp.einsum("nd,edi->nei", x, w_gate_up))
    return jnp.einsum("ne,ned->nd", coef, jnp.einsum("nei,eid->ned", act, w_down))
