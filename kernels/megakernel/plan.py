"""Static shape plan of the decode megakernel: tiles, ring depths, scratch shapes, VMEM budget."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any

import jax.numpy as jnp
import numpy as np

# Usable VMEM per TensorCore on TPU v7 (tpu7x): the AOT compiler refuses scratch beyond
# 64 MiB (`RESOURCE_EXHAUSTED ... size=67108864`, PLATFORM.md). Plans leave `VMEM_HEADROOM`
# for Mosaic's own internal scratch and the matmul temporaries it spills.
VMEM_BYTES = 64 * 2**20
VMEM_HEADROOM = 8 * 2**20
LANES = 128


class VecRow(IntEnum):
    """Rows of one layer's block in the per-layer vector ring (`pack_megakernel` fills them)."""

    LN_ATTN = 0
    LN_MLP = 1
    Q_NORM = 2
    K_NORM = 3
    QKV_BIAS = 4  # Qwen2: the bias of ring-A tile j of the layer (q groups, k, v) is row 4 + j


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def padded_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes a VMEM buffer really occupies: last dim padded to 128 lanes, the one before to
    the sublane tile (8 rows of 32 bits: 8 for f32/i32, 16 for bf16)."""
    item = np.dtype(dtype).itemsize
    if len(shape) == 1:
        shape = (1, *shape)
    sub = 8 * max(1, 4 // item)
    lead = int(np.prod(shape[:-2], dtype=np.int64))
    return lead * round_up(shape[-2], sub) * round_up(shape[-1], LANES) * item


@dataclass(frozen=True)
class Scratch:
    """One scratch buffer of the kernel; `space` is vmem, smem or sem (DMA semaphores)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    space: str = "vmem"

    @property
    def vmem_bytes(self) -> int:
        return padded_bytes(self.shape, self.dtype) if self.space == "vmem" else 0


