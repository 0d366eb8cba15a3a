"""MoE: served paths equal the dense reference; only selected experts are ever read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.moe import moe_dense, moe_gather, moe_grouped, route
from kernels.qwen3_moe import Qwen3MoeConfig

E, D, I = 16, 32, 24


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.standard_normal((D, E)).astype(np.float32)),
        jnp.asarray(0.2 * rng.standard_normal((E, D, 2 * I)).astype(np.float32)),
        jnp.asarray(0.2 * rng.standard_normal((E, I, D)).astype(np.float32)),
    )


@pytest.mark.parametrize("n,k,norm", [(1, 4, True), (5, 2, False), (8, 16, True), (40, 4, True)])
def test_served_paths_equal_dense_reference(experts, n, k, norm):
    router, wgu, wdn = experts
    x = jnp.asarray(np.random.default_rng(n).standard_normal((n, D)).astype(np.float32))
    w, idx = route(router, x, k, norm)
    ref = moe_dense(wgu, wdn, w, idx, x)
    for impl in (moe_gather, moe_grouped):
        np.testing.assert_allclose(jax.jit(impl)(wgu, wdn, w, idx, x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3])
def test_unselected_experts_are_never_read(experts, n):
    """Poison every expert the batch did not select with NaN: the decode output is unchanged."""
    router, wgu, wdn = experts
    x = jnp.asarray(np.random.default_rng(7).standard_normal((n, D)).astype(np.float32))
    w, idx = route(router, x, 2, True)
    chosen = np.unique(np.asarray(idx))
    assert len(chosen) < E
    poison = np.ones(E, bool)
    poison[chosen] = False
    wgu_p = jnp.where(poison[:, None, None], jnp.nan, wgu)
    wdn_p = jnp.where(poison[:, None, None], jnp.nan, wdn)
    clean = jax.jit(moe_gather)(wgu, wdn, w, idx, x)
    dirty = jax.jit(moe_gather)(wgu_p, wdn_p, w, idx, x)
    np.testing.assert_array_equal(clean, dirty)
    assert bool(jnp.isnan(moe_dense(wgu_p, wdn_p, w, idx, x)).any())  # the reference reads all


def test_gathered_bytes_are_distinct_selected_experts(experts):
    """What the decode gather fetches: one copy of each distinct expert, zero-filled padding."""
    router, wgu, wdn = experts
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, D)).astype(np.float32))
    _, idx = route(router, x, 4, True)
    distinct = len(np.unique(np.asarray(idx)))
    uniq = jnp.unique(idx.reshape(-1), size=min(E, idx.size), fill_value=E)
    fetched = jnp.take(wgu, uniq, axis=0, mode="fill", fill_value=0)
    read = int(np.sum(np.any(np.asarray(fetched) != 0, axis=(1, 2))))
    assert read == distinct
    assert read * wgu[0].nbytes < wgu.nbytes


def test_router_ties_take_lower_expert():
    router = jnp.zeros((D, E)).at[:, 3].set(1.0).at[:, 9].set(1.0)
    x = jnp.ones((1, D))
    _, idx = route(router, x, 2, True)
    assert idx.tolist() == [[3, 9]]
    _, idx1 = route(router, x, 1, True)
    assert idx1.tolist() == [[3]]


def test_config_from_hf_styles():
    base = {
        "model_type": "qwen3_moe",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    }
    v4 = Qwen3MoeConfig.from_hf(base | {"num_experts": 8, "rope_theta": 1e6})
    v5 = Qwen3MoeConfig.from_hf(
        base
        | {"num_local_experts": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert v4 == v5 and v4.moe_layers == (0, 2, 3) and v4.qk_norm
    step2 = Qwen3MoeConfig.from_hf(base | {"num_experts": 8, "decoder_sparse_step": 2})
    assert step2.moe_layers == (3,)
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        Qwen3MoeConfig.from_hf(base | {"num_experts": 8, "num_experts_per_tok": 9})


def test_batched_paged_decode_equals_one_at_a_time(tiny_moe_model):
    """Sequences in one batch route to different experts; each equals its solo run."""
    from kernels.kv_cache import KVPool
    from megaserve.offline import OfflineGenerator
    from megaserve.runner.batch import TokenBatch
    from megaserve.runner.buckets import StepConfig
    from megaserve.runner.xla import XlaRunner
    from megaserve.sampling_params import SamplingArrays

    m = tiny_moe_model
    cfg = m.cfg
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 9, 16, 21)]
    solo = OfflineGenerator(m, max_context=64)
    want = [solo.generate(p, 8).token_ids for p in prompts]
    ps, per = 8, 5
    pool = KVPool.create(cfg.num_layers, len(prompts) * per + 1, ps, cfg.num_kv_heads, cfg.head_dim)
    r = XlaRunner(m.family, cfg, m.params, pool, StepConfig(max_pages_per_seq=per))
    table = (1 + rng.permutation(len(prompts) * per)).reshape(len(prompts), per).astype(np.int32)
    first = []
    for i, p in enumerate(prompts):
        nxt, _ = r.prefill(
            TokenBatch.from_padded(
                np.array([p], np.int32), np.arange(len(p), dtype=np.int32)[None], table[i : i + 1]
            ),
            SamplingArrays.greedy(1),
        )
        first.append(int(nxt[0]))
    toks, _ = r.decode(
        TokenBatch.decode(
            np.array(first, np.int32), np.array([len(p) for p in prompts], np.int32), table
        ),
        SamplingArrays.greedy(len(prompts)),
        n_steps=7,
    )
    got = [[first[b]] + toks[:, b].tolist() for b in range(len(prompts))]
    assert got == want
