"""MoE prefill: (token, expert) pairs sorted by expert; per-expert matmuls (XLA) or megablox gmm."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox

from kernels.moe import swiglu

LANES = 128


@dataclass(frozen=True)
class MoePrefillConfig:
    """Tile sizes (static).

    rows, tail_rows: the XLA loop's (CPU, GPU) matmul tiles: an expert's pairs run `rows` at a
      time, then the rest `tail_rows` at a time, so big groups get big matmuls and only the
      last tile (< tail_rows rows) is partly wasted (measured: docs/prefill.md, MoE prefill).
    gmm_rows: gmm's m tile (TPU). gmm runs one m tile per (tile, expert) overlap: up to
      pairs / gmm_rows + E - 1 tiles, each reading its expert's weights. At Qwen3-30B-A3B's
      128 experts, 128 rows run ~5x the pairs' rows for a 512-token chunk (~0.17 ms of
      tpu7x MXU per layer, under the ~0.33 ms of reading the experts once) and ~2x for 2048
      tokens; 512 rows would run ~17x and ~5x.
    gmm_max_kn: gmm's largest K / N tile; a multiple of 128 (lanes).
    """

    rows: int = 128
    tail_rows: int = 16
    gmm_rows: int = 128
    gmm_max_kn: int = 512

    def __post_init__(self):
        if not 1 <= self.tail_rows <= self.rows:
            raise ValueError(f"tail_rows={self.tail_rows} must be in [1, rows={self.rows}]")
        if self.gmm_rows < 16 or self.gmm_rows % 16:
            raise ValueError(f"gmm_rows={self.gmm_rows} must be a multiple of 16 (bf16 sublanes)")
        if self.gmm_max_kn < LANES or self.gmm_max_kn % LANES:
            raise ValueError(f"gmm_max_kn={self.gmm_max_kn} must be a multiple of {LANES}")


def sort_pairs(idx: jnp.ndarray, e: int) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """The (token, expert) pairs in expert order.

    Args:
      idx: i32[N, k] expert ids; e: the number of experts.
    Returns:
      (i32[N*k] order: flat pair index of each sorted row (token = order // k),
       i32[E] sizes: pairs per expert, i32[E] starts: each expert's first sorted row).
    """
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    return order, sizes, jnp.cumsum(sizes) - sizes


def combine(y_sorted: jnp.ndarray, order: jnp.ndarray, weights: jnp.ndarray) -> jnp.ndarray:
    """Unsort expert outputs and mix each token's k of them.

    Args:
      y_sorted: f32[>= N*k, D], row r the output of pair order[r]; order: i32[N*k];
      weights: f32[N, k].
    Returns:
      f32[N, D].
    """
    n, k = weights.shape
    p = n * k
    # Inverse permutation, then a gather: cheaper on CPU than scatter-adding rows into tokens.
    row = jnp.zeros((p,), jnp.int32).at[order].set(jnp.arange(p, dtype=jnp.int32))
    y = y_sorted[row].reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype))


def moe_sorted_loop(w_gate_up, w_down, weights, idx, x, cfg=MoePrefillConfig()) -> jnp.ndarray:
    """XLA prefill path: a loop over experts, each multiplying only its own sorted rows.

    Reads each selected expert once and computes about its pairs' rows (no dense expansion,
    unlike `lax.ragged_dot` on CPU). An expert's rows run in tiles from its first row:
    `cfg.rows` at a time, then `cfg.tail_rows` at a time. The last tile runs past the
    expert's rows into the next experts'; those surplus rows are overwritten when their own
    expert runs (experts go in ascending order and each rewrites all its rows), and the
    sorted buffer has `cfg.rows` spare zero rows for the last expert's spill.

    Args:
      w_gate_up: f32[E, D, 2I]; w_down: f32[E, I, D]; weights: f32[N, k]; idx: i32[N, k];
      x: f32[N, D] (any float dtype, the same for all).
    Returns:
      f32[N, D].
    """
    e = w_gate_up.shape[0]
    n, k = idx.shape
    big, small = cfg.rows, cfg.tail_rows
    order, sizes, starts = sort_pairs(idx, e)
    tok = jnp.concatenate([order // k, jnp.full((big,), n, jnp.int32)])
    xs = jnp.take(x, tok, axis=0, mode="fill", fill_value=0)  # [N*k + rows, D]

    def expert(ex, out):
        wgu, wdn = w_gate_up[ex], w_down[ex]

        def tiles(out, first, count, t):
            def tile(j, out):
                r0 = first + j * t
                act = swiglu(jax.lax.dynamic_slice_in_dim(xs, r0, t) @ wgu)
                return jax.lax.dynamic_update_slice_in_dim(out, act @ wdn, r0, 0)

            return jax.lax.fori_loop(0, count, tile, out)

        full = sizes[ex] // big
        out = tiles(out, starts[ex], full, big)
        rest = sizes[ex] - full * big
        return tiles(out, starts[ex] + full * big, (rest + small - 1) // small, small)

    y = jax.lax.fori_loop(0, e, expert, jnp.zeros_like(xs))
    return combine(y, order, weights)


def _kn_tile(dim: int, most: int) -> int:
    """gmm's K or N tile for a weight dimension of `dim`.

    A Mosaic block's last dim must be a multiple of 128 lanes or the whole array dim. We
    never pad the weights to reach that: a padded copy would rewrite the whole expert stack
    every call, the very bytes a prefill chunk is bound by. So: the largest multiple of 128
    up to `most` that divides `dim`, or the whole dim when it is not a lane multiple (only
    small test models; every served MoE's dims are lane multiples).
    """
    if dim % LANES:
        return dim
    return next(s for s in range(min(most, dim), 0, -LANES) if dim % s == 0)


def moe_gmm(
    w_gate_up, w_down, weights, idx, x, cfg=MoePrefillConfig(), interpret=False
) -> jnp.ndarray:
    """TPU prefill path: megablox `gmm` (Pallas grouped matmul) on the expert-sorted pairs.

    gmm needs the row count to be a multiple of its m tile. The pairs are padded with zero
    rows to that multiple, and the padding is counted into the last expert's group: gmm
    leaves rows outside every group unwritten (stale memory, possibly NaN, which a zero
    routing weight would not cancel), while zero rows in a group compute exact zeros. Groups
    need no alignment: gmm masks a tile's rows to each group that overlaps it. Pairs routed
    to another shard's experts (id E, `moe.local_experts`) sort after every group and join
    the last one too: finite rows that their zero weight cancels.

    Args/Returns: as `moe_sorted_loop` (float32 or bfloat16 only: gmm's dtypes);
      interpret: run the Pallas kernel in the interpreter (tests on CPU).
    """
    e, d, f2 = w_gate_up.shape
    n, k = idx.shape
    p = n * k
    tm = cfg.gmm_rows
    m = -(-p // tm) * tm
    order, sizes, _ = sort_pairs(idx, e)
    sizes = sizes.at[e - 1].add(m - jnp.sum(sizes))  # padding and other shards' pairs
    tok = jnp.concatenate([order // k, jnp.full((m - p,), n, jnp.int32)])
    xs = jnp.take(x, tok, axis=0, mode="fill", fill_value=0)  # [m, D]
    most = cfg.gmm_max_kn
    gu = megablox.gmm(xs, w_gate_up, sizes, x.dtype, (tm, _kn_tile(d, most), _kn_tile(f2, most)),
                      None, None, False, interpret)  # fmt: skip
    act = swiglu(gu)
    y = megablox.gmm(act, w_down, sizes, x.dtype, (tm, _kn_tile(f2 // 2, most), _kn_tile(d, most)),
                     None, None, False, interpret)  # fmt: skip
    return combine(y, order, weights)


def moe_prefill(w_gate_up, w_down, weights, idx, x, cfg=MoePrefillConfig()) -> jnp.ndarray:
    """The served prefill MoE, chosen when the program is lowered: gmm for TPU, the XLA
    expert loop elsewhere. Args/Returns: as `moe_sorted_loop`."""
    return jax.lax.platform_dependent(
        w_gate_up, w_down, weights, idx, x,
        tpu=lambda *a: moe_gmm(*a, cfg=cfg),
        default=lambda *a: moe_sorted_loop(*a, cfg=cfg),
    )  # fmt: skip
