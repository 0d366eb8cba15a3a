"""The decode megakernel body: every layer of one decode step for the whole batch in one kernel.

`kernel_body` is what `step.py`'s `pallas_call` runs; its parts live beside it: `body.py`
(`Body`, the rings, the DMA counter), `kv_pages.py`, `attention.py`, `mlp.py`, `vocab.py`.
"""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.megakernel.attention import attention
from kernels.megakernel.body import (
    DMA_KINDS,
    AttentionMasks,
    Body,
    Dma,
    Ring,
    each,
    head_segments,
)
from kernels.megakernel.collective import start_barrier
from kernels.megakernel.kv_pages import kv_prime, kv_write_copies
from kernels.megakernel.mlp import dense_mlp, moe_mlp
from kernels.megakernel.plan import LANES, MegaPlan
from kernels.megakernel.vocab import lm_head_argmax

# DMA_KINDS and Dma are re-exported: `schedule.py` and the tests read them from here.
__all__ = [
    "DMA_KINDS",
    "SCALARS",
    "Dma",
    "input_names",
    "kernel_body",
    "operand_names",
    "output_names",
]


def kernel_body(plan: MegaPlan, *refs) -> None:
    """The pallas_call body; `refs` follow `operand_names(plan)` then `plan.scratch()`."""
    p = plan
    names = operand_names(p) + [s.name for s in p.scratch()]
    assert len(names) == len(refs), (len(names), len(refs))
    r = dict(zip(names, refs))
    counter = r.get("dma_count_out")
    if counter is not None:
        for kind in Dma:
            counter[kind] = 0
    n_items = r["meta"][0]
    router = None
    if p.moe_layers:
        router = Ring(
            r["router_hbm"], r["router"], r["sem_router"], 2, len(p.moe_layers), counter, Dma.ROUTER
        )
    ctx = Body(
        plan=p,
        refs=r,
        counter=counter,
        n_items=n_items,
        ring_a=Ring(
            r["ring_a_hbm"], r["ring_a"], r["sem_a"], p.depth_a, p.n_a, counter, Dma.RING_A
        ),
        ring_b=Ring(
            r["ring_b_hbm"], r["ring_b"], r["sem_b"], p.depth_b, p.n_b, counter, Dma.RING_B
        ),
        vecs=Ring(r["vec_hbm"], r["vec"], r["sem_vec"], 2, p.num_layers, counter, Dma.VEC),
        router=router,
    )
    r["seg"][...] = head_segments(p, p.kv, LANES, False)
    r["seg_t"][...] = head_segments(p, LANES, p.kv, True)
    r["attn"][...] = jnp.zeros(r["attn"].shape, jnp.float32)
    # A block's rows past its row's pages are never written by a DMA: zero, not VMEM garbage
    # (a NaN there times a probability of 0 is still NaN); later they hold older pages.
    for buf in ("kbuf", "vbuf"):
        r[buf][...] = jnp.zeros(r[buf].shape, p.kv_dtype)
    r["h"][...] = r["h0"][...]
    ctx.ring_a.prime()
    ctx.ring_b.prime()
    ctx.vecs.start(0)
    if router is not None:
        router.prime()
    kv_prime(ctx, 0)
    start_barrier(ctx)  # after the first loads are in flight: they overlap the wait
    lane = lax.broadcasted_iota(jnp.int32, (p.batch, p.ta), 1)
    ctx.masks = AttentionMasks(
        first_half_of_head=(lane & (p.head_dim - 1)) < p.head_dim // 2,
        head_seg=head_segments(p, p.ta, LANES, False),
        head_seg_t=head_segments(p, LANES, p.ta, True),
        page_row=lax.broadcasted_iota(jnp.int32, (p.page_size, p.kv_row), 0),
        block_key=lax.broadcasted_iota(jnp.int32, (1, p.block_width), 1),
        head_dim=p.head_dim,
    )
    # One fori_loop per run of same-kind layers: a MoE model's dense layers share the code.
    for moe, first_layer, count in p.segments:
        lax.fori_loop(0, count, partial(_decoder_layer, ctx, moe, first_layer), 0)
    lm_head_argmax(ctx)


def _decoder_layer(ctx: Body, moe: bool, first_layer: int, index, carry):
    """fori_loop body: layer `first_layer + index` of a run of layers of one kind."""
    p = ctx.plan
    a_per_layer, b_per_layer = p.a_per_layer(moe), p.b_per_layer(moe)
    layer = first_layer + index
    vec_slot = ctx.vecs.take(layer)
    pl.when(layer + 1 < p.num_layers)(lambda: ctx.vecs.start(layer + 1))
    a_first = p.a_base(first_layer) + index * a_per_layer
    b_first = p.b_base(first_layer) + index * b_per_layer
    attention(ctx, layer, a_first, b_first, vec_slot)
    if moe:
        moe_mlp(ctx, p.moe_index(first_layer) + index, vec_slot)
    else:
        dense_mlp(ctx, a_first, b_first, vec_slot)
    # The page writes ran under the MLP; the next layer refills the same kw/vw buffers (and
    # semaphores), so they must have landed.
    for row in range(p.batch):
        pl.when(ctx.refs["pos"][row] >= 0)(
            lambda row=row: each(kv_write_copies(ctx, layer, row), "wait")
        )
    return carry


# Scalar-prefetch operands (SMEM), first among the kernel's refs; `step_inputs` builds them.
SCALARS = ("pos", "wpage", "wslot", "wlast", "it_seq", "it_page", "it_idx", "it_cnt", "meta")


def input_names(plan: MegaPlan) -> list[str]:
    """The pallas_call's array inputs, in order (`_hbm` ones stay in HBM)."""
    names = ["h0", "cos", "sin", "final_norm", "ring_a_hbm", "ring_b_hbm", "vec_hbm"]
    if plan.moe_layers:
        names += ["router_hbm", "expert_gu_hbm", "expert_down_hbm"]
    return names + ["k_hbm", "v_hbm"]


def output_names(plan: MegaPlan) -> list[str]:
    """The pallas_call's outputs, in order (k_out, v_out alias the pool inputs; under tp the
    new pages leave as k_pages, v_pages instead, `plan.pages_out`)."""
    names = ["tokens"] + (["logits"] if plan.emit_logits else [])
    names += ["best"] if plan.tp > 1 else []
    names += ["k_pages", "v_pages"] if plan.pages_out else ["k_out", "v_out"]
    return names + (["dma_count_out"] if plan.count_dmas else [])


def operand_names(plan: MegaPlan) -> list[str]:
    """Every kernel operand, in the order `kernel_body` receives the refs (before scratch)."""
    return list(SCALARS) + input_names(plan) + output_names(plan)
