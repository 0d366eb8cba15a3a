"""Token sampling: greedy, temperature, top-k, top-p, min-p, with keys from (seed, position)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def request_key(seed: jnp.ndarray, position: jnp.ndarray) -> jax.Array:
    """PRNG key for the token at `position` of a request seeded with `seed`.

    Deriving the key from (seed, position) alone makes a continuation reproducible from any
    point: re-prefilling prompt + generated tokens elsewhere samples the same next tokens.
    """
    return jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), position)


def apply_penalties(
    logits: jnp.ndarray,
    counts: jnp.ndarray,
    seen: jnp.ndarray,
    presence: jnp.ndarray,
    frequency: jnp.ndarray,
    repetition: jnp.ndarray,
) -> jnp.ndarray:
    """vLLM semantics: presence/frequency over output tokens, repetition over prompt + output.

    Args:
      logits: f32[B, V]; counts: i32[B, V] output-token counts; seen: bool[B, V] tokens in
      prompt or output; presence, frequency: f32[B] (0 = off); repetition: f32[B] (1 = off;
      positive logits are divided by it, negative ones multiplied, as transformers does).
    """
    # A penalty under 1e-6 acts as 1e-6: XLA flushes an f32 denormal to 0, and a logit divided
    # by 0 is inf (NaN probabilities, token 0). At 1e-6 a seen positive logit already wins.
    rep = jnp.maximum(repetition, 1e-6)[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    c = counts.astype(logits.dtype)
    return logits - presence[:, None] * (c > 0) - frequency[:, None] * c


def _sample_row(logits, temperature, top_k, top_p, min_p, seed, position):
    """Samples one row; logits f32[V]. Greedy rows are handled by the caller."""
    vocab = logits.shape[-1]
    vals, idx = jax.lax.top_k(logits, vocab)  # sorted descending
    vals = vals / jnp.maximum(temperature, 1e-6)
    rank = jnp.arange(vocab)
    keep = jnp.where(top_k > 0, rank < top_k, True)
    vals = jnp.where(keep, vals, -jnp.inf)
    probs = jax.nn.softmax(vals)
    # top-p keeps the smallest prefix whose mass reaches p. The first token always survives,
    # by rank: a denormal top_p (1e-40 passes validation) is flushed to 0, and 0 < 0 fails.
    keep &= (rank == 0) | ((jnp.cumsum(probs) - probs) < top_p)
    keep &= probs >= min_p * probs[0]
    vals = jnp.where(keep, vals, -jnp.inf)
    # The noise is drawn per token id, not per rank: two near-equal logits whose order flips
    # under float noise (another batch size, another worker) then swap nothing, and the draw
    # changes only when the two best noisy scores tie within that noise.
    scores = jnp.full((vocab,), -jnp.inf, vals.dtype).at[idx].set(vals)
    return jax.random.categorical(request_key(seed, position), scores)


def sample(
    logits: jnp.ndarray,
    temperature: jnp.ndarray,
    top_k: jnp.ndarray,
    top_p: jnp.ndarray,
    min_p: jnp.ndarray,
    seed: jnp.ndarray,
    position: jnp.ndarray,
) -> jnp.ndarray:
    """Picks the next token of each row.

    Args:
      logits: f32[B, V].
      temperature: f32[B]; 0 means greedy (argmax, first index on ties, as transformers).
      top_k: i32[B]; 0 disables.
      top_p: f32[B] in (0, 1]; 1 disables.
      min_p: f32[B] in [0, 1]; 0 disables.
      seed: u32[B] per-request seeds.
      position: i32[B] position the sampled token will occupy.
    Returns:
      i32[B] token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        s = jax.vmap(_sample_row)(logits, temperature, top_k, top_p, min_p, seed, position)
        return jnp.where(temperature > 0, s.astype(jnp.int32), greedy)

    # The full-vocab sort only runs when some row samples: an all-greedy batch skips it.
    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)
