"""One layer's MLP in the kernel: the dense SwiGLU from the rings, or routed MoE experts."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.megakernel.body import HIGHEST, MASKED, NO_INDEX, Body, Dma, count_dma, dot, rem, rms
from kernels.megakernel.collective import MLP_SLOT, all_reduce
from kernels.megakernel.plan import VecRow


def dense_mlp(ctx: Body, a_first, b_first, vec_slot) -> None:
    """h += SwiGLU MLP of the normed h, one (gate, up, down) tile triple at a time.

    a_first, b_first: i32[] the layer's first load in rings A and B (its q tiles); vec_slot:
    i32[] its slot in the vector ring.
    """
    p, r = ctx.plan, ctx.refs
    normed = rms(r["h"][...], ctx.vec_row(vec_slot, VecRow.LN_MLP, p.hidden_p), p.hidden, p.eps)
    normed = normed[:, : p.hidden].astype(p.act_dtype)
    out = jnp.zeros((p.batch, p.hidden_p), jnp.float32)
    for tile in range(p.ffn_tiles):
        # The MLP's tiles follow the layer's q tiles, k and v in ring A, o_proj's in ring B.
        load_a, load_b = a_first + p.group + 2 + 2 * tile, b_first + p.group + tile
        slot = ctx.ring_a.take(load_a)
        gate = dot(normed, ctx.matmul_input(r["ring_a"][slot]))
        ctx.ring_a.refill(load_a)
        slot = ctx.ring_a.take(load_a + 1)
        up = dot(normed, ctx.matmul_input(r["ring_a"][slot]))
        ctx.ring_a.refill(load_a + 1)
        act = (gate * jax.nn.sigmoid(gate) * up).astype(p.act_dtype)
        slot = ctx.ring_b.take(load_b)
        out = out + dot(act, ctx.matmul_input(r["ring_b"][slot]))
        ctx.ring_b.refill(load_b)
    r["h"][...] = r["h"][...] + all_reduce(ctx, out, MLP_SLOT)


def moe_mlp(ctx: Body, moe_index, vec_slot) -> None:
    """h += routed experts' SwiGLU; only the batch's distinct selected experts are fetched.

    Routing runs in the kernel; the selected experts stream through the expert ring.

    moe_index: i32[] index of this layer among the MoE layers (router and expert arrays);
    vec_slot: i32[] its slot in the vector ring.
    """
    p, r = ctx.plan, ctx.refs
    normed = rms(r["h"][...], ctx.vec_row(vec_slot, VecRow.LN_MLP, p.hidden_p), p.hidden, p.eps)
    normed = normed[:, : p.hidden]  # stays f32 for the router
    expert_lane, expert_weights = _route(ctx, normed, moe_index)
    n_used = _list_used_experts(ctx)
    for used in range(p.depth_e):  # issued as soon as routing is known
        pl.when(used < n_used)(lambda used=used: _expert_start(ctx, moe_index, used))
    normed = normed.astype(p.act_dtype)
    body = partial(_expert, ctx, moe_index, normed, expert_lane, expert_weights, n_used)
    out = lax.fori_loop(0, n_used, body, jnp.zeros((p.batch, p.hidden_p), jnp.float32))
    r["h"][...] = r["h"][...] + out


def _route(ctx: Body, normed, moe_index):
    """Router softmax and top-k of normed: f32[B, D]; marks the used experts in `used_v`.

    Returns:
      (expert_lane, expert_weights): i32[B, Ep] the expert id of each lane; f32[B, Ep] each
      row's routing weight per expert, 0 where not selected and on padding rows.
    """
    p, r = ctx.plan, ctx.refs
    slot = ctx.router.take(moe_index)
    logits = dot(normed, r["router"][slot], HIGHEST)  # f32 router: top-k flips on bf16
    ctx.router.refill(moe_index)
    expert_lane = lax.broadcasted_iota(jnp.int32, (p.batch, p.experts_p), 1)
    logits = jnp.where(expert_lane < p.num_experts, logits, MASKED)
    exp = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    probs = exp / jnp.sum(exp, axis=1, keepdims=True)
    row_index = lax.broadcasted_iota(jnp.int32, (p.batch, 1), 0)
    live = jnp.zeros((p.batch, 1), jnp.bool_)
    for row in range(p.batch):
        live = live | ((row_index == row) & (r["pos"][row] >= 0))
    expert_weights = jnp.zeros((p.batch, p.experts_p), jnp.float32)
    selected = jnp.zeros((p.batch, p.experts_p), jnp.bool_)
    for _ in range(p.top_k):  # ties go to the lower expert id, as lax.top_k
        top_prob = jnp.max(probs, axis=1, keepdims=True)
        top_expert = jnp.min(
            jnp.where(probs == top_prob, expert_lane, NO_INDEX), axis=1, keepdims=True
        )
        is_top = expert_lane == top_expert
        expert_weights = jnp.where(is_top, top_prob, expert_weights)
        selected = selected | is_top
        probs = jnp.where(is_top, -1.0, probs)
    if p.norm_topk_prob:
        expert_weights = expert_weights / jnp.sum(expert_weights, axis=1, keepdims=True)
    expert_weights = jnp.where(live, expert_weights, 0.0)  # padding rows fetch no experts
    used = jnp.max(jnp.where(selected & live, 1, 0), axis=0, keepdims=True)
    r["used_v"][...] = used.astype(jnp.int32)
    return expert_lane, expert_weights


def _list_used_experts(ctx: Body):
    """Compacts the used-expert mask into the SMEM list `elist`; returns i32[] its length."""
    r = ctx.refs
    # The mask is a vector; scalar code can only loop over it from SMEM, hence the DMA.
    copy = pltpu.make_async_copy(r["used_v"], r["used_s"], r["sem_used"].at[0])
    copy.start()
    copy.wait()

    def compact(expert, n):
        r["elist"][n] = expert
        return n + r["used_s"][0, expert]

    return lax.fori_loop(0, ctx.plan.num_experts, compact, jnp.int32(0))


def _expert_copies(ctx: Body, moe_index, used):
    """DMAs of the `used`-th listed expert's gate|up and down tiles into its ring slot."""
    r = ctx.refs
    slot, expert = rem(used, ctx.plan.depth_e), r["elist"][used]
    return (
        pltpu.make_async_copy(
            r["expert_gu_hbm"].at[moe_index, expert], r["egu"].at[slot], r["sem_e"].at[slot, 0]
        ),
        pltpu.make_async_copy(
            r["expert_down_hbm"].at[moe_index, expert],
            r["edown"].at[slot],
            r["sem_e"].at[slot, 1],
        ),
    )


