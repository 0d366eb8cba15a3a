"""Sampling: filters do what they say; keys from (seed, position) make continuations exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.sampling import sample as _raw_sample
from megaserve.errors import RequestError
from megaserve.offline import OfflineGenerator
from megaserve.sampling_params import SamplingParams

sample = jax.jit(_raw_sample)


def _sample(logits, n=1, **kw):
    b = logits.shape[0]

    def arr(name, default, dtype):
        return jnp.full((b,), kw.get(name, default), dtype)

    outs = []
    for pos in range(n):
        outs.append(
            sample(
                jnp.asarray(logits),
                arr("temperature", 0.0, jnp.float32),
                arr("top_k", 0, jnp.int32),
                arr("top_p", 1.0, jnp.float32),
                arr("min_p", 0.0, jnp.float32),
                arr("seed", 0, jnp.uint32),
                jnp.full((b,), pos, jnp.int32),
            )
        )
    return np.stack([np.asarray(o) for o in outs])


def test_filters():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 200)).astype(np.float32)
    top3 = np.argsort(-logits, axis=1)[:, :3]
    got = _sample(logits, n=64, temperature=5.0, top_k=3)
    for b in range(4):
        assert set(got[:, b]) <= set(top3[b]) and len(set(got[:, b])) > 1
    np.testing.assert_array_equal(_sample(logits, temperature=1.0, top_k=1)[0], logits.argmax(1))
    np.testing.assert_array_equal(_sample(logits, temperature=1.0, top_p=1e-6)[0], logits.argmax(1))
    np.testing.assert_array_equal(_sample(logits, temperature=1.0, min_p=1.0)[0], logits.argmax(1))


@pytest.mark.parametrize("top_p", [1e-30, 1e-38, 1e-40, 1e-45])  # the last three: denormal
def test_the_tiniest_top_p_keeps_the_best_token(top_p):
    """A valid top_p that f32 holds as a denormal (flushed to 0 in the program) still keeps
    the first token: the argmax, not token 0 from an all-masked row."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 100)).astype(np.float32)
    logits[:, 0] = -5.0  # token 0 is never the best here
    got = _sample(logits, n=4, temperature=1.0, top_p=top_p)
    np.testing.assert_array_equal(got, np.broadcast_to(logits.argmax(1), got.shape))


def test_the_tiniest_repetition_penalty_boosts_seen_tokens_without_nan():
    """repetition_penalty 1e-45 (valid, denormal in f32): seen positive logits are boosted as
    by a small penalty (no inf, no NaN), so a seen token wins, not token 0."""
    from kernels.sampling import apply_penalties

    logits = np.array([[-1.0, 0.5, 3.0, 1.0]], np.float32)
    seen = np.array([[False, True, False, False]])
    zeros = np.zeros(1, np.float32)
    rep = np.array([1e-45], np.float32)
    got = np.asarray(
        jax.jit(apply_penalties)(logits, np.zeros((1, 4), np.int32), seen, zeros, zeros, rep)
    )
    assert np.isfinite(got).all() and got.argmax() == 1


def test_greedy_ties_take_first_index():
    logits = np.zeros((1, 10), np.float32)
    logits[0, [3, 7]] = 5.0
    assert _sample(logits)[0, 0] == 3  # as torch.argmax, which transformers' greedy uses


def test_temperature_distribution():
    logits = np.log(np.array([[0.7, 0.2, 0.1]], np.float32))
    draws = np.concatenate(
        [_sample(logits, n=200, temperature=1.0, seed=s)[:, 0] for s in range(5)]
    )
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, [0.7, 0.2, 0.1], atol=0.06)


SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)


def test_seeded_continuation_from_any_position_is_identical(tiny_model):
    gen = OfflineGenerator(tiny_model, max_context=128)
    prompt = [5, 17, 33, 2, 8]
    full = gen.generate(prompt, 24, SAMPLED).token_ids
    assert gen.generate(prompt, 24, SAMPLED).token_ids == full  # deterministic
    for cut in (1, 7, 16):
        # Re-prefill prompt + generated-so-far (what a migrated request does) and continue.
        rest = gen.generate(prompt + full[:cut], 24 - cut, SAMPLED).token_ids
        assert rest == full[cut:], cut
    other = gen.generate(prompt, 24, SamplingParams(temperature=0.9, top_k=40, seed=99))
    assert other.token_ids != full


def test_multi_step_sampling_equals_single_step(tiny_model):
    a = OfflineGenerator(tiny_model, max_context=128).generate([1, 2, 3], 20, SAMPLED).token_ids
    b = OfflineGenerator(tiny_model, max_context=128, steps_per_call=4)
    assert b.generate([1, 2, 3], 20, SAMPLED).token_ids == a


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"temperature": float("nan")}, "nan"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": -2}, "top_k=-2"),
        ({"min_p": 2.0}, "min_p=2.0"),
        ({"seed": -1}, "seed=-1"),
    ],
)
def test_bad_sampling_params(kw, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kw)


def test_penalties_match_numpy_reference():
    from kernels.sampling import apply_penalties

    rng = np.random.default_rng(4)
    logits = rng.standard_normal((3, 50)).astype(np.float32) * 3
    counts = rng.integers(0, 3, (3, 50)).astype(np.int32)
    seen = (counts > 0) | (rng.random((3, 50)) < 0.2)
    pres = np.array([0.0, 0.5, -0.3], np.float32)
    freq = np.array([0.2, 0.0, 1.0], np.float32)
    rep = np.array([1.3, 1.0, 0.8], np.float32)
    want = logits.copy()
    for b in range(3):
        for v in range(50):
            x = want[b, v]
            if seen[b, v]:
                x = x / rep[b] if x > 0 else x * rep[b]
            want[b, v] = x - pres[b] * (counts[b, v] > 0) - freq[b] * counts[b, v]
    got = jax.jit(apply_penalties)(logits, counts, seen, pres, freq, rep)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_penalized_multi_step_equals_single_step(tiny_model):
    sp = SamplingParams(
        temperature=0.7, seed=5, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3
    )
    a = OfflineGenerator(tiny_model, max_context=128).generate([4, 4, 4, 9], 16, sp).token_ids
    b = OfflineGenerator(tiny_model, max_context=128, steps_per_call=4)
    assert b.generate([4, 4, 4, 9], 16, sp).token_ids == a
    greedy_rep = SamplingParams(repetition_penalty=10.0)
    plain = OfflineGenerator(tiny_model, max_context=128).generate([4, 4, 4, 9], 16).token_ids
    out = OfflineGenerator(tiny_model, max_context=128).generate([4, 4, 4, 9], 16, greedy_rep)
    assert out.token_ids != plain


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"presence_penalty": 3.0}, "presence_penalty=3.0"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty=inf"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
    ],
)
def test_bad_penalties(kw, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kw)


def test_float_noise_that_reorders_near_ties_does_not_change_the_draw():
    """A flat distribution (a random model's) has many near-equal logits, and the same row
    computed in another batch differs in the last bits. Here every token has a twin 1e-6
    away and the noise swaps each pair's order: the draw must not follow the sorted order."""
    rng = np.random.default_rng(0)
    base = np.repeat(rng.normal(0, 0.5, (64, 192)), 2, axis=1).astype(np.float32)
    twin = np.tile(np.float32([5e-7, -5e-7]), 192)
    a = _sample(base + twin, n=8, temperature=0.8, seed=7)
    b = _sample(base - twin, n=8, temperature=0.8, seed=7)
    assert (a != b).mean() < 0.02, (a != b).sum()
