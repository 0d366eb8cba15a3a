"""What every part of the kernel body shares: `Body`, the DMA rings and counter, small math."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.megakernel.plan import MegaPlan, VecRow


class Dma(IntEnum):
    """Kinds of DMA, indexing the optional per-kind byte counter (`plan.count_dmas`)."""

    RING_A = 0
    RING_B = 1
    VEC = 2
    ROUTER = 3
    EXPERTS = 4
    KV_READ = 5
    KV_WRITE = 6
    LOGITS = 7  # lm_head logits tiles, VMEM staging -> the HBM logits output


# The counter's keys by name, as `schedule.dma_bytes` returns them.
DMA_KINDS = tuple(kind.name.lower() for kind in Dma)


# f32 inputs at full precision: the head-segment sums and the router must not be rounded to
# bf16 passes on the MXU (a router logit rounded to bf16 can flip a top-k choice).
HIGHEST = lax.Precision.HIGHEST
# A large finite negative, not -inf: a running max over masked scores stays finite, so
# max_old - max_new is never inf - inf (NaN).
MASKED = -1e30
# Larger than any lane or vocab index: the min over "index where value == max" ignores it.
NO_INDEX = 1 << 30


def dot(a, b, precision=None):
    """a @ b with f32 accumulation (bf16 or f32 inputs)."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def rem(k, n: int):
    """k % n for a Python int (static) or a traced i32 (lax.rem, which Mosaic lowers)."""
    return k % n if isinstance(k, int) else lax.rem(k, jnp.int32(n))


@dataclass
class Ring:
    """A ring of `depth` VMEM slots streaming hbm[0], hbm[1], ... hbm[n-1] in that order.

    Load k lives in slot k % depth; consuming k (take, use, refill) issues load k + depth, so
    `depth - 1` loads stay in flight while one is used, across layer boundaries and on into
    the lm_head tiles, because the HBM array is stored in consumption order.
    """

    hbm: Any  # HBM ref [n, ...]: the loads, in consumption order
    buf: Any  # VMEM ref [depth, ...]: the slots
    sem: Any  # DMA semaphores [depth], one per slot
    depth: int
    n: int  # number of loads
    counter: Any  # SMEM i32[8] DMA byte counter, or None
    kind: Dma  # this ring's counter entry

    def _copy(self, load, slot):
        """The DMA of load `load` (i32) into slot `slot`."""
        return pltpu.make_async_copy(self.hbm.at[load], self.buf.at[slot], self.sem.at[slot])

    def start(self, load):
        """Issues load `load` into its slot."""
        self._copy(load, rem(load, self.depth)).start()
        count_dma(self.counter, self.kind, self.buf.at[0])

    def prime(self):
        """Issues the first `depth` loads (before the first take)."""
        for load in range(min(self.depth, self.n)):
            self.start(load)

    def take(self, load):
        """Waits for load `load`; returns its slot (i32) to read the tile from `buf`."""
        slot = rem(load, self.depth)
        self._copy(load, slot).wait()
        return slot

    def refill(self, load):
        """After load `load` is used: issues load `load + depth` into its slot, if any."""
        next_load = load + self.depth
        if isinstance(next_load, int):
            if next_load < self.n:
                self.start(next_load)
        else:
            pl.when(next_load < self.n)(lambda: self.start(next_load))


def count_dma(counter, kind: Dma, ref) -> None:
    """Adds the bytes of one DMA of `ref`'s shape to the in-kernel counter (tests only)."""
    if counter is None:
        return
    nbytes = ref.dtype.itemsize
    for size in ref.shape:
        nbytes *= size
    counter[kind] = counter[kind] + nbytes


def each(copies, method: str) -> None:
    """Calls `method` ("start" or "wait") on each async copy."""
    for copy in copies:
        getattr(copy, method)()


def rms(x, weight, n: int, eps: float):
    """RMSNorm over the first n lanes of x: f32[B, W] (the padding lanes are zero)."""
    var = jnp.sum(x * x, axis=-1, keepdims=True) * (1.0 / n)
    return weight * (x * lax.rsqrt(var + eps))


def head_segments(plan: MegaPlan, rows: int, cols: int, transpose: bool):
    """0/1 head-segment matrix f32[rows, cols]: seg[j, h] = 1 when K/V lane j is in kv head h.

    transpose: seg[h, j] instead. Per-head sums become one small matmul, so no head is ever
    sliced out of its lanes (head_dim 64 packs two heads per 128 lanes).
    """
    head_shift = plan.head_dim.bit_length() - 1  # head_dim is a power of two (make_plan)
    a = lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    c = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    lane, head = (c, a) if transpose else (a, c)
    return ((lane >> head_shift == head) & (lane < plan.kv)).astype(jnp.float32)


@dataclass
class AttentionMasks:
    """Constant masks of the attention code, built once before the layer loop."""

    first_half_of_head: Any  # bool[B, ta]: lane j is in the first half of its head
    head_seg: Any  # f32[ta, 128]: `head_segments` over the padded K/V width
    head_seg_t: Any  # f32[128, ta]: its transpose
    page_row: Any  # i32[page_size, kv_row]: the row (token slot) index within a page
    block_key: Any  # i32[1, block_width]: the key index within a K/V read block
    head_dim: int

    def chunk_heads(self, width: int) -> list:
        """The heads of a `width`-lane chunk of a K/V row: [None] when one head fills it, else
        one bool[1, width] lane mask per head (head_dim 64 packs two heads per 128 lanes)."""
        if width <= self.head_dim:
            return [None]
        lane = lax.broadcasted_iota(jnp.int32, (1, width), 1)
        return [lane // self.head_dim == h for h in range(width // self.head_dim)]


@dataclass
class Body:
    """What every part of the kernel body shares: the plan, the refs by name, the rings."""

    plan: MegaPlan
    refs: dict[str, Any]  # operand and scratch refs, by `operand_names` / `plan.scratch()`
    counter: Any  # SMEM i32[8] DMA byte counter by `Dma` kind, or None
    n_items: Any  # i32[] number of (row, page) K/V read items (`step_inputs`'s "meta")
    ring_a: Ring
    ring_b: Ring
    vecs: Ring
    router: Ring | None
    masks: AttentionMasks | None = None

    def matmul_input(self, tile):
        """A weight tile in the matmul input dtype (`plan.act_dtype`; f32 accumulation).

        bf16 on the MXU; `act_dtype=f32` upcasts each tile in VMEM instead, so tests can check
        the kernel's logic to f32 precision.
        """
        dtype = self.plan.act_dtype
        return tile if tile.dtype == dtype else tile.astype(dtype)

    def vec_row(self, slot, row: VecRow, width: int):
        """f32[1, width]: one row of the current layer's vector block in vector-ring `slot`."""
        return self.refs["vec"][slot, row : row + 1, :width]
