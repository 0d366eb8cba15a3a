"""The family forward in XLA, reading the megakernel's packed rings instead of the family's
params: the pallas backend's prefill (and any XLA step it runs), so a worker holds one
resident copy of the weights, in the layout the kernel reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.llama import rms_norm
from kernels.megakernel.plan import MegaPlan, VecRow
from kernels.moe import route
from kernels.paged_attention import paged_attention, write_kv
from kernels.rope import apply_rope, rope_cos_sin


def _dot(spec: str, x, w):
    """einsum with x in the weights' dtype and f32 accumulation: bf16 rings are read as they
    lie (casting them to f32 activations made weight-sized temporaries: 5.5 GB for
    Llama-3.1-8B), f32 rings give exactly the family's f32 forward."""
    return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _mm(x, w):
    return _dot("...d,...de->...e", x, w)


def _attention(p: MegaPlan, mp, li, h, cos, sin, positions, page_table, k_cache, v_cache):
    """One layer's attention from ring A (q groups, k, v) and ring B (o_proj groups)."""
    b, t, _ = h.shape
    a0, b0, g, hkv, hd, kv = p.a_base(li), p.b_base(li), p.group, p.num_kv_heads, p.head_dim, p.kv
    vec = mp["vec"][li]
    x = rms_norm(h, vec[VecRow.LN_ATTN, : p.hidden], p.eps)
    ring_a = mp["ring_a"]
    # Group j's tile holds heads h*G+j of every kv head h: [b, t, G, Hkv, D] -> head order.
    q = _dot("btd,gde->btge", x, ring_a[a0 : a0 + g])[..., :kv]
    q = q.reshape(b, t, g, hkv, hd).transpose(0, 1, 3, 2, 4).reshape(b, t, p.num_heads, hd)
    k = _mm(x, ring_a[a0 + g])[..., :kv].reshape(b, t, hkv, hd)
    v = _mm(x, ring_a[a0 + g + 1])[..., :kv].reshape(b, t, hkv, hd)
    if p.qk_norm:  # packed once per kv head; the first copy is the head's weight
        q = rms_norm(q, vec[VecRow.Q_NORM, :hd], p.eps)
        k = rms_norm(k, vec[VecRow.K_NORM, :hd], p.eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = write_kv(k_cache, li, k, positions, page_table)
    v_cache = write_kv(v_cache, li, v, positions, page_table)
    attn = paged_attention(q, k_cache, v_cache, li, positions, page_table, hd**-0.5)
    attn = attn.reshape(b, t, hkv, g, hd).transpose(0, 1, 3, 2, 4).reshape(b, t, g, kv)
    wo = mp["ring_b"][b0 : b0 + g, :kv, : p.hidden]  # [G, kv, D]
    o = _dot("btge,ged->btd", attn, wo)
    return h + o, k_cache, v_cache


def _dense_mlp(p: MegaPlan, mp, li, x):
    """SwiGLU from ring A's gate/up tile pairs and ring B's down tiles (zero padding adds 0)."""
    first, f = p.a_base(li) + p.group + 2, p.ffn_tiles
    gu = mp["ring_a"][first : first + 2 * f].reshape(f, 2, p.hidden, p.ta)
    y = _dot("btd,fjde->btfje", x, gu)
    act = jax.nn.silu(y[..., 0, :]) * y[..., 1, :]  # [b, t, F tiles, ta]
    b0 = p.b_base(li) + p.group
    down = mp["ring_b"][b0 : b0 + f, :, : p.hidden]  # [F tiles, ta, D]
    return _dot("btfe,fed->btd", act, down)


def _moe_mlp(p: MegaPlan, mp, li, x):
    """Routed experts, grouped: (token, expert) pairs sorted by expert, one ragged matmul over
    the experts' gate and up matrices as they lie in the ring ([E, 2, D, I] viewed as
    [2E, D, I]: each pair's rows go to group 2e for gate and 2e+1 for up), one for down."""
    mi, e, k = p.moe_index(li), p.num_experts, p.top_k
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    weights, idx = route(mp["router"][mi][:, :e], flat, k, p.norm_topk_prob)
    pairs = idx.reshape(-1)
    order = jnp.argsort(pairs, stable=True)
    token, expert = order // k, pairs[order]
    sizes = jnp.bincount(pairs, length=e).astype(jnp.int32)
    start = jnp.cumsum(sizes) - sizes  # first sorted row of each expert
    within = jnp.arange(pairs.shape[0]) - start[expert]
    gate_row = 2 * start[expert] + within  # rows of group 2e, then of 2e+1
    up_row = gate_row + sizes[expert]
    xs = flat[token]
    x2 = jnp.zeros((2 * xs.shape[0], d), xs.dtype).at[gate_row].set(xs).at[up_row].set(xs)
    gu = mp["expert_gu"][mi].reshape(2 * e, d, p.moe_inter_p)
    f32 = jnp.float32
    y2 = jax.lax.ragged_dot(
        x2.astype(gu.dtype), gu, jnp.repeat(sizes, 2), preferred_element_type=f32
    )
    act = jax.nn.silu(y2[gate_row]) * y2[up_row]
    down = mp["expert_down"][mi][:, :, :d]
    y = jax.lax.ragged_dot(act.astype(down.dtype), down, sizes, preferred_element_type=f32)
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros(flat.shape, jnp.float32).at[token].add(y).reshape(b, t, d).astype(x.dtype)


def ring_forward(
    plan, mparams, tokens, positions, k_cache, v_cache, page_table, logits_index, dtype=jnp.float32
):
    """`kernels.llama.forward` (with the Qwen3-MoE MLP where the plan routes) over the rings.

    Args:
      plan: the megakernel plan (its sizes and tile order; batch and page width unused).
      mparams: `pack_megakernel` output.
      tokens, positions: i32[B, T] (-1 = padding); k_cache, v_cache: [L, pages, page_size,
      Hkv * D] pools; page_table: i32[B, P]; logits_index: i32[B]; dtype: the activations'
      dtype, the serving dtype `llama.forward` takes from its params (rings are bf16).
    Returns:
      (f32[B, V] logits, k_cache, v_cache), as `llama.forward`.
    """
    p, mp = plan, mparams
    embed = mp["embed"]
    h = embed[tokens].astype(dtype)
    cos, sin = rope_cos_sin(positions, mp["inv_freq"], mp["rope_scale"])
    for li in range(p.num_layers):
        h, k_cache, v_cache = _attention(
            p, mp, li, h, cos, sin, positions, page_table, k_cache, v_cache
        )
        x = rms_norm(h, mp["vec"][li][VecRow.LN_MLP, : p.hidden], p.eps)
        h = h + (_moe_mlp if p.is_moe[li] else _dense_mlp)(p, mp, li, x)
    last = jnp.take_along_axis(h, logits_index[:, None, None], axis=1)[:, 0]
    last = rms_norm(last, mp["final_norm"][0, : p.hidden], p.eps)
    tiles = mp["ring_a"][p.lm_base : p.lm_base + p.vocab_tiles]  # [VT, D, ta]
    logits = _dot("bd,vde->bve", last, tiles)
    return logits.reshape(last.shape[0], -1)[:, : p.vocab].astype(jnp.float32), k_cache, v_cache
