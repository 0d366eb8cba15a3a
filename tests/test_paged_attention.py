"""Paged decode equals a contiguous (no-cache, full-sequence) forward for ragged batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.kv_cache import KVPool, pool_row
from kernels.llama import rms_norm
from kernels.rope import apply_rope, rope_cos_sin
from megaserve.kv.pages import pages_for_tokens
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig
from megaserve.runner.xla import XlaRunner
from megaserve.sampling_params import SamplingArrays


def contiguous_logits(cfg, params, ids: list[int]) -> np.ndarray:
    """Full causal forward over the whole sequence with a dense [T, T] mask; f32[T, V]."""
    t = len(ids)
    h = params["embed"][jnp.asarray(ids)][None, :, : cfg.hidden_size]
    pos = jnp.arange(t)[None]
    cos, sin = rope_cos_sin(pos, params["inv_freq"], params["rope_scale"])
    mask = jnp.tril(jnp.ones((t, t), bool))
    g = cfg.num_heads // cfg.num_kv_heads
    for li in range(cfg.num_layers):
        lp = params["layers"][li]
        x = rms_norm(h, lp["ln_attn"], cfg.rms_norm_eps)
        qkv = x @ lp["wqkv"]
        q = qkv[..., : cfg.q_size].reshape(1, t, cfg.num_heads, cfg.head_dim)
        k = qkv[..., cfg.q_size : cfg.q_size + cfg.kv_size].reshape(1, t, cfg.num_kv_heads, -1)
        v = qkv[..., cfg.q_size + cfg.kv_size :].reshape(1, t, cfg.num_kv_heads, -1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * cfg.head_dim**-0.5
        s = jnp.where(mask, s, -jnp.inf)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(1, t, -1)
        h = h + a @ lp["wo"]
        x = rms_norm(h, lp["ln_mlp"], cfg.rms_norm_eps)
        gu = x @ lp["w_gate_up"]
        f = cfg.intermediate_size
        h = h + (jax.nn.silu(gu[..., :f]) * gu[..., f:]) @ lp["w_down"]
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return np.asarray(h @ params["lm_head"])[0]


# "tpu": the pool's rows padded to 128 lanes, as a TPU worker's pool is (`pool_row`).
@pytest.mark.parametrize("page_size,rows", [(16, "cpu"), (128, "cpu"), (16, "tpu")])
def test_paged_batch_decode_matches_contiguous(tiny_model, page_size, rows):
    cfg, params = tiny_model.cfg, tiny_model.params
    row = pool_row(cfg.num_kv_heads, cfg.head_dim, rows)
    rng = np.random.default_rng(1)
    # Lengths straddle page boundaries so some sequences open a new page mid-batch.
    lengths = [5, page_size - 1, page_size, page_size + 1, 2 * page_size - 2, 37]
    steps = 4
    pages_per_seq = pages_for_tokens(max(lengths) + steps + 1, page_size)
    n_pages = len(lengths) * pages_per_seq + 1
    pool = KVPool.create(
        cfg.num_layers, n_pages, page_size, cfg.num_kv_heads, cfg.head_dim, row=row
    )
    runner = XlaRunner(
        tiny_model.family, cfg, params, pool, StepConfig(max_pages_per_seq=pages_per_seq)
    )
    # Scattered, interleaved page ids: paging must not depend on pages being contiguous.
    perm = rng.permutation(np.arange(1, n_pages)).astype(np.int32)
    table = perm.reshape(len(lengths), pages_per_seq)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    greedy = SamplingArrays.greedy(1)
    firsts = []
    for i, p in enumerate(prompts):
        nxt, _ = runner.prefill(
            TokenBatch.from_padded(
                np.array([p], np.int32), np.arange(len(p))[None].astype(np.int32), table[i : i + 1]
            ),
            greedy,
        )
        firsts.append(int(nxt[0]))
    seqs = [p + [f] for p, f in zip(prompts, firsts)]
    toks = np.array(firsts, np.int32)
    pos = np.array(lengths, np.int32)
    out, logits = runner.decode(
        TokenBatch.decode(toks, pos, table),
        SamplingArrays.greedy(len(lengths)),
        n_steps=steps,
        want_logits=True,
    )
    for b, seq in enumerate(seqs):
        full = seq + out[:-1, b].tolist()
        ref = contiguous_logits(cfg, params, full)
        got = logits[:, b]
        np.testing.assert_allclose(got, ref[len(seq) - 1 :], rtol=2e-5, atol=2e-5)
        assert out[:, b].tolist() == np.argmax(ref[len(seq) - 1 :], -1).tolist()
    kv = cfg.num_kv_heads * cfg.head_dim
    assert pool.k.shape[-1] == row and (row > kv) == (rows == "tpu")
    assert not np.asarray(pool.k[..., kv:]).any() and not np.asarray(pool.v[..., kv:]).any()


def test_prefill_in_chunks_equals_one_chunk(tiny_model):
    cfg, params = tiny_model.cfg, tiny_model.params
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, 50).astype(np.int32)
    results = []
    for chunk in (50, 16):
        pool = KVPool.create(cfg.num_layers, 9, 8, cfg.num_kv_heads, cfg.head_dim)
        r = XlaRunner(tiny_model.family, cfg, params, pool, StepConfig(max_pages_per_seq=8))
        table = np.arange(1, 9, dtype=np.int32)[None]
        for s in range(0, 50, chunk):
            c = ids[s : s + chunk]
            _, logits = r.prefill(
                TokenBatch.from_padded(
                    c[None], np.arange(s, s + len(c), dtype=np.int32)[None], table
                ),
                SamplingArrays.greedy(1),
            )
        results.append(logits[0])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        results[0], contiguous_logits(cfg, params, ids.tolist())[-1], rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("kernel", ["xla", "cpu"])
@pytest.mark.parametrize("key_block,near", [(32, 3), (48, 3), (512, 3), (32, 70), (48, 75)])
def test_blockwise_attention_equals_the_whole_table(monkeypatch, key_block, near, kernel):
    """The blockwise online softmax (XLA's, and the C++ kernel `paged_attention` lowers to
    on CPU) equals the whole-table reference: chunks starting mid-page and mid-block, one
    sequence with a longer table than the others reach, a padded row (output 0) and padded
    tail tokens; 48 keys is not a divisor of the table. `near` is row 1's first position:
    from 70 on, every live query sees the first blocks whole (XLA's unmasked loop), the rest
    through the masked one."""
    from kernels import paged_attention as pa

    if kernel == "xla":
        monkeypatch.setattr(pa.cpu_attention, "supports", lambda q, k: False)
    else:
        assert pa.cpu_attention.available(), "the C++ kernel did not build (log above)"
    monkeypatch.setattr(pa, "KEY_BLOCK", key_block)
    rng = np.random.default_rng(key_block)
    layers, n_pages, ps, hkv, g, d = 2, 40, 16, 2, 3, 8
    k = jnp.asarray(rng.standard_normal((layers, n_pages, ps, hkv * d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((layers, n_pages, ps, hkv * d)), jnp.float32)
    table = rng.permutation(np.arange(1, n_pages))[:36].reshape(4, 9).astype(np.int32)
    t = 7
    pos = np.full((4, t), -1, np.int32)
    pos[0] = np.arange(130, 137)  # 9 pages of 16: keys up to 136
    pos[1, :5] = np.arange(near, near + 5)  # tail padding
    pos[2] = np.arange(near + 57, near + 64)
    q = jnp.asarray(rng.standard_normal((4, t, hkv * g, d)), jnp.float32)
    args = (q, k, v, 1, jnp.asarray(pos), jnp.asarray(table), d**-0.5)
    got = np.asarray(jax.jit(pa.paged_attention, static_argnums=(3, 6))(*args))
    want = np.asarray(pa.paged_attention_reference(*args))
    live = pos >= 0
    np.testing.assert_allclose(got[live], want[live], rtol=1e-5, atol=1e-5)
    assert not got[~live].any()
    # Rows padded to 128 lanes (a TPU pool), the padding filled with noise: never read.
    noise = jnp.asarray(rng.standard_normal((layers, n_pages, ps, 128 - hkv * d)), jnp.float32)
    padded = [jnp.concatenate([x, noise], axis=-1) for x in (k, v)]
    attend = jax.jit(pa.paged_attention, static_argnums=(3, 6, 7))
    for fn in (attend, pa.paged_attention_reference):
        out = np.asarray(fn(q, *padded, *args[3:], hkv))
        np.testing.assert_allclose(out[live], want[live], rtol=1e-5, atol=1e-5)
