"""MoE prefill: the XLA expert loop and megablox gmm (TPU interpreter) equal the dense reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.moe import moe_dense, moe_grouped, route
from kernels.moe_prefill import MoePrefillConfig, moe_gmm, moe_prefill, moe_sorted_loop

# Small tiles so that a group spans several full tiles and tail tiles and spills into the next.
SMALL = MoePrefillConfig(rows=8, tail_rows=3, gmm_rows=16, gmm_max_kn=128)


def _experts(e, d, f, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.standard_normal((d, e)).astype(np.float32)),
        jnp.asarray((0.2 * rng.standard_normal((e, d, 2 * f))).astype(dtype)),
        jnp.asarray((0.2 * rng.standard_normal((e, f, d))).astype(dtype)),
    )


def _routing(kind, router, x, e, k):
    """(weights f32[N, k], idx i32[N, k]) for a routing kind."""
    n = x.shape[0]
    w, idx = route(router, x, k, True)
    if kind == "random":
        return w, idx
    if kind == "half_experts_empty":  # only even experts are ever chosen
        masked = jnp.where(jnp.arange(e) % 2 == 0, x @ router, -1e9)
        return route(jnp.eye(e), masked, k, True)
    if kind == "one_expert_all_tokens":  # every token's first choice is expert 5
        idx = jnp.asarray(np.stack([(5 + np.arange(k)) % e] * n).astype(np.int32))
        return w, idx
    raise ValueError(f"routing kind {kind!r} is not one of random, half_experts_empty, ...")


ROUTINGS = ["random", "half_experts_empty", "one_expert_all_tokens"]


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("n,k", [(1, 2), (37, 4), (64, 1)])
@pytest.mark.parametrize("cfg", [SMALL, MoePrefillConfig()], ids=["small-tiles", "default"])
def test_sorted_loop_equals_dense_and_ragged_dot(kind, n, k, cfg):
    e, d, f = 16, 32, 24
    router, wgu, wdn = _experts(e, d, f)
    x = jnp.asarray(np.random.default_rng(n).standard_normal((n, d)).astype(np.float32))
    w, idx = _routing(kind, router, x, e, k)
    ref = moe_dense(wgu, wdn, w, idx, x)
    got = jax.jit(lambda *a: moe_sorted_loop(*a, cfg=cfg))(wgu, wdn, w, idx, x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, jax.jit(moe_grouped)(wgu, wdn, w, idx, x), rtol=1e-5, atol=1e-5)


def test_served_prefill_on_cpu_is_the_sorted_loop():
    e, d, f, n, k = 8, 16, 8, 20, 2
    router, wgu, wdn = _experts(e, d, f, seed=1)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((n, d)).astype(np.float32))
    w, idx = route(router, x, k, False)
    np.testing.assert_array_equal(
        jax.jit(moe_prefill)(wgu, wdn, w, idx, x), jax.jit(moe_sorted_loop)(wgu, wdn, w, idx, x)
    )


@pytest.mark.parametrize(
    "kind,e,d,f,n,k",
    [
        ("random", 8, 256, 128, 24, 2),  # 2 K tiles and 2-4 N tiles of 128 lanes
        ("half_experts_empty", 8, 256, 128, 19, 3),  # pairs not a multiple of the m tile
        ("one_expert_all_tokens", 8, 256, 128, 16, 2),
        ("random", 6, 40, 24, 11, 2),  # dims not lane multiples: whole-dim blocks
    ],
)
def test_gmm_in_tpu_interpreter_equals_dense(kind, e, d, f, n, k):
    router, wgu, wdn = _experts(e, d, f, seed=3)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((n, d)).astype(np.float32))
    w, idx = _routing(kind, router, x, e, k)
    got = moe_gmm(wgu, wdn, w, idx, x, cfg=SMALL, interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(got, moe_dense(wgu, wdn, w, idx, x), rtol=1e-4, atol=1e-4)


def test_gmm_bf16_in_tpu_interpreter_within_bf16_tolerance():
    e, d, f, n, k = 8, 128, 128, 24, 2
    router, wgu, wdn = _experts(e, d, f, seed=5, dtype=jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((n, d))).astype(jnp.bfloat16)
    w, idx = route(router, x.astype(jnp.float32), k, True)
    w = w.astype(jnp.bfloat16)
    got = moe_gmm(wgu, wdn, w, idx, x, cfg=SMALL, interpret=pltpu.InterpretParams())
    ref = moe_dense(*(a.astype(jnp.float32) for a in (wgu, wdn, w)), idx, x.astype(jnp.float32))
    # bf16 rounding of the activations between the two matmuls: relative to the output scale.
    err = np.max(np.abs(np.asarray(got, np.float32) - np.asarray(ref)))
    assert err < 2e-2 * np.max(np.abs(ref)), (err, np.max(np.abs(ref)))


def test_prefill_moe_runs_gmm_on_tpu_and_xla_elsewhere():
    """The implementation is chosen when the program is lowered."""
    e, d, f, n, k = 8, 256, 128, 64, 2
    args = (
        jax.ShapeDtypeStruct((e, d, 2 * f), jnp.bfloat16),
        jax.ShapeDtypeStruct((e, f, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, k), jnp.int32),
        jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
    )
    tpu = jax.jit(moe_prefill).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    cpu = jax.jit(moe_prefill).trace(*args).lower().as_text()
    assert tpu.count("tpu_custom_call") == 2  # gate/up and down
    assert "tpu_custom_call" not in cpu and "ragged_dot" not in cpu


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"rows": 4, "tail_rows": 8}, "tail_rows=8 must be in [1, rows=4]"),
        ({"tail_rows": 0}, "tail_rows=0"),
        ({"gmm_rows": 24}, "gmm_rows=24 must be a multiple of 16"),
        ({"gmm_max_kn": 200}, "gmm_max_kn=200 must be a multiple of 128"),
    ],
)
def test_bad_config_is_refused_by_name(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        MoePrefillConfig(**kw)
