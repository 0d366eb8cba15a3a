"""The kernel's tensor-parallel collectives: a start barrier and h's all-reduce by remote DMA."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.megakernel.body import Body, each, rem
from kernels.megakernel.plan import MegaPlan, round_up

AXIS = "tp"  # the mesh axis the shards live on (`kernels.tp_llama.AXIS`)
# The one-shot all-reduce's buffer slot per kind: attention's o_proj, the MLP's down_proj.
ATTENTION_SLOT, MLP_SLOT = 0, 1
# Largest one-shot landing buffer (2 slots x tp x f32[B, hidden_p]): beyond it the all-reduce
# runs in two phases, whose buffers and ICI bytes are 1/tp-th per shard.
ONE_SHOT_MAX_BYTES = 4 * 2**20


def choose_all_reduce(tp: int, batch: int, hidden_p: int) -> str:
    """ "one_shot" (one round, each shard sends its whole partial to every peer: the fewest
    rounds, for latency-bound small batches) or "two_phase" (a reduce-scatter then an
    all-gather: two rounds, 2 (tp-1)/tp of the bytes of a ring instead of tp - 1 times the
    partial, and 1/tp-th the VMEM)."""
    rows = round_up(batch, 8)  # f32 sublane tiles
    one_shot = 2 * tp * rows * hidden_p * 4
    return "one_shot" if one_shot <= ONE_SHOT_MAX_BYTES else "two_phase"


def start_barrier(ctx: Body) -> None:
    """Waits until every shard has entered the kernel, before any remote DMA lands in a
    shard's VMEM (its scratch exists only while it runs this kernel)."""
    p = ctx.plan
    if p.tp == 1:
        return
    me = lax.axis_index(AXIS)
    sem = pltpu.get_barrier_semaphore()
    for k in range(1, p.tp):
        pl.semaphore_signal(sem, 1, device_id={AXIS: rem(me + k, p.tp)})
    pl.semaphore_wait(sem, p.tp - 1)


def _exchange(p: MegaPlan, me, refs, sem, row: int) -> None:
    """One round: a DMA to every peer (`refs(peer)` -> (local src, the peer's dst)), then
    waits for the sends and for the tp - 1 blocks of the same size landing here. sem: the
    DMA semaphores [2, 2]; `row` holds this round's (send, receive) pair."""
    copies = [
        pltpu.make_async_remote_copy(
            *refs(rem(me + k, p.tp)),
            sem.at[row, 0],
            sem.at[row, 1],
            device_id={AXIS: rem(me + k, p.tp)},
        )
        for k in range(1, p.tp)
    ]
    each(copies, "start")
    each(copies, "wait_send")
    each(copies, "wait_recv")


def all_reduce(ctx: Body, partial, slot: int):
    """The sum over the tp shards of a row-parallel matmul's partial f32[B, hidden_p], equal
    on every shard (each sum is formed in shard order, or formed once and broadcast).

    The weight rings keep their next loads in flight meanwhile, so the rounds overlap the next
    tiles' HBM DMAs. Buffer reuse needs no second barrier: a shard can only write into a
    peer's buffer for reduction n + 1 (two_phase) or n + 2 (one_shot's slot) after receiving
    that peer's blocks of a later round, which the peer sends only after it has read the
    buffer (the interpreter's race check agrees, tests/test_megakernel_tp.py).
    """
    p = ctx.plan
    if p.tp == 1:
        return partial
    if p.all_reduce == "one_shot":
        return _one_shot(ctx, partial, slot)
    return _two_phase(ctx, partial)


def _one_shot(ctx: Body, partial, slot: int):
    """Each shard copies its whole partial into `ar_buf[slot, me]` on every peer; every shard
    adds the tp blocks in shard order."""
    p, r = ctx.plan, ctx.refs
    me = lax.axis_index(AXIS)
    buf, sem = r["ar_buf"], r["sem_ar"]
    buf[slot, me] = partial
    _exchange(p, me, lambda peer: (buf.at[slot, me], buf.at[slot, me]), sem, slot)
    total = buf[slot, 0]
    for shard in range(1, p.tp):
        total = total + buf[slot, shard]
    return total


def _two_phase(ctx: Body, partial):
    """Reduce-scatter: shard j receives every peer's column block j (`ar_rs[peer]`) and adds
    them in shard order; all-gather: it sends that sum to every peer's `ar_ag[j]`."""
    p, r = ctx.plan, ctx.refs
    me = lax.axis_index(AXIS)
    src, rs, ag, sem = r["ar_src"], r["ar_rs"], r["ar_ag"], r["sem_ar"]
    cw = src.shape[-1]
    pad = p.tp * cw - p.hidden_p
    if pad:
        partial = jnp.concatenate([partial, jnp.zeros((p.batch, pad), jnp.float32)], axis=1)
    for j in range(p.tp):
        src[j] = partial[:, j * cw : (j + 1) * cw]
    rs[me] = src[me]
    _exchange(p, me, lambda peer: (src.at[peer], rs.at[me]), sem, 0)
    reduced = rs[0]
    for shard in range(1, p.tp):
        reduced = reduced + rs[shard]
    ag[me] = reduced
    _exchange(p, me, lambda peer: (ag.at[me], ag.at[me]), sem, 1)
    whole = jnp.concatenate([ag[j] for j in range(p.tp)], axis=1)
    return whole[:, : p.hidden_p]


def vocab_limit(plan: MegaPlan):
    """Columns of this shard's lm_head that are real vocabulary (the rest are padding)."""
    if plan.tp == 1:
        return plan.vocab
    left = plan.vocab_global - lax.axis_index(AXIS) * plan.vocab
    return jnp.minimum(plan.vocab, left)
