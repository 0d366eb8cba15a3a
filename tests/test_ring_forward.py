"""The XLA forward over the megakernel's rings (the pallas backend's prefill) equals the
family's forward on the same weights: logits and the K/V it writes, chunk after chunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import llama, qwen3_moe
from kernels.kv_cache import KVPool
from kernels.megakernel.pack import pack_megakernel
from kernels.megakernel.plan import make_plan
from kernels.megakernel.ring_forward import ring_forward, stack_gmm
from tests.megakernel_minis import PS, mini_model


@pytest.fixture(scope="module", params=["dense", "moe", "qwen2"])
def mini(request):
    return mini_model(request.param)[0]


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_ring_forward_equals_family_forward(mini):
    cfg = mini.cfg
    # f32 rings, as the runner packs for f32 serving: the same numbers the family reads.
    plan = make_plan(cfg, 1, PS, 1, weight_dtype=jnp.float32)
    mp = pack_megakernel(plan, mini.params)
    forward = qwen3_moe.forward if getattr(cfg, "moe_layers", ()) else llama.forward
    pool = KVPool.create(cfg.num_layers, 12, PS, cfg.num_kv_heads, cfg.head_dim)
    ref_k, ref_v, k, v = pool.k, pool.v, pool.k, pool.v
    table = np.array([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]], np.int32)
    rng = np.random.default_rng(0)
    # Two chunks: 20 and 7 prompt tokens, then 16 and 9 more that attend to the first.
    for starts, lens in (((0, 0), (20, 7)), ((20, 7), (16, 9))):
        t = max(lens)
        tokens = rng.integers(0, cfg.vocab_size, (2, t)).astype(np.int32)
        pos = np.full((2, t), -1, np.int32)
        for r, (s, n) in enumerate(zip(starts, lens)):
            pos[r, :n] = np.arange(s, s + n)
        last = np.array([n - 1 for n in lens], np.int32)
        want, ref_k, ref_v = jax.jit(partial_forward(forward, cfg))(
            mini.params, tokens, pos, ref_k, ref_v, table, last
        )
        got, k, v = jax.jit(lambda *a: ring_forward(plan, *a))(mp, tokens, pos, k, v, table, last)
        assert _rel(got, want) < 1e-5, _rel(got, want)
        assert _rel(k, ref_k) < 1e-5 and _rel(v, ref_v) < 1e-5
        np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))


def partial_forward(forward, cfg):
    def run(params, tokens, pos, k, v, table, last):
        return forward(cfg, params, tokens, pos, k, v, table, last)

    return run


def test_ring_forward_keeps_the_pool_dtype(mini):
    cfg = mini.cfg
    plan = make_plan(cfg, 1, PS, 1)
    mp = pack_megakernel(plan, mini.params)
    pool = KVPool.create(cfg.num_layers, 4, PS, cfg.num_kv_heads, cfg.head_dim, jnp.bfloat16)
    tokens = np.array([[3, 4, 5]], np.int32)
    pos = np.arange(3, dtype=np.int32)[None]
    _, k, _ = ring_forward(plan, mp, tokens, pos, pool.k, pool.v, np.array([[1]]), np.array([2]))
    assert k.dtype == jnp.bfloat16 and k.shape == pool.k.shape


@pytest.mark.parametrize("layer", [0, 2])
def test_stack_gmm_reads_one_layer_of_the_stack(layer):
    """The TPU path's grouped matmul (megablox gmm, TPU interpreter) over the whole stack
    equals XLA's ragged matmul over the layer's slice: empty groups, rows not a tile multiple,
    K and N not a multiple of 512, the layer a traced index as inside a jit."""
    rng = np.random.default_rng(layer)
    m, g, k, n = 3, 6, 384, 256
    stack = jnp.asarray(rng.standard_normal((m, g, k, n)), jnp.float32)
    sizes = jnp.asarray([5, 0, 17, 0, 1, 30], jnp.int32)  # 53 rows, two empty groups
    x = jnp.asarray(rng.standard_normal((53, k)), jnp.float32)
    got = jax.jit(lambda x, s, z, li: stack_gmm(x, s, z, li, interpret=True))(
        x, stack, sizes, jnp.int32(layer)
    )
    want = jax.lax.ragged_dot(x, stack[layer], sizes, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-4)
