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
from kernels.megakernel.collective import ATTENTION_SLOT, all_reduce
from kernels.megakernel.kv_pages import kv_prime, kv_read_start, kv_read_wait, kv_write_copies
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
    lax.fori_loop(0, ctx.n_items, partial(_attend_block, ctx, layer), 0)
    # The next layer's first pages load while this layer's o_proj and MLP stream.
    pl.when(layer + 1 < p.num_layers)(lambda: kv_prime(ctx, layer + 1))
    _write_pages_and_normalise(ctx, layer)
    _o_proj(ctx, b_first)


def _project_qkv(ctx: Body, a_first, vec_slot):
    """q of every query-head group into the `q` scratch; returns the new tokens' k and v.

    Returns:
      (keys, values): f32[B, kv_row] each (a pool row: lanes past kv are zero), rounded to
      the pool's dtype.
    """
    p, r = ctx.plan, ctx.refs
    ln_attn = ctx.vec_row(vec_slot, VecRow.LN_ATTN, p.hidden_p)
    normed = rms(r["h"][...], ln_attn, p.hidden, p.eps)[:, : p.hidden].astype(p.act_dtype)

    def project(tile):  # f32[B, ta]: ring A load a_first + tile (q group, k or v)
        slot = ctx.ring_a.take(a_first + tile)
        y = dot(normed, ctx.matmul_input(r["ring_a"][slot]))
        ctx.ring_a.refill(a_first + tile)
        if p.qkv_bias:
            y = y + ctx.vec_row(vec_slot, VecRow.QKV_BIAS + tile, p.ta)
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
    # The RoPE tables and the v tile's padding columns are zero past kv: so are these lanes.
    keys = _rope(ctx, keys)[:, : p.kv_row].astype(p.kv_dtype).astype(jnp.float32)
    values = project(p.group + 1)[:, : p.kv_row].astype(p.kv_dtype).astype(jnp.float32)
    return keys, values


def _start_online_softmax(ctx: Body, keys, values) -> None:
    """Puts each row's new K/V (f32[B, kv_row] each) into its write page and starts its
    softmax.

    The online softmax starts from the new token itself: every row has one finite score
    before any block is read, so masked keys can never divide by zero. Once per row and
    layer, each head's q.k sum goes through the 0/1 head-segment matrices (f32, exact); the
    per-key work in `_attend_block` has none.
    """
    p, r = ctx.plan, ctx.refs
    page_row = ctx.masks.page_row
    for row in range(p.batch):
        key, value = keys[row : row + 1], values[row : row + 1]  # f32[1, kv_row]
        r["kw"][row] = jnp.where(page_row == r["wslot"][row], key, 0.0).astype(p.kv_dtype)
        r["vw"][row] = jnp.where(page_row == r["wslot"][row], value, 0.0).astype(p.kv_dtype)
        key, value = key[:, : p.kv], value[:, : p.kv]
        # All of the row's groups at once: f32[g, kv] on sublanes, each head's score
        # repeated over its lanes.
        score = dot(r["q"][row] * key, r["seg"][...], HIGHEST)
        r["m"][row] = dot(score, r["seg_t"][...], HIGHEST)
        r["l"][row] = jnp.ones((p.group, p.kv), jnp.float32)
        r["acc"][row] = jnp.broadcast_to(value, (p.group, p.kv))


# Contract the last dims of both sides: scores = q @ k.T without materialising k.T.
_NT = (((1,), (1,)), ((), ()))


def _attend_block(ctx: Body, layer, item, carry):
    """fori_loop body: folds read item `item` (one block of one row's pages) into that row's
    online softmax, one head at a time: scores f32[g, block] = q_h @ K_h.T and p @ V_h, each
    one matmul over the block's keys."""
    p, r = ctx.plan, ctx.refs
    masks = ctx.masks
    slot = rem(item, p.depth_kv)
    kv_read_wait(ctx, layer, item)
    row, block = r["it_seq"][item], r["it_idx"][item]
    first_page, count = block * p.pages_per_block, r["it_cnt"][item]
    for j in range(p.pages_per_block):
        page = pl.ds(j * p.page_size, p.page_size)

        # Only a page the block read: a row whose new token opens a page (wlast one past its
        # pages) keeps zeros there, not the slot's leftovers from another row's block.
        @pl.when((first_page + j == r["wlast"][row]) & (j < count))
        def _merge(page=page):  # the page this step rewrites keeps every other row as it was
            keep = masks.page_row == r["wslot"][row]
            r["kw"][row] = jnp.where(keep, r["kw"][row], r["kbuf"][slot, page])
            r["vw"][row] = jnp.where(keep, r["vw"][row], r["vbuf"][slot, page])

    # Only tokens before the row's position count: the new one is already in the softmax.
    # Rows of the block past the row's pages hold older blocks' (finite) keys: masked too.
    valid = first_page * p.page_size + masks.block_key < r["pos"][row]  # bool[1, block]
    chunk = max(LANES, p.head_dim)  # whole heads, lane-aligned
    for c in range(0, p.kv, chunk):
        lanes = pl.ds(c, min(chunk, p.kv - c))
        keys = ctx.matmul_input(r["kbuf"][slot, :, lanes])  # [block, w]
        values = ctx.matmul_input(r["vbuf"][slot, :, lanes])
        q = r["q"][row, :, lanes]  # f32[g, w], pre-scaled
        m_old, l_old, acc = r["m"][row, :, lanes], r["l"][row, :, lanes], r["acc"][row, :, lanes]
        heads = masks.chunk_heads(q.shape[-1])
        for head in heads:  # head: bool[1, w] its lanes, or None when it fills the chunk
            qh = q if head is None else jnp.where(head, q, 0.0)
            scores = lax.dot_general(
                ctx.matmul_input(qh), keys, _NT, preferred_element_type=jnp.float32
            )
            scores = jnp.where(valid, scores, MASKED)  # f32[g, block]
            old = _head_value(m_old, head)
            new = jnp.maximum(old, jnp.max(scores, axis=1, keepdims=True))  # f32[g, 1]
            probs = jnp.exp(scores - new)  # masked keys: exp(-1e30 - finite) = 0
            rescale = jnp.exp(old - new)
            total = rescale * _head_value(l_old, head) + jnp.sum(probs, axis=1, keepdims=True)
            pv = dot(ctx.matmul_input(probs), values)  # f32[g, w]
            if head is None:
                m_old, l_old = (jnp.broadcast_to(x, acc.shape) for x in (new, total))
                acc = acc * rescale + pv
            else:
                m_old = jnp.where(head, new, m_old)
                l_old = jnp.where(head, total, l_old)
                acc = jnp.where(head, acc * rescale + pv, acc)
        r["m"][row, :, lanes], r["l"][row, :, lanes], r["acc"][row, :, lanes] = m_old, l_old, acc
    pl.when(item + p.depth_kv < ctx.n_items)(lambda: kv_read_start(ctx, layer, item + p.depth_kv))
    return carry


def _head_value(x, head):
    """A head's value of x: f32[g, w] repeated over the head's lanes -> f32[g, 1]."""
    if head is None:
        return x[:, :1]
    return jnp.max(jnp.where(head, x, MASKED), axis=1, keepdims=True)


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
        out = r["acc"][row] / r["l"][row]  # f32[g, kv]: each head's sum over its lanes
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
    r["h"][...] = r["h"][...] + all_reduce(ctx, out, ATTENTION_SLOT)
