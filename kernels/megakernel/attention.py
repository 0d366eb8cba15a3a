"""One layer's attention in the kernel: q/k/v tiles, paged online softmax, o_proj."""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.megakernel.body import (
    HIGHEST,
    MASKED,
    Body,
    Dma,
    count_dma,
    dot,
    each,
    rem,
    rms,
)
from kernels.megakernel.kv_pages import kv_prime, kv_read_copies, kv_read_start, kv_write_copies
from kernels.megakernel.plan import LANES, VecRow


def _rope(ctx: Body, y):
    """RoPE of y: f32[B, ta] (kv heads side by side), with the lane cos/sin tables."""
    p, r = ctx.plan, ctx.refs
    # rotate_half within each head: lanes of the first half take -x[j + D/2], the second
    # half x[j - D/2]; rolls over the whole 128-aligned row never cross a head for the lanes
    # that are kept.
    forward = pltpu.roll(y, p.ta - p.head_dim // 2, 1)
    back = pltpu.roll(y, p.head_dim // 2, 1)
    cos, sin = r["cos"], r["sin"]  # f32[B, ta] refs; each is loaded where it is used
    return y * cos[...] + jnp.where(ctx.masks.first_half_of_head, -forward, back) * sin[...]


def _head_norm(ctx: Body, y, weight):
    """Per-head RMSNorm (Qwen3 q/k norm) of y: f32[B, ta], weight: f32[1, ta]."""
    p, masks = ctx.plan, ctx.masks
    mean_square = dot(y * y, masks.head_seg, HIGHEST) * (1.0 / p.head_dim)
    return weight * (y * dot(lax.rsqrt(mean_square + p.eps), masks.head_seg_t, HIGHEST))


def attention(ctx: Body, layer, a_first, b_first, vec_slot) -> None:
    """One layer's attention: q/k/v tiles, paged online softmax, KV page writes, o_proj.

    a_first, b_first: i32[] the layer's first load in rings A and B; vec_slot: i32[] its
    slot in the vector ring. Adds the attention output to the residual stream `h`.
    """
    p = ctx.plan
    keys, values = _project_qkv(ctx, a_first, vec_slot)
    _start_online_softmax(ctx, keys, values)
    lax.fori_loop(0, ctx.n_items, partial(_attend_page, ctx, layer), 0)
    # The next layer's first pages load while this layer's o_proj and MLP stream.
    pl.when(layer + 1 < p.num_layers)(lambda: kv_prime(ctx, layer + 1))
    _write_pages_and_normalise(ctx, layer)
    _o_proj(ctx, b_first)


def _project_qkv(ctx: Body, a_first, vec_slot):
    """q of every query-head group into the `q` scratch; returns the new tokens' k and v.

    Returns:
      (keys, values): f32[B, kv] each, rounded to the pool's dtype.
    """
    p, r = ctx.plan, ctx.refs
    ln_attn = ctx.vec_row(vec_slot, VecRow.LN_ATTN, p.hidden_p)
    normed = rms(r["h"][...], ln_attn, p.hidden, p.eps)[:, : p.hidden].astype(p.act_dtype)

    def project(tile):  # f32[B, ta]: ring A load a_first + tile
        slot = ctx.ring_a.take(a_first + tile)
        y = dot(normed, ctx.matmul_input(r["ring_a"][slot]))
        ctx.ring_a.refill(a_first + tile)
        return y

    scale = p.head_dim**-0.5
    for group in range(p.group):
        y = project(group)
        if p.qk_norm:
            y = _head_norm(ctx, y, ctx.vec_row(vec_slot, VecRow.Q_NORM, p.ta))
        y = _rope(ctx, y) * scale
        for row in range(p.batch):
            r["q"][row, group : group + 1] = y[row : row + 1, : p.kv]
    keys = project(p.group)
    if p.qk_norm:
        keys = _head_norm(ctx, keys, ctx.vec_row(vec_slot, VecRow.K_NORM, p.ta))
    # Rounded as the pool stores them, so this token's own score matches a re-read.
    keys = _rope(ctx, keys)[:, : p.kv].astype(p.kv_dtype).astype(jnp.float32)
    values = project(p.group + 1)[:, : p.kv].astype(p.kv_dtype).astype(jnp.float32)
    return keys, values


def _start_online_softmax(ctx: Body, keys, values) -> None:
    """Puts each row's new K/V (f32[B, kv] each) into its write page and starts its softmax.

    The online softmax starts from the new token itself: every row has one finite score
    before any page is read, so masked pages can never divide by zero.
    """
    p, r = ctx.plan, ctx.refs
    page_row = ctx.masks.page_row
    for row in range(p.batch):
        key, value = keys[row : row + 1], values[row : row + 1]
        r["kw"][row] = jnp.where(page_row == r["wslot"][row], key, 0.0).astype(p.kv_dtype)
        r["vw"][row] = jnp.where(page_row == r["wslot"][row], value, 0.0).astype(p.kv_dtype)
        # All of the row's groups at once: f32[g, kv] on sublanes.
        r["m"][row] = dot(r["q"][row] * key, r["seg"][...], HIGHEST)
        r["l"][row] = jnp.ones((p.group, LANES), jnp.float32)
        r["acc"][row] = jnp.broadcast_to(value, (p.group, p.kv))


def _attend_page(ctx: Body, layer, item, carry):
    """fori_loop body: folds read item `item` (one page of one row) into that row's softmax."""
    p, r = ctx.plan, ctx.refs
    masks = ctx.masks
    slot = rem(item, p.depth_kv)
    for copy in kv_read_copies(ctx, layer, item):
        copy.wait()
    row, page_index = r["it_seq"][item], r["it_idx"][item]
    page_keys, page_values = r["kbuf"][slot], r["vbuf"][slot]  # kv_dtype[page_size, kv]

    @pl.when(page_index == r["wlast"][row])
    def _merge():  # the page this step rewrites keeps every other row as it was
        r["kw"][row] = jnp.where(masks.page_row == r["wslot"][row], r["kw"][row], page_keys)
        r["vw"][row] = jnp.where(masks.page_row == r["wslot"][row], r["vw"][row], page_values)

    # Only tokens before the row's position count: the new one is already in the softmax.
    valid = page_index * p.page_size + masks.page_row_column < r["pos"][row]
    keys = jnp.where(valid, page_keys.astype(jnp.float32), 0.0)
    values = jnp.where(valid, page_values.astype(jnp.float32), 0.0)
    for group in range(p.group):
        at = (row, pl.ds(group, 1))  # dynamic row (leading dim), static group (sublane)
        # Each head's score sits in its own lane of f32[page_size, 128] (seg sums its lanes).
        scores = dot(keys * r["q"][at], r["seg"][...], HIGHEST)
        scores = jnp.where(valid, scores, MASKED)
        max_old = r["m"][at]  # f32[1, 128]
        max_new = jnp.maximum(max_old, jnp.max(scores, axis=0, keepdims=True))
        rescale = jnp.exp(max_old - max_new)
        probs = jnp.exp(scores - max_new)
        r["m"][at] = max_new
        r["l"][at] = rescale * r["l"][at] + jnp.sum(probs, axis=0, keepdims=True)
        # seg_t spreads each head's probability back over that head's lanes.
        per_lane = dot(probs, r["seg_t"][...], HIGHEST)
        weighted = jnp.sum(per_lane * values, axis=0, keepdims=True)
        accumulated = r["acc"][at]  # f32[1, kv]
        r["acc"][at] = accumulated * dot(rescale, r["seg_t"][...], HIGHEST) + weighted
    pl.when(item + p.depth_kv < ctx.n_items)(lambda: kv_read_start(ctx, layer, item + p.depth_kv))
    return carry


def _write_pages_and_normalise(ctx: Body, layer) -> None:
    """Starts each live row's K/V page writes; divides each head's output by its sum."""
    p, r = ctx.plan, ctx.refs
    for row in range(p.batch):
        live = r["pos"][row] >= 0
        pl.when(live)(lambda row=row: each(kv_write_copies(ctx, layer, row), "start"))
        if ctx.counter is not None:
            for _ in range(2):  # one K and one V page
                pl.when(r["pos"][row] >= 0)(
                    lambda: count_dma(ctx.counter, Dma.KV_WRITE, r["kw"].at[0])
                )
        denominator = dot(r["l"][row], r["seg_t"][...], HIGHEST)  # f32[g, kv]
        out = r["acc"][row] / denominator
        for group in range(p.group):
            r["attn"][group, row : row + 1, : p.kv] = out[group : group + 1]


def _o_proj(ctx: Body, b_first) -> None:
    """h += attn @ o_proj, one ring-B row tile per query-head group."""
    p, r = ctx.plan, ctx.refs
    out = jnp.zeros((p.batch, p.hidden_p), jnp.float32)
    for group in range(p.group):
        slot = ctx.ring_b.take(b_first + group)
        out = out + dot(r["attn"][group].astype(p.act_dtype), ctx.matmul_input(r["ring_b"][slot]))
        ctx.ring_b.refill(b_first + group)
    r["h"][...] = r["h"][...] + out
