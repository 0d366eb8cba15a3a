"""Paged attention: write new K/V through a page table, then attend causally (the Pallas
ragged prefill kernel when lowered for TPU, the C++ kernel on CPU, blockwise in XLA
elsewhere, beside the whole-table reference)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels import cpu_attention
from kernels.ragged_prefill import RaggedPrefillConfig, ragged_prefill_attention

# Page 0 of every pool is the null page: padding tokens write there and page tables are padded
# with it, so no padded slot can ever touch a live sequence's KV.
NULL_PAGE = 0


def write_kv(
    cache: jnp.ndarray,
    layer: jnp.ndarray | int,
    new: jnp.ndarray,
    positions: jnp.ndarray,
    page_table: jnp.ndarray,
) -> jnp.ndarray:
    """Scatters new K or V rows into their pages.

    Args:
      cache: f32[L, num_pages, page_size, row] the pool (donated by callers); row is
        Hkv * D, or that padded to whole lanes (`kv_cache.pool_row`).
      layer: scalar layer index.
      new: f32[B, T, Hkv, D] rows for the new tokens (written as pool rows, zero-padded).
      positions: i32[B, T] absolute positions; -1 marks padding (written to the null page).
      page_table: i32[B, P] page ids of each sequence.
    Returns:
      The updated pool.
    """
    page_size = cache.shape[2]
    valid = positions >= 0
    safe_pos = jnp.where(valid, positions, 0)
    page = jnp.take_along_axis(page_table, safe_pos // page_size, axis=1)
    page = jnp.where(valid, page, NULL_PAGE)
    slot = jnp.where(valid, safe_pos % page_size, 0)
    b, t, hkv, d = new.shape
    rows = new.reshape(-1, hkv * d).astype(cache.dtype)
    if cache.shape[-1] != hkv * d:  # a padded pool row: whole rows, padding lanes zero
        rows = jnp.pad(rows, ((0, 0), (0, cache.shape[-1] - hkv * d)))
    # Every index is in range by construction (padding goes to the null page), so skip the
    # out-of-bounds handling XLA would otherwise emit around the scatter.
    return cache.at[layer, page.reshape(-1), slot.reshape(-1)].set(rows, mode="promise_in_bounds")


# Keys per block of the blockwise attention: hundreds of keys per matmul, and scores of
# [B, Hq, T, 256] f32 instead of the whole table's (2.1 GB for a [8, 256] Qwen3-30B-A3B
# prefill chunk at 8k context). 256 measured fastest for a SmolLM2 4096-token prefill on
# XLA:CPU (chunk 256: 7.9 s against 8.1 s at 128 and 512; docs/prefill.md).
KEY_BLOCK = 256


def paged_attention(
    q: jnp.ndarray,
    k_cache: jnp.ndarray,
    v_cache: jnp.ndarray,
    layer: jnp.ndarray | int,
    positions: jnp.ndarray,
    page_table: jnp.ndarray,
    scale: float,
    num_kv_heads: int | None = None,
) -> jnp.ndarray:
    """Causal attention of new queries over each sequence's paged keys, blockwise: an online
    softmax over blocks of KEY_BLOCK keys, and only the blocks up to the furthest query
    position of the chunk are read (later blocks are masked for every query). A one-token
    (decode) call attends over the whole table at once.

    Args:
      q: f32[B, T, Hq, D] queries (already rotated).
      k_cache, v_cache: [L, num_pages, page_size, row] the pool, new rows written; each
        block is one gather of (layer, page) blocks straight from it: slicing the layer out
        first made XLA copy a whole layer of the pool per layer (on tpu7x, 1.2 GB temps
        for Llama-3.1-8B). Heads are split on the gathered pages, not on the pool.
      layer: scalar layer index.
      positions: i32[B, T] absolute query positions; -1 marks padding (its output is discarded).
      page_table: i32[B, P]; a query at position p sees keys 0..p of its sequence.
      scale: softmax scale (1/sqrt(D) for these families).
      num_kv_heads: Hkv (default: the row's width over D, right for a dense row; a row
        padded to lanes needs it).
    Returns:
      f32[B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    hkv = num_kv_heads or k_cache.shape[-1] // d
    # Chosen when the program is lowered: the Pallas kernel for TPU, the C++ kernel on CPU
    # where it builds (`cpu_attention`), the XLA blockwise path elsewhere.
    default = _blockwise
    if t == 1:
        # A decode step's scores are [B, Hq, 1, S], small at any context; and a loop over
        # the blocks made XLA:CPU copy the whole pool into the loop's carry. Its gather of
        # the whole table is not small: on CPU the kernel reads the keys in place instead
        # (SmolLM2 f32 at context 1200, batch 16: 304.5 ms a step with the gather, 161.7 in
        # place; docs/prefill.md). No Pallas entry (block_q is None at T = 1): on TPU the
        # decode step is the megakernel's, and an XLA step there runs the reference.
        default = _reference
    kernels = {"default": functools.partial(default, layer=layer, scale=scale, hkv=hkv)}
    if cpu_attention.supports(q, k_cache):
        kernels["cpu"] = functools.partial(_cpu_kernel, layer=layer, scale=scale, hkv=hkv)
    block_q = next((n for n in (128, 64, 32, 16, 8) if t % n == 0), None)
    # Shapes the Pallas kernel does not take (TPU pools are always lane-padded: `pool_row`).
    if not (block_q is None or (d % 128 and 128 % d) or k_cache.shape[-1] % 128):
        kernels["tpu"] = functools.partial(
            _ragged_from_rows, layer=layer, scale=scale, hkv=hkv, block_q=block_q
        )
    if len(kernels) == 1:
        return kernels["default"](q, k_cache, v_cache, positions, page_table)
    return jax.lax.platform_dependent(q, k_cache, v_cache, positions, page_table, **kernels)


def _reference(q, k_cache, v_cache, positions, page_table, layer, scale, hkv):
    return paged_attention_reference(q, k_cache, v_cache, layer, positions, page_table, scale, hkv)


def _cpu_kernel(q, k_cache, v_cache, positions, page_table, layer, scale, hkv):
    return cpu_attention.paged_prefill_attention(
        q, k_cache, v_cache, layer, positions, page_table, scale, hkv
    )


def _ragged_from_rows(
    q, k_cache, v_cache, positions, page_table, layer, scale, hkv, block_q, interpret=False
):
    """The padded-rows batch (row b: one sequence's new tokens at consecutive positions,
    padding after them) as the ragged kernel's arguments: row b's queries start at b * T."""
    b, t, hq, d = q.shape
    q_len = (positions >= 0).sum(1).astype(jnp.int32)
    kv_len = jnp.where(q_len > 0, positions[:, 0] + q_len, 0).astype(jnp.int32)
    out = ragged_prefill_attention(
        q.reshape(b * t, hq, d), k_cache, v_cache, layer,
        jnp.arange(b, dtype=jnp.int32) * t, q_len, kv_len, page_table, scale, hkv,
        RaggedPrefillConfig(block_q=block_q), interpret,
    )  # fmt: skip
    return out.reshape(b, t, hq, d)


def _blockwise(q, k_cache, v_cache, positions, page_table, layer, scale, hkv):
    """`paged_attention`'s XLA path: an online softmax over blocks of KEY_BLOCK keys. Blocks
    every live query sees whole run unmasked (no compare, no selects: on XLA:CPU the masks
    cost about as much as the softmax); only the blocks the chunk's diagonal crosses are
    masked. Padding rows give 0."""
    b, t, hq, d = q.shape
    page_size = k_cache.shape[2]
    group = hq // hkv
    per_block = max(1, min(page_table.shape[1], KEY_BLOCK // page_size))
    blocks = -(-page_table.shape[1] // per_block)
    table = jnp.pad(page_table, ((0, 0), (0, blocks * per_block - page_table.shape[1])))
    width = per_block * page_size  # keys per block
    # The scale goes on the queries once, not on every block's scores.
    qg = (q * scale).reshape(b, t, hkv, group, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    masked = jnp.float32(-1e30)
    live = positions >= 0

    def keys_values(j):
        pages = jax.lax.dynamic_slice_in_dim(table, j * per_block, per_block, axis=1)
        # mode="clip": page ids are in range by construction; the default fill mode's bounds
        # handling made this gather ~2x slower on XLA:CPU.
        keys = k_cache.at[layer, pages].get(mode="clip")[..., : hkv * d].reshape(b, width, hkv, d)
        vals = v_cache.at[layer, pages].get(mode="clip")[..., : hkv * d].reshape(b, width, hkv, d)
        return keys.astype(q.dtype), vals.astype(q.dtype)

    def online(carry, scores, vals, seen=None):
        m, l, acc = carry  # [B, Hkv, G, T], [B, Hkv, G, T], [B, Hkv, G, T, D]
        m_new = jnp.maximum(m, scores.max(-1))
        probs = jnp.exp(scores - m_new[..., None])
        if seen is not None:
            probs = jnp.where(seen, probs, 0.0)
        rescale = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgts,bskd->bkgtd", probs.astype(q.dtype), vals)
        return m_new, l * rescale + probs.sum(-1), acc * rescale[..., None] + pv.astype(jnp.float32)

    def block(j, carry, diagonal: bool):
        keys, vals = keys_values(j)
        scores = jnp.einsum("bkgtd,bskd->bkgts", qg, keys).astype(jnp.float32)
        if not diagonal:
            return online(carry, scores, vals)
        seen = (j * width + jnp.arange(width))[None, None, :] <= positions[:, :, None]
        seen = seen[:, None, None]  # [B, 1, 1, T, width]
        return online(carry, jnp.where(seen, scores, masked), vals, seen)

    stats = jnp.full((b, hkv, group, t), masked), jnp.zeros((b, hkv, group, t), jnp.float32)
    acc = jnp.zeros((b, hkv, group, t, d), jnp.float32)
    # Blocks past the furthest query are masked for all: the loops stop before them. Blocks
    # before the nearest live query's block are seen whole by every live query.
    needed = jnp.clip(jnp.max(positions) // width + 1, 0, blocks)
    nearest = jnp.min(jnp.where(live, positions, jnp.iinfo(jnp.int32).max - width))
    whole_blocks = jnp.clip((nearest + 1) // width, 0, needed)
    whole = functools.partial(block, diagonal=False)
    carry = jax.lax.fori_loop(0, whole_blocks, whole, (*stats, acc))
    diagonal = functools.partial(block, diagonal=True)
    _, l, acc = jax.lax.fori_loop(whole_blocks, needed, diagonal, carry)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)
    return jnp.where(live[..., None, None], out, 0.0)  # padding rows saw unmasked blocks


def paged_attention_reference(
    q: jnp.ndarray,
    k_cache: jnp.ndarray,
    v_cache: jnp.ndarray,
    layer: jnp.ndarray | int,
    positions: jnp.ndarray,
    page_table: jnp.ndarray,
    scale: float,
    num_kv_heads: int | None = None,
) -> jnp.ndarray:
    """Causal attention of new queries over each sequence's paged keys, the whole page table
    at once (full scores [B, Hkv, G, T, S]): the reference `paged_attention` is tested
    against, with its arguments and returns (padding rows give the mean of the values)."""
    b, t, hq, d = q.shape
    hkv = num_kv_heads or k_cache.shape[-1] // d
    group = hq // hkv
    # mode="clip": page ids are in range by construction; the default fill mode's bounds
    # handling made this gather ~2x slower on XLA:CPU.
    keys = k_cache.at[layer, page_table].get(mode="clip")[..., : hkv * d].reshape(b, -1, hkv, d)
    vals = v_cache.at[layer, page_table].get(mode="clip")[..., : hkv * d].reshape(b, -1, hkv, d)
    qg = q.reshape(b, t, hkv, group, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys.astype(q.dtype)) * scale
    s_idx = jnp.arange(keys.shape[1])
    visible = s_idx[None, None, :] <= positions[:, :, None]  # [B, T, S]
    # A large finite negative keeps fully-masked padding rows finite (their output is discarded).
    scores = jnp.where(visible[:, None, None], scores, jnp.float32(-1e30))
    probs = jax_softmax(scores)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, vals.astype(q.dtype))
    return out.reshape(b, t, hq, d)


def jax_softmax(x: jnp.ndarray) -> jnp.ndarray:
    """Softmax over the last axis in float32 (as transformers' eager attention)."""
    x = x.astype(jnp.float32)
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    return e / jnp.sum(e, axis=-1, keepdims=True)