@dataclass(frozen=True)
class MegaPlan:
    """Every static size the kernel, the weight packer and the DMA accounting share.

    Weights are streamed as tiles of two shapes through two rings, each stored in HBM in the
    exact order the kernel consumes them (so one ring runs from layer 0 through lm_head):
      ring A, [hidden, ta]: per layer the q tiles (one per query-head group g: the heads
        h*G+g of every kv head h, which makes q lane-aligned with the K/V pages), k, v, then
        gate/up tiles of the dense MLP; after the last layer the lm_head vocab tiles.
      ring B, [ta, hidden_p]: per layer the o_proj row tiles (one per group), then the
        down_proj row tiles.
    """

    num_layers: int
    hidden: int  # D of the model
    hidden_p: int  # D padded to lanes: the residual stream is f32[B, hidden_p]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv: int  # Hkv * head_dim: lanes of one K/V row in a page
    ta: int  # tile width of ring A = rows of ring B = kv padded to lanes
    # Lanes of a pool row (`kv_cache.pool_row`): kv, or ta where the pool pads its rows to
    # lanes (TPU); the page buffers take the pool's rows whole, padding included.
    kv_row: int
    ffn_tiles: int  # dense MLP gate (and up, and down) tiles per layer
    vocab: int
    vocab_tiles: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_inter_p: int  # expert intermediate size padded to lanes
    qk_norm: bool
    eps: float
    batch: int
    page_size: int
    pages_per_seq: int
    qkv_bias: bool = False  # q/k/v projection biases (Qwen2), vector rows QKV_BIAS + tile
    depth_a: int = 3
    depth_b: int = 2
    depth_kv: int = 2  # K/V key blocks in flight: the next block's page DMAs under this one
    # Keys per attention block: pages are gathered into one [block, kv] buffer so each
    # head's scores and values are one matmul over hundreds of keys (16-key pages with f32
    # segment matmuls were ~65k loop iterations per Llama-3.1-8B step at batch 8, 4k).
    block_keys: int = 256
    depth_e: int = 2
    weight_dtype: Any = jnp.bfloat16
    kv_dtype: Any = jnp.bfloat16
    act_dtype: Any = jnp.bfloat16  # matmul input dtype; float32 = exactness mode for tests
    emit_logits: bool = True
    count_dmas: bool = False
    # Tensor-parallel shards (`kernels.megakernel.tp`): this plan is one shard's (its heads,
    # intermediate columns and `vocab` lm_head columns); the kernel all-reduces h's partial
    # sums over the mesh axis "tp" by remote DMA. vocab_global: the model's vocabulary, which
    # masks the last shard's padding columns (0: the same as vocab).
    tp: int = 1
    vocab_global: int = 0
    all_reduce: str = "one_shot"  # or "two_phase" (`collective.all_reduce`)
    # The scoped-VMEM limit handed to the compiler (`vmem_limit_bytes`): all of VMEM, since
    # Mosaic's internal scratch comes on top of vmem_bytes(); tests lower it to provoke a
    # compiler VMEM refusal.
    vmem_limit: int = VMEM_BYTES

    # -- derived sizes --------------------------------------------------------------------
    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def pages_out(self) -> bool:
        """The new-token pages leave as outputs instead of being written into the aliased pool:
        XLA copies every aliased operand of a kernel that communicates (remote DMAs), which
        for the pool is two pool copies per step (measured on tpu7x: 1.34 GB of temp for
        Llama-3.1-70B tp=8 at batch 8, 4k); a read-only pool and a scatter after need none."""
        return self.tp > 1

    @property
    def reduce_block_cols(self) -> int:
        """two_phase all-reduce: columns of h per shard's block (lane-aligned, zero-padded)."""
        return round_up(-(-self.hidden_p // self.tp), LANES)

    @property
    def experts_p(self) -> int:
        return round_up(max(self.num_experts, 1), LANES)

    @property
    def pages_per_block(self) -> int:
        """Pages per K/V read block (each one DMA into its rows of the block buffer)."""
        return max(1, min(self.pages_per_seq, self.block_keys // self.page_size))

    @property
    def block_width(self) -> int:
        """Keys per K/V read block."""
        return self.pages_per_block * self.page_size

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.pages_per_seq // self.pages_per_block)

    @property
    def is_moe(self) -> tuple[bool, ...]:
        return tuple(i in self.moe_layers for i in range(self.num_layers))

    @property
    def segments(self) -> tuple[tuple[bool, int, int], ...]:
        """(is_moe, first layer, count) runs of consecutive layers of one kind."""
        out: list[list] = []
        for i, m in enumerate(self.is_moe):
            if out and out[-1][0] == m:
                out[-1][2] += 1
            else:
                out.append([m, i, 1])
        return tuple(tuple(s) for s in out)

    def a_per_layer(self, moe: bool) -> int:
        return self.group + 2 + (0 if moe else 2 * self.ffn_tiles)

    def b_per_layer(self, moe: bool) -> int:
        return self.group + (0 if moe else self.ffn_tiles)

    def a_base(self, layer: int) -> int:
        return sum(self.a_per_layer(m) for m in self.is_moe[:layer])

    def b_base(self, layer: int) -> int:
        return sum(self.b_per_layer(m) for m in self.is_moe[:layer])

    def moe_index(self, layer: int) -> int:
        return sum(self.is_moe[:layer])

    @property
    def lm_base(self) -> int:
        return self.a_base(self.num_layers)

    @property
    def n_a(self) -> int:
        return self.lm_base + self.vocab_tiles

    @property
    def n_b(self) -> int:
        return self.b_base(self.num_layers)

    @property
    def vec_rows(self) -> int:
        """The `VecRow`s (and the G + 2 bias rows), padded to the f32 sublane tile."""
        return round_up(VecRow.QKV_BIAS + (self.group + 2 if self.qkv_bias else 0), 8)

    @property
    def vec_width(self) -> int:
        return max(self.hidden_p, self.ta)

    @property
    def max_items(self) -> int:
        return self.batch * self.pages_per_seq

    # -- HBM arrays the packer builds (shape, dtype): also what the accounting counts -----
    def hbm_shapes(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        wd = self.weight_dtype
        out = {
            "ring_a": ((self.n_a, self.hidden, self.ta), wd),
            "ring_b": ((self.n_b, self.ta, self.hidden_p), wd),
            "vec": ((self.num_layers, self.vec_rows, self.vec_width), jnp.float32),
        }
        if self.moe_layers:
            lm, e, d, i = len(self.moe_layers), self.num_experts, self.hidden, self.moe_inter_p
            # The router stays float32: top-k decisions flip on bf16-rounded logits.
            out["router"] = ((lm, d, self.experts_p), jnp.float32)
            out["expert_gu"] = ((lm, e, 2, d, i), wd)
            out["expert_down"] = ((lm, e, i, self.hidden_p), wd)
        return out

    # -- scratch: the single source for the kernel's allocation and the VMEM budget --------
    def scratch(self) -> list[Scratch]:
        b, g, kv, ta, dp, wd = (
            self.batch,
            self.group,
            self.kv,
            self.ta,
            self.hidden_p,
            self.weight_dtype,
        )
        ps = self.page_size
        s = [
            Scratch("ring_a", (self.depth_a, self.hidden, ta), wd),
            Scratch("sem_a", (self.depth_a,), None, "sem"),
            Scratch("ring_b", (self.depth_b, ta, dp), wd),
            Scratch("sem_b", (self.depth_b,), None, "sem"),
            Scratch("vec", (2, self.vec_rows, self.vec_width), jnp.float32),
            Scratch("sem_vec", (2,), None, "sem"),
            Scratch("kbuf", (self.depth_kv, self.block_width, self.kv_row), self.kv_dtype),
            Scratch("vbuf", (self.depth_kv, self.block_width, self.kv_row), self.kv_dtype),
            Scratch("sem_kv", (self.depth_kv, 2), None, "sem"),
            Scratch("kw", (b, ps, self.kv_row), self.kv_dtype),
            Scratch("vw", (b, ps, self.kv_row), self.kv_dtype),
            Scratch("sem_w", (b, 2), None, "sem"),
            Scratch("h", (b, dp), jnp.float32),
            # Per row, its g query-head groups on sublanes: a (b, g, 1, X) layout would pad
            # each group's single row to 8 sublanes (8x the bytes). The attention loop indexes
            # the row dynamically (leading dim) and the group statically (sublane offset).
            Scratch("q", (b, g, kv), jnp.float32),
            # Each head's running max and sum, repeated over its lanes of the [g, kv] row.
            Scratch("m", (b, g, kv), jnp.float32),
            Scratch("l", (b, g, kv), jnp.float32),
            Scratch("acc", (b, g, kv), jnp.float32),
            Scratch("attn", (g, b, ta), jnp.float32),
            Scratch("seg", (kv, LANES), jnp.float32),
            Scratch("seg_t", (LANES, kv), jnp.float32),
        ]
        if self.tp > 1:  # the all-reduce's buffers (`collective.all_reduce`)
            cw = self.reduce_block_cols
            s.append(Scratch("sem_ar", (2, 2), None, "sem"))
            if self.all_reduce == "one_shot":
                s.append(Scratch("ar_buf", (2, self.tp, b, dp), jnp.float32))
            else:
                s += [
                    Scratch(n, (self.tp, b, cw), jnp.float32) for n in ("ar_src", "ar_rs", "ar_ag")
                ]
        if self.emit_logits:
            # lm_head logits leave VMEM tile by tile: a double-buffered staging block DMA'd to
            # the HBM logits output (holding all of f32[tiles, B, ta] would cost 16-37 MiB at
            # batch 64).
            s += [
                Scratch("logits_stage", (2, b, ta), jnp.float32),
                Scratch("sem_logits", (2,), None, "sem"),
            ]
        if self.moe_layers:
            ep, i = self.experts_p, self.moe_inter_p
            s += [
                Scratch("router", (2, self.hidden, ep), jnp.float32),
                Scratch("sem_router", (2,), None, "sem"),
                Scratch("egu", (self.depth_e, 2, self.hidden, i), wd),
                Scratch("edown", (self.depth_e, i, dp), wd),
                Scratch("sem_e", (self.depth_e, 2), None, "sem"),
                Scratch("used_v", (1, ep), jnp.int32),
                Scratch("used_s", (1, ep), jnp.int32, "smem"),
                Scratch("elist", (ep,), jnp.int32, "smem"),
                Scratch("sem_used", (1,), None, "sem"),
            ]
        return s

    def io_vmem(self) -> list[tuple[tuple[int, ...], Any]]:
        """VMEM-resident kernel inputs and outputs (whole-array blocks)."""
        b = self.batch
        # The logits output stays in HBM (`logits_stage` in `scratch()` is its VMEM side).
        best = [((b, LANES), jnp.float32)] if self.tp > 1 else []  # each row's best logit
        return best + [
            ((b, self.hidden_p), jnp.float32),  # h0
            ((b, self.ta), jnp.float32),  # cos
            ((b, self.ta), jnp.float32),  # sin
            ((1, self.hidden_p), jnp.float32),  # final norm
            ((b, LANES), jnp.int32),  # greedy tokens
        ]

    def vmem_bytes(self) -> int:
        """VMEM the kernel allocates: scratch plus whole-array VMEM operands, tile-padded."""
        scratch = sum(s.vmem_bytes for s in self.scratch())
        return scratch + sum(padded_bytes(sh, dt) for sh, dt in self.io_vmem())

    def vmem_breakdown(self) -> dict[str, int]:
        return {s.name: s.vmem_bytes for s in self.scratch() if s.vmem_bytes}


def unsupported(cfg: Any, page_size: int) -> str | None:
    """Why the kernel cannot run this model config and page size, or None if it can."""
    if getattr(cfg, "o_bias", False):
        return "megakernel: o_bias=True is not implemented yet"
    hd = cfg.head_dim
    if hd & (hd - 1) or hd < 2:
        return f"megakernel: head_dim={hd} must be a power of two (RoPE lane masks)"
    if page_size % 8:
        return f"megakernel: page_size={page_size} must be a multiple of 8 (sublanes)"
    experts = getattr(cfg, "num_experts", 0)
    if experts > LANES * 8:
        return f"megakernel: num_experts={experts} > {LANES * 8}"
    return None


def make_plan(
    cfg: Any,
    batch: int,
    page_size: int,
    pages_per_seq: int,
    *,
    vmem_budget: int = VMEM_BYTES - VMEM_HEADROOM,
    **overrides,
) -> MegaPlan:
    """Builds the plan for a model config and step shape, shrinking ring depths to fit VMEM.

    Raises:
      ValueError naming the config field the kernel does not implement, or when even the
      shallowest rings exceed `vmem_budget`.
    """
    why = unsupported(cfg, page_size)
    if why:
        raise ValueError(why)
    hd = cfg.head_dim
    kv = cfg.num_kv_heads * hd
    ta = round_up(kv, LANES)
    moe_layers = tuple(getattr(cfg, "moe_layers", ()))
    dense_f = cfg.intermediate_size if len(moe_layers) < cfg.num_layers else 0
    plan = MegaPlan(
        num_layers=cfg.num_layers,
        hidden=cfg.hidden_size,
        hidden_p=round_up(cfg.hidden_size, LANES),
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=hd,
        kv=kv,
        ta=ta,
        kv_row=kv,
        ffn_tiles=-(-dense_f // ta),
        vocab=cfg.vocab_size,
        vocab_tiles=-(-cfg.vocab_size // ta),
        moe_layers=moe_layers,
        num_experts=getattr(cfg, "num_experts", 0),
        top_k=getattr(cfg, "top_k", 0),
        norm_topk_prob=getattr(cfg, "norm_topk_prob", False),
        moe_inter_p=round_up(getattr(cfg, "moe_intermediate_size", 0) or 1, LANES),
        qk_norm=cfg.qk_norm,
        qkv_bias=bool(getattr(cfg, "qkv_bias", False)),
        eps=cfg.rms_norm_eps,
        batch=batch,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
    )
    plan = replace(plan, **overrides)
    if plan.kv_row not in (kv, ta):
        raise ValueError(f"megakernel: pool row {plan.kv_row} must be {kv} or {ta} lanes")
    # Shrink the deepest ring first until the allocation fits; depth 2 keeps one load in
    # flight per ring while the other slot is consumed, depth 1 would serialise the stream.
    while plan.vmem_bytes() > vmem_budget:
        depths = {"depth_a": plan.depth_a, "depth_b": plan.depth_b, "depth_kv": plan.depth_kv}
        name = max(depths, key=lambda k: (depths[k], k == "depth_a"))
        if depths[name] <= 2:
            raise ValueError(
                f"megakernel plan needs {plan.vmem_bytes() / 2**20:.1f} MiB VMEM even with "
                f"depth-2 rings (budget {vmem_budget / 2**20:.1f} MiB): {plan.vmem_breakdown()}"
            )
        plan = replace(plan, **{name: depths[name] - 1})
    return plan
