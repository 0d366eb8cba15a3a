"""XLA whole-step device programs: a prefill chunk (optionally scoring every position), and
(multi-)step decode over a donated KV pool. The host side (padding, buckets, backend choice)
is `megaserve.runner`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.sampling import apply_penalties, sample


def pick(logits, s, pos):
    """Penalties (when present) then sampling, for f32[B, V] logits.

    s: the padded sampling columns (`SamplingArrays.padded`), [B] each, plus i32[B, V]
    `counts` and bool[B, V] `seen` when some row is penalized; pos: i32[B] positions of the
    tokens being sampled (they key the per-row random draw)."""
    if "counts" in s:
        logits = apply_penalties(
            logits,
            s["counts"],
            s["seen"],
            s["presence_penalty"],
            s["frequency_penalty"],
            s["repetition_penalty"],
        )
    return sample(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"], s["seed"], pos)


def prefill_program(family, cfg, params, k, v, tokens, positions, page_table, logits_index, s):
    """One chunk: writes its K/V through the page table and samples each row's next token.

    tokens, positions: i32[B, T] (-1 = padding); page_table: i32[B, P]; logits_index: i32[B]
    each row's last real column. Returns (i32[B] next, f32[B, V] logits, k, v)."""
    logits, k, v = family.forward(cfg, params, tokens, positions, k, v, page_table, logits_index)
    pos = jnp.take_along_axis(positions, logits_index[:, None], axis=1)[:, 0] + 1
    return pick(logits, s, pos), logits, k, v


def prefill_logprobs_program(
    family, cfg, top_k, params, k, v, tokens, positions, page_table, logits_index, s, targets
):
    """`prefill_program` that also scores every position of the chunk (prompt log-probabilities):
    the log-softmax of each position's logits, reduced on the device to what leaves it.

    targets: i32[B, T] the token to score at each position (the one after it). Returns (i32[B]
    next, f32[B, V] logits at logits_index, f32[B, T] the targets' log-probabilities, i32[B, T,
    top_k] the most likely tokens at each position (most likely first, lower id first among
    equals) and f32[B, T, top_k] theirs, k, v)."""
    every, k, v = family.forward(cfg, params, tokens, positions, k, v, page_table, None)
    logits = jnp.take_along_axis(every, logits_index[:, None, None], axis=1)[:, 0]
    pos = jnp.take_along_axis(positions, logits_index[:, None], axis=1)[:, 0] + 1
    lp = jax.nn.log_softmax(every, axis=-1)
    target = jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]
    top, top_ids = jax.lax.top_k(lp, top_k)
    return pick(logits, s, pos), logits, target, top_ids, top, k, v


def decode_program(
    family, cfg, n_steps, want_logits, params, k, v, tokens, positions, pt, s, choose=pick
):
    """n_steps decode steps in one program (`lax.scan`): tokens, positions i32[B] (position -1
    = a padding row); pt: i32[B, P]. Returns (i32[n_steps, B], logits or None, k, v).
    choose(logits, s, pos) -> i32[B] picks the tokens (`pick`; the tensor-parallel step passes
    its vocab-sharded `tp_pick`)."""
    zeros = jnp.zeros(tokens.shape, jnp.int32)

    rows = jnp.arange(tokens.shape[0])

    def step(carry, _):
        k, v, tok, pos, s = carry
        logits, k, v = family.forward(cfg, params, tok[:, None], pos[:, None], k, v, pt, zeros)
        nxt = choose(logits, s, pos + 1)
        if "counts" in s:  # later steps of a multi-step call see this step's token
            s = s | {
                "counts": s["counts"].at[rows, nxt].add(1),
                "seen": s["seen"].at[rows, nxt].set(True),
            }
        pos = jnp.where(pos >= 0, pos + 1, -1)
        return (k, v, nxt, pos, s), (nxt, logits if want_logits else None)

    (k, v, _, _, _), (toks, logits) = jax.lax.scan(
        step, (k, v, tokens, positions, s), None, length=n_steps
    )
    return toks, logits, k, v
