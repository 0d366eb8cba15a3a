"""Ragged paged prefill attention for TPU (Pallas): several sequences' new tokens in one call,
K/V read by DMA from the pool in its serving layout, beside its pure-JAX reference.

Why our own kernel and not JAX's bundled `ragged_paged_attention`: that kernel reads a cache
laid out `[pages, page_size, 2 * Hkv, D]` (K and V interleaved, heads split), while the
pool every megaserve program shares (the decode megakernel, the XLA step, the KV hand-off)
is `[L, pages, page_size, row]` for K and for V, row = Hkv * D padded to whole lanes
(`kv_cache.pool_row`). Converting per call would copy the context; a second pool layout
would double the KV memory. So this kernel reads the pool as it is: one DMA per page
moves a page's whole rows (all KV heads) into VMEM, once per block of queries.

Layout inside the kernel: queries as `[G, T, row]`, query head h * G + g at lanes
h * D..(h + 1) * D of row g, i.e. on the same lanes as its KV head in a pool row. Heads are
processed a lane tile (128 lanes, or one head when D > 128) at a time; with D = 64 a tile
holds two heads, each scored with the other's lanes masked to zero (2x the MXU work of a
64-wide matmul, and no unaligned lane slices).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
MASKED = -1e30  # finite: a row masked so far keeps exp() finite


@dataclass(frozen=True)
class RaggedPrefillConfig:
    """Tuning sizes (static).

    block_q: query rows of one sequence per grid step; every sequence's rows start at a
      multiple of it in `q` (the scheduler pads each piece up to it).
    pages_per_block: pages per key block (keys per block = pages_per_block * page_size).
    """

    block_q: int = 128
    pages_per_block: int = 8

    def __post_init__(self):
        if self.block_q < 8 or self.block_q % 8:
            raise ValueError(f"block_q={self.block_q} must be a positive multiple of 8")
        if self.pages_per_block < 1:
            raise ValueError(f"pages_per_block={self.pages_per_block} must be >= 1")


def block_owners(
    q_start: jax.Array, q_len: jax.Array, kv_len: jax.Array, num_rows: int, block_q: int,
    block_k: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """Which sequence owns each block of query rows, the position of its first row, and how
    many key blocks it reads (computed here: integer division in a kernel needs the chip
    generation at lowering, which programs lowered without a TPU mesh do not have).

    Args:
      q_start: i32[S] first row of each sequence's new tokens (multiples of block_q).
      q_len: i32[S] new tokens per sequence (0: an unused slot).
      kv_len: i32[S] cached + new tokens per sequence.
    Returns:
      (owner i32[num_rows // block_q], -1 for padding blocks; first position i32[same];
      key blocks i32[same]: up to the block's last query or the sequence's end, 0 for
      padding; causally later blocks are never read).
    """
    first_row = jnp.arange(num_rows // block_q, dtype=jnp.int32)[:, None] * block_q
    inside = (first_row >= q_start[None]) & (first_row < (q_start + q_len)[None])  # [nb, S]
    owner = jnp.where(inside.any(1), jnp.argmax(inside, axis=1), -1).astype(jnp.int32)
    s = jnp.maximum(owner, 0)
    pos = jnp.where(owner >= 0, kv_len[s] - q_len[s] + first_row[:, 0] - q_start[s], 0)
    last = jnp.minimum(pos + block_q, kv_len[s]) - 1
    n_blocks = jnp.where(owner >= 0, last // block_k + 1, 0)
    return owner, pos.astype(jnp.int32), n_blocks.astype(jnp.int32)


def _kernel(
    # scalar prefetch (SMEM)
    owner_ref,  # i32[nb]
    pos_ref,  # i32[nb] position of each block's first query
    blocks_ref,  # i32[nb] key blocks each query block reads
    kv_len_ref,  # i32[S]
    table_ref,  # i32[S * pages_per_seq] page ids, row-major
    layer_ref,  # i32[1]
    # operands
    q_ref,  # [G, block_q, row] this block's queries (pre-scaled), VMEM
    k_hbm,  # [L, num_pages, page_size, row] the pool, HBM
    v_hbm,
    # output
    o_ref,  # [G, block_q, row]
    # scratch
    kbuf,  # [2, block_k, row] key pages, double-buffered
    vbuf,
    sem,  # DMA semaphores [2 (K, V), 2 (slot)]
    m_ref,  # f32[Hkv, G * block_q, 1] running max per query row and head
    l_ref,  # f32[Hkv, G * block_q, 1] running sum
    acc_ref,  # f32[G * block_q, row]
    *,
    head_dim: int,
    num_kv_heads: int,
    pages_per_seq: int,
    pages_per_block: int,
):
    j = pl.program_id(0)
    g, bq, row = q_ref.shape
    ps = k_hbm.shape[2]
    bk = pages_per_block * ps
    seq = owner_ref[j]
    first = pos_ref[j]
    kv_len = kv_len_ref[jnp.maximum(seq, 0)]
    n_blocks = blocks_ref[j]

    def copies(blk, slot):
        out = []
        for p in range(pages_per_block):
            idx = jnp.minimum(blk * pages_per_block + p, pages_per_seq - 1)
            page = table_ref[jnp.maximum(seq, 0) * pages_per_seq + idx]
            rows = pl.ds(p * ps, ps)
            for i, (hbm, buf) in enumerate(((k_hbm, kbuf), (v_hbm, vbuf))):
                out.append(
                    pltpu.make_async_copy(
                        hbm.at[layer_ref[0], page], buf.at[slot, rows], sem.at[i, slot]
                    )
                )
        return out

    m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(n_blocks > 0)
    def _():
        for c in copies(0, 0):
            c.start()

    width = max(LANES, head_dim)  # one lane tile, or one head wider than a tile
    per_tile = width // head_dim
    kv = num_kv_heads * head_dim
    # Query position of each score row (rows are g-major: row = g * bq + t).
    qpos = first + lax.broadcasted_iota(jnp.int32, (g, bq, bk), 1).reshape(g * bq, bk)
    lane = lax.broadcasted_iota(jnp.int32, (1, width), 1)

    def body(blk, carry):
        slot = jnp.bitwise_and(blk, 1)

        @pl.when(blk + 1 < n_blocks)
        def _():
            for c in copies(blk + 1, 1 - slot):
                c.start()

        for c in copies(blk, slot):
            c.wait()
        kpos = blk * bk + lax.broadcasted_iota(jnp.int32, (g * bq, bk), 1)
        seen = (kpos <= qpos) & (kpos < kv_len)
        for c0 in range(0, kv, width):
            tile = pl.ds(c0, width)
            q = q_ref[:, :, tile].reshape(g * bq, width)
            keys = kbuf[slot, :, tile].astype(q.dtype)  # [bk, width]
            vals = vbuf[slot, :, tile].astype(q.dtype)
            for hh in range(min(per_tile, (kv - c0) // head_dim)):
                mine = (lane >= hh * head_dim) & (lane < (hh + 1) * head_dim)
                qh = q if per_tile == 1 else jnp.where(mine, q, 0).astype(q.dtype)
                refs = (m_ref.at[c0 // head_dim + hh], l_ref.at[c0 // head_dim + hh], acc_ref)
                _online_softmax(refs, tile, qh, keys, vals, seen, None if per_tile == 1 else mine)
        return carry

    lax.fori_loop(0, n_blocks, body, 0)
    _normalize_out(o_ref, l_ref, acc_ref, head_dim, kv)


def _normalize_out(o_ref, l_ref, acc_ref, head_dim: int, kv: int) -> None:
    """o = acc / l per head, lane tile by tile; lanes past the heads are zeroed."""
    g, bq, row = o_ref.shape
    width = max(LANES, head_dim)
    per_tile = width // head_dim
    lane = lax.broadcasted_iota(jnp.int32, (1, width), 1)
    for c0 in range(0, kv, width):
        tile = pl.ds(c0, width)
        acc = acc_ref[:, tile]
        for hh in range(min(per_tile, (kv - c0) // head_dim)):
            h = c0 // head_dim + hh
            mine = (lane >= hh * head_dim) & (lane < (hh + 1) * head_dim)
            inv = 1.0 / jnp.where(l_ref[h] > 0, l_ref[h], 1.0)
            acc = jnp.where(mine, acc * inv, acc) if per_tile > 1 else acc * inv
        o_ref[:, :, tile] = acc.reshape(g, bq, width).astype(o_ref.dtype)
    if kv < row:  # lanes past the heads: zero, never stale VMEM
        o_ref[:, :, pl.ds(kv, row - kv)] = jnp.zeros((g, bq, row - kv), o_ref.dtype)


def _online_softmax(refs, tile, q, keys, vals, seen, mine) -> None:
    """One head's update over one key block: scores f32[G * bq, bk] = q @ keys.T, masked
    to the keys each query sees; the running max/sum and the accumulator's `tile` lanes
    rescaled (only the head's own lanes, `mine`, when a tile holds several heads)."""
    m_ref, l_ref, acc_ref = refs
    s = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = jnp.where(seen, s, MASKED)
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, s.max(-1, keepdims=True))
    p = jnp.where(seen, jnp.exp(s - m_next), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    m_ref[...] = m_next
    l_ref[...] = l_ref[...] * alpha + p.sum(-1, keepdims=True)
    pv = jnp.dot(p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
    acc = acc_ref[:, tile]
    new = acc * alpha + pv
    acc_ref[:, tile] = new if mine is None else jnp.where(mine, new, acc)


def to_pool_lanes(q: jax.Array, num_kv_heads: int, row: int) -> jax.Array:
    """[T, Hq, D] -> [G, T, row]: query head h * G + g on its KV head's lanes of row g."""
    t, hq, d = q.shape
    g = hq // num_kv_heads
    x = q.reshape(t, num_kv_heads, g, d).transpose(2, 0, 1, 3).reshape(g, t, num_kv_heads * d)
    return jnp.pad(x, ((0, 0), (0, 0), (0, row - num_kv_heads * d)))


def from_pool_lanes(x: jax.Array, num_kv_heads: int, head_dim: int) -> jax.Array:
    """The inverse of `to_pool_lanes`: [G, T, row] -> [T, Hq, D]."""
    g, t, _ = x.shape
    x = x[..., : num_kv_heads * head_dim].reshape(g, t, num_kv_heads, head_dim)
    return x.transpose(1, 2, 0, 3).reshape(t, num_kv_heads * g, head_dim)


def check_inputs(q, k_cache, q_start, q_len, kv_len, page_table, num_kv_heads, cfg) -> None:
    """ValueError naming the first argument whose shape cannot work."""
    t, hq, d = q.shape
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache shape {k_cache.shape} must be [L, pages, page_size, row]")
    if hq % num_kv_heads:
        raise ValueError(f"{hq=} query heads must be a multiple of {num_kv_heads=}")
    if k_cache.shape[-1] < num_kv_heads * d:
        raise ValueError(f"pool row {k_cache.shape[-1]} < {num_kv_heads=} x head_dim {d}")
    if t % cfg.block_q:
        raise ValueError(f"query rows {t} must be a multiple of block_q={cfg.block_q}")
    if d % LANES and LANES % d:
        raise ValueError(f"head_dim={d} must divide or be a multiple of {LANES}")
    s = page_table.shape[0]
    for name, a in (("q_start", q_start), ("q_len", q_len), ("kv_len", kv_len)):
        if a.shape != (s,):
            raise ValueError(f"{name} shape {a.shape} must be ({s},), one per page_table row")


def ragged_prefill_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    q_start: jax.Array,
    q_len: jax.Array,
    kv_len: jax.Array,
    page_table: jax.Array,
    scale: float,
    num_kv_heads: int,
    cfg: RaggedPrefillConfig = RaggedPrefillConfig(),
    interpret=False,
) -> jax.Array:
    """Causal attention of several sequences' new tokens over their paged K/V (the new
    tokens' K/V already written to the pool).

    Args:
      q: f32|bf16[T, Hq, D] queries (rotated), sequence s in rows q_start[s]..+q_len[s];
        other rows are padding (their output is zero or meaningless).
      k_cache, v_cache: [L, num_pages, page_size, row] the pool (row >= Hkv * D).
      layer: scalar layer index.
      q_start: i32[S] first row of each sequence in q, a multiple of cfg.block_q.
      q_len: i32[S] new tokens of each sequence (0: unused slot).
      kv_len: i32[S] cached + new tokens: sequence s's queries sit at positions
        kv_len - q_len .. kv_len - 1 and see keys 0..their own position.
      page_table: i32[S, pages_per_seq].
      scale: softmax scale.
      num_kv_heads: Hkv.
      cfg: block sizes.
      interpret: False on TPU; `pltpu.InterpretParams()` (or True) runs on CPU.
    Returns:
      q.dtype[T, Hq, D].
    Raises:
      ValueError naming a shape that cannot work.
    """
    check_inputs(q, k_cache, q_start, q_len, kv_len, page_table, num_kv_heads, cfg)
    t, hq, d = q.shape
    row, ps = k_cache.shape[-1], k_cache.shape[2]
    g, bq = hq // num_kv_heads, cfg.block_q
    bk = cfg.pages_per_block * ps
    owner, first, n_blocks = block_owners(q_start, q_len, kv_len, t, bq, bk)
    qx = to_pool_lanes((q * scale).astype(q.dtype), num_kv_heads, row)
    s, pps = page_table.shape
    kernel = functools.partial(
        _kernel,
        head_dim=d,
        num_kv_heads=num_kv_heads,
        pages_per_seq=pps,
        pages_per_block=cfg.pages_per_block,
    )
    block = pl.BlockSpec((g, bq, row), lambda j, *_: (0, j, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(t // bq,),
            in_specs=[block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=block,
            scratch_shapes=[
                pltpu.VMEM((2, bk, row), k_cache.dtype),
                pltpu.VMEM((2, bk, row), v_cache.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((num_kv_heads, g * bq, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, g * bq, 1), jnp.float32),
                pltpu.VMEM((g * bq, row), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qx.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(
        owner,
        first,
        n_blocks,
        kv_len.astype(jnp.int32),
        page_table.reshape(-1).astype(jnp.int32),
        jnp.asarray(layer, jnp.int32).reshape(1),
        qx,
        k_cache,
        v_cache,
    )
    return from_pool_lanes(out, num_kv_heads, d)


def ragged_prefill_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    q_start: jax.Array,
    q_len: jax.Array,
    kv_len: jax.Array,
    page_table: jax.Array,
    scale: float,
    num_kv_heads: int,
    cfg: RaggedPrefillConfig = RaggedPrefillConfig(),
    interpret=False,
) -> jax.Array:
    """`ragged_prefill_attention` in plain jnp (f32 softmax over each sequence's whole page
    table): what the kernel is tested against. `cfg` and `interpret` are ignored; padding
    rows give zeros."""
    check_inputs(q, k_cache, q_start, q_len, kv_len, page_table, num_kv_heads, cfg)
    t, hq, d = q.shape
    g = hq // num_kv_heads
    rows = jnp.arange(t)
    inside = (rows[:, None] >= q_start[None]) & (rows[:, None] < (q_start + q_len)[None])
    seq = jnp.argmax(inside, axis=1)  # [T]
    valid = inside.any(1)
    pos = kv_len[seq] - q_len[seq] + rows - q_start[seq]  # [T]
    kv = num_kv_heads * d
    keys = k_cache[layer][page_table][..., :kv].reshape(page_table.shape[0], -1, num_kv_heads, d)
    vals = v_cache[layer][page_table][..., :kv].reshape(page_table.shape[0], -1, num_kv_heads, d)
    qg = q.reshape(t, num_kv_heads, g, d).astype(jnp.float32)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys[seq].astype(jnp.float32)) * scale
    kpos = jnp.arange(keys.shape[1])
    seen = (kpos[None] <= pos[:, None]) & (kpos[None] < kv_len[seq][:, None]) & valid[:, None]
    scores = jnp.where(seen[:, None, None], scores, MASKED)
    probs = jnp.where(seen[:, None, None], jax.nn.softmax(scores, axis=-1), 0.0)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, vals[seq].astype(jnp.float32))
    return jnp.where(valid[:, None, None], out.reshape(t, hq, d), 0.0).astype(q.dtype)
