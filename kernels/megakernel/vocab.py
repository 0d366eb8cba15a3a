"""The kernel's lm_head: final norm, vocab tiles from ring A, running greedy argmax."""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.megakernel.body import NO_INDEX, Body, Dma, count_dma, dot, rem, rms
from kernels.megakernel.collective import vocab_limit
from kernels.megakernel.plan import LANES


def lm_head_argmax(ctx: Body) -> None:
    """Final norm, then lm_head vocab tiles from ring A with a running greedy argmax."""
    p, r = ctx.plan, ctx.refs
    normed = rms(r["h"][...], r["final_norm"][...], p.hidden, p.eps)[:, : p.hidden]
    normed = normed.astype(p.act_dtype)
    lane = lax.broadcasted_iota(jnp.int32, (p.batch, p.ta), 1)
    init = (jnp.full((p.batch, 1), -jnp.inf, jnp.float32), jnp.zeros((p.batch, 1), jnp.int32))
    limit = vocab_limit(p)
    body = partial(vocab_tile, ctx, normed, lane, limit)
    best_logit, best = lax.fori_loop(0, p.vocab_tiles, body, init)
    r["tokens"][...] = jnp.broadcast_to(best, (p.batch, LANES))
    if p.tp > 1:  # the shards' winners meet in XLA after the kernel (`tp.tp_megakernel_step`)
        r["best"][...] = jnp.broadcast_to(best_logit, (p.batch, LANES))
    if p.emit_logits:
        # The last tiles' logits DMAs must land before the kernel ends.
        for tile in range(max(0, p.vocab_tiles - 2), p.vocab_tiles):
            _logits_copy(ctx, tile).wait()


def _logits_copy(ctx: Body, tile):
    """The DMA of tile `tile`'s logits from its staging slot (tile % 2) to the HBM output."""
    r = ctx.refs
    slot = rem(tile, 2)
    return pltpu.make_async_copy(
        r["logits_stage"].at[slot], r["logits"].at[tile], r["sem_logits"].at[slot]
    )


def _emit_logits(ctx: Body, tile, logits) -> None:
    """Stages tile `tile`'s logits (f32[B, ta]) and starts their DMA to HBM.

    The staging block has two slots: tile t reuses tile t-2's slot once that DMA landed.
    """
    pl.when(tile >= 2)(lambda: _logits_copy(ctx, tile - 2).wait())
    ctx.refs["logits_stage"][rem(tile, 2)] = logits
    _logits_copy(ctx, tile).start()
    count_dma(ctx.counter, Dma.LOGITS, ctx.refs["logits_stage"].at[0])


def vocab_tile(ctx: Body, normed, lane, limit, tile, carry):
    """fori_loop body: one lm_head tile's logits, folded into the running (max, argmax).

    normed: [B, D] final-normed h in the matmul dtype; lane: i32[B, ta] lane index; limit:
    this shard's real vocabulary columns (int, or i32[] under tp; the rest are masked);
    carry: (f32[B, 1] best logit so far, i32[B, 1] its vocab index).
    """
    p, r = ctx.plan, ctx.refs
    best_logit, best_index = carry
    load = p.lm_base + tile
    slot = ctx.ring_a.take(load)
    logits = dot(normed, ctx.matmul_input(r["ring_a"][slot]))  # f32[B, ta]
    ctx.ring_a.refill(load)
    column = tile * p.ta + lane  # the vocab index of each lane
    logits = jnp.where(column < limit, logits, -jnp.inf)
    if p.emit_logits:
        _emit_logits(ctx, tile, logits)
    tile_max = jnp.max(logits, axis=1, keepdims=True)
    tile_argmax = jnp.min(jnp.where(logits == tile_max, column, NO_INDEX), axis=1, keepdims=True)
    better = tile_max > best_logit  # strict: the earlier tile keeps ties (first index wins)
    return jnp.where(better, tile_max, best_logit), jnp.where(better, tile_argmax, best_index)
