"""The kernel's lm_head: final norm, vocab tiles from ring A, running greedy argmax."""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
from jax import lax

from kernels.megakernel.body import NO_INDEX, Body, dot, rms
from kernels.megakernel.plan import LANES


def lm_head_argmax(ctx: Body) -> None:
    """Final norm, then lm_head vocab tiles from ring A with a running greedy argmax."""
    p, r = ctx.plan, ctx.refs
    normed = rms(r["h"][...], r["final_norm"][...], p.hidden, p.eps)[:, : p.hidden]
    normed = normed.astype(p.act_dtype)
    lane = lax.broadcasted_iota(jnp.int32, (p.batch, p.ta), 1)
    init = (jnp.full((p.batch, 1), -jnp.inf, jnp.float32), jnp.zeros((p.batch, 1), jnp.int32))
    _, best = lax.fori_loop(0, p.vocab_tiles, partial(vocab_tile, ctx, normed, lane), init)
    r["tokens"][...] = jnp.broadcast_to(best, (p.batch, LANES))


def vocab_tile(ctx: Body, normed, lane, tile, carry):
    """fori_loop body: one lm_head tile's logits, folded into the running (max, argmax).

    normed: [B, D] final-normed h in the matmul dtype; lane: i32[B, ta] lane index;
    carry: (f32[B, 1] best logit so far, i32[B, 1] its vocab index).
    """
    p, r = ctx.plan, ctx.refs
    best_logit, best_index = carry
    load = p.lm_base + tile
    slot = ctx.ring_a.take(load)
    logits = dot(normed, ctx.matmul_input(r["ring_a"][slot]))  # f32[B, ta]
    ctx.ring_a.refill(load)
    column = tile * p.ta + lane  # the vocab index of each lane
    logits = jnp.where(column < p.vocab, logits, -jnp.inf)
    if p.emit_logits:
        r["logits"][tile] = logits
    tile_max = jnp.max(logits, axis=1, keepdims=True)
    tile_argmax = jnp.min(jnp.where(logits == tile_max, column, NO_INDEX), axis=1, keepdims=True)
    better = tile_max > best_logit  # strict: the earlier tile keeps ties (first index wins)
    return jnp.where(better, tile_max, best_logit), jnp.where(better, tile_argmax, best_index)
