"""Reference paged attention: write new K/V through a page table, then attend causally."""

from __future__ import annotations

import jax.numpy as jnp

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
      cache: f32[L, num_pages, page_size, Hkv * D] the pool (donated by callers).
      layer: scalar layer index.
      new: f32[B, T, Hkv, D] rows for the new tokens (written as [Hkv * D] pool rows).
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
    # Every index is in range by construction (padding goes to the null page), so skip the
    # out-of-bounds handling XLA would otherwise emit around the scatter.
    return cache.at[layer, page.reshape(-1), slot.reshape(-1)].set(
        new.reshape(-1, cache.shape[-1]).astype(cache.dtype), mode="promise_in_bounds"
    )


def paged_attention(
    q: jnp.ndarray,
    k_cache: jnp.ndarray,
    v_cache: jnp.ndarray,
    layer: jnp.ndarray | int,
    positions: jnp.ndarray,
    page_table: jnp.ndarray,
    scale: float,
) -> jnp.ndarray:
    """Causal attention of new queries over each sequence's paged keys.

    Args:
      q: f32[B, T, Hq, D] queries (already rotated).
      k_cache, v_cache: [L, num_pages, page_size, Hkv * D] the pool, new rows written; one
        gather per array reads (layer, page) blocks straight from it: slicing the layer out
        first made XLA copy a whole layer of the pool per layer (on tpu7x, 1.2 GB temps
        for Llama-3.1-8B). Heads are split on the gathered pages, not on the pool.
      layer: scalar layer index.
      positions: i32[B, T] absolute query positions; -1 marks padding.
      page_table: i32[B, P]; a query at position p sees keys 0..p of its sequence.
      scale: softmax scale (1/sqrt(D) for these families).
    Returns:
      f32[B, T, Hq, D].
    """
    b, t, hq, d = q.shape
    hkv = k_cache.shape[-1] // d
    group = hq // hkv
    # mode="clip": page ids are in range by construction; the default fill mode's bounds
    # handling made this gather ~2x slower on XLA:CPU.
    keys = k_cache.at[layer, page_table].get(mode="clip").reshape(b, -1, hkv, d)
    vals = v_cache.at[layer, page_table].get(mode="clip").reshape(b, -1, hkv, d)
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
