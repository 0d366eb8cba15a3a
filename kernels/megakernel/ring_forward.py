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


def _tiles(x, tiles):
    """x [..., D] times each tile of tiles [n, D, e] -> f32 [..., n, e].

    The tile index is the batch dim of both sides (x broadcast: n x rows x D, activations):
    with it free on the weight side alone, XLA re-laid out the tiles first, a copy of every
    q tile of every layer and a 623 MB data-format call of the vocab head per prefill call
    (Qwen3-30B-A3B on tpu7x)."""
    lead, n = x.shape[:-1], tiles.shape[0]
    flat = x.reshape(-1, x.shape[-1])
    y = _dot("nrd,nde->nre", jnp.broadcast_to(flat[None], (n, *flat.shape)), tiles)
    return jnp.moveaxis(y, 0, 1).reshape(*lead, n, tiles.shape[-1])


def _attention(p: MegaPlan, mp, li, h, cos, sin, positions, page_table, k_cache, v_cache):
    """One layer's attention from ring A (q groups, k, v) and ring B (o_proj groups)."""
    b, t, _ = h.shape
    a0, b0, g, hkv, hd, kv = p.a_base(li), p.b_base(li), p.group, p.num_kv_heads, p.head_dim, p.kv
    vec = mp["vec"][li]
    x = rms_norm(h, vec[VecRow.LN_ATTN, : p.hidden], p.eps)
    ring_a = mp["ring_a"]
    # One batched matmul over the q groups, k and v tiles: k and v as plain matmuls had XLA
    # re-tile both tiles of every layer into HBM first (192 MB for Qwen3-30B-A3B on tpu7x).
    qkv = _tiles(x, ring_a[a0 : a0 + g + 2])  # [b, t, G + 2, ta]
    if p.qkv_bias:
        qkv = qkv + vec[VecRow.QKV_BIAS : VecRow.QKV_BIAS + g + 2, : p.ta]
    qkv = qkv[..., :kv]
    # Group j's tile holds heads h*G+j of every kv head h: [b, t, G, Hkv, D] -> head order.
    q = qkv[..., :g, :].reshape(b, t, g, hkv, hd).transpose(0, 1, 3, 2, 4)
    q = q.reshape(b, t, p.num_heads, hd)
    k = qkv[..., g, :].reshape(b, t, hkv, hd)
    v = qkv[..., g + 1, :].reshape(b, t, hkv, hd)
    if p.qk_norm:  # packed once per kv head; the first copy is the head's weight
        q = rms_norm(q, vec[VecRow.Q_NORM, :hd], p.eps)
        k = rms_norm(k, vec[VecRow.K_NORM, :hd], p.eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = write_kv(k_cache, li, k, positions, page_table)
    v_cache = write_kv(v_cache, li, v, positions, page_table)
    attn = paged_attention(q, k_cache, v_cache, li, positions, page_table, hd**-0.5, hkv)
    attn = attn.reshape(b, t, hkv, g, hd).transpose(0, 1, 3, 2, 4).reshape(b, t, g, kv)
    wo = mp["ring_b"][b0 : b0 + g, :kv, : p.hidden]  # [G, kv, D]
    o = _dot("btge,ged->btd", attn, wo)
    return h + o, k_cache, v_cache


def _dense_mlp(p: MegaPlan, mp, li, x):
    """SwiGLU from ring A's gate/up tile pairs and ring B's down tiles (zero padding adds 0)."""
    first, f = p.a_base(li) + p.group + 2, p.ffn_tiles
    y = _tiles(x, mp["ring_a"][first : first + 2 * f])  # [b, t, 2F, ta]: gate, up per tile
    y = y.reshape(*y.shape[:-2], f, 2, p.ta)
    act = jax.nn.silu(y[..., 0, :]) * y[..., 1, :]  # [b, t, F tiles, ta]
    b0 = p.b_base(li) + p.group
    down = mp["ring_b"][b0 : b0 + f, :, : p.hidden]  # [F tiles, ta, D]
    return _dot("btfe,fed->btd", act, down)


def _divisor_tile(n: int) -> int:
    """The largest of 512, 256, 128 dividing n (else n itself: one whole block)."""
    return next((t for t in (512, 256, 128) if n % t == 0), n)


def stack_gmm(x, stack, sizes, layer, interpret: bool = False):
    """Rows of x (grouped, `sizes` rows per group) times layer `layer`'s groups of a stack,
    read in place: megablox `gmm` over the whole stack viewed as [M*G, K, N], every other
    layer's groups empty, so its block index maps DMA the layer's experts straight from HBM
    and no slice of the stack is ever made.

    Args:
      x: [N, K] rows sorted by group; stack: [M, G, K, Nout]; sizes: i32[G]; layer: int or
      i32[] (inside a scan over layers).
    Returns:
      f32[N, Nout].
    """
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m, g, k, n = stack.shape
    rows = x.shape[0]
    tm = min(128, -(-rows // 8) * 8)
    padded = -(-rows // tm) * tm  # gmm tiles rows exactly; rows past the groups are unused
    x = jnp.pad(x.astype(stack.dtype), ((0, padded - rows), (0, 0)))
    every = jax.lax.dynamic_update_slice(jnp.zeros((m * g,), jnp.int32), sizes, (layer * g,))
    tiling = (tm, _divisor_tile(k), _divisor_tile(n))
    y = gmm(x, stack.reshape(m * g, k, n), every, jnp.float32, tiling, interpret=interpret)
    return y[:rows]


def _layer_ragged_dot(x, stack, sizes, layer):
    """Rows of x (grouped by expert, `sizes` rows each) times layer `layer`'s experts.

    On TPU, `stack_gmm` (a layer's slice of the stack, the operand XLA's ragged matmul cannot
    read in place, was a weight-sized copy per layer: the tpu7x compile of Qwen3-30B-A3B's
    prefill asked for 133.9 GB of temporaries; the whole stack in one ragged matmul with
    empty groups compiled for minutes per layer). Elsewhere (CPU) the layer's slice is read.

    Args:
      x: [N, K] rows sorted by group; stack: [M, G, K, Nout] (layers x groups); sizes: i32[G];
      layer: int or i32[] (inside a scan).
    Returns:
      f32[N, Nout].
    """

    def sliced(x, stack, sizes):
        x = x.astype(stack.dtype)
        return jax.lax.ragged_dot(x, stack[layer], sizes, preferred_element_type=jnp.float32)

    return jax.lax.platform_dependent(
        x, stack, sizes, tpu=lambda *a: stack_gmm(*a, layer), default=sliced
    )


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
    gu = mp["expert_gu"]  # [M, E, 2, D, I]: viewed as [M, 2E, D, I]
    gu = gu.reshape(gu.shape[0], 2 * e, *gu.shape[3:])
    y2 = _layer_ragged_dot(x2, gu, jnp.repeat(sizes, 2), mi)
    act = jax.nn.silu(y2[gate_row]) * y2[up_row]
    y = _layer_ragged_dot(act, mp["expert_down"], sizes, mi)[:, :d]
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
      Hkv * D] pools; page_table: i32[B, P]; logits_index: i32[B] (None: every position);
      dtype: the activations' dtype, the serving dtype `llama.forward` takes from its params
      (rings are bf16).
    Returns:
      (f32[B, V] logits (f32[B, T, V] for every position), k_cache, v_cache), as
      `llama.forward`.
    """
    p, mp = plan, mparams
    h = mp["embed"][tokens][..., : p.hidden].astype(dtype)  # rows are lane-padded
    cos, sin = rope_cos_sin(positions, mp["inv_freq"], mp["rope_scale"])
    for li in range(p.num_layers):
        h, k_cache, v_cache = _attention(
            p, mp, li, h, cos, sin, positions, page_table, k_cache, v_cache
        )
        x = rms_norm(h, mp["vec"][li][VecRow.LN_MLP, : p.hidden], p.eps)
        h = h + (_moe_mlp if p.is_moe[li] else _dense_mlp)(p, mp, li, x)
    if logits_index is not None:
        h = jnp.take_along_axis(h, logits_index[:, None, None], axis=1)[:, 0]
    last = rms_norm(h, mp["final_norm"][0, : p.hidden], p.eps)
    tiles = mp["ring_a"][p.lm_base : p.lm_base + p.vocab_tiles]  # [VT, D, ta]
    logits = _tiles(last, tiles)  # [..., VT, ta]
    logits = logits.reshape(*last.shape[:-1], -1)[..., : p.vocab]
    return logits.astype(jnp.float32), k_cache, v_cache