def _expert_start(ctx: Body, moe_index, used) -> None:
    """Starts the `used`-th listed expert's two DMAs."""
    copies = _expert_copies(ctx, moe_index, used)
    for copy, ref in zip(copies, (ctx.refs["egu"], ctx.refs["edown"])):
        copy.start()
        count_dma(ctx.counter, Dma.EXPERTS, ref.at[0])


def _expert(ctx: Body, moe_index, normed, expert_lane, expert_weights, n_used, used, out):
    """fori_loop body: out (f32[B, hidden_p]) += the `used`-th listed expert, weighted.

    normed: [B, D] in the matmul dtype; expert_lane, expert_weights: as `_route` returns.
    """
    p, r = ctx.plan, ctx.refs
    slot = rem(used, p.depth_e)
    for copy in _expert_copies(ctx, moe_index, used):
        copy.wait()
    gate = dot(normed, ctx.matmul_input(r["egu"][slot, 0]))
    up = dot(normed, ctx.matmul_input(r["egu"][slot, 1]))
    act = (gate * jax.nn.sigmoid(gate) * up).astype(p.act_dtype)
    expert_out = dot(act, ctx.matmul_input(r["edown"][slot]))
    # f32[B, 1]: each row's weight for this expert (0 for rows that did not select it).
    weight = jnp.sum(
        jnp.where(expert_lane == r["elist"][used], expert_weights, 0.0), axis=1, keepdims=True
    )
    pl.when(used + p.depth_e < n_used)(lambda: _expert_start(ctx, moe_index, used + p.depth_e))
    return out + weight * expert_out
