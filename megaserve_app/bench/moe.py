"""MoE benchmarks on random weights: decode (bytes dense / experts / KV) and one prefill layer."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels import qwen3_moe
from kernels.kv_cache import KVPool
from kernels.moe import moe_dense, moe_grouped, route
from kernels.moe_prefill import moe_prefill
from megaserve.model import LoadedModel
from megaserve_app.bench import summary
from megaserve_app.bench.decode import time_decode

# A small Qwen3-MoE: 12 layers, 64 experts, top-8 (Qwen3-30B-A3B's routing shape, scaled).
BENCH_CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rope_theta": 1e6,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def random_moe_model(hf: dict = BENCH_CONFIG, seed: int = 0) -> LoadedModel:
    """Random weights, packed straight into the served layout (no checkpoint on disk)."""
    cfg = qwen3_moe.Qwen3MoeConfig.from_hf(hf)
    rng = np.random.default_rng(seed)
    d, f, e, v = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.vocab_size

    def r(*shape, s=0.05):
        return (s * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    layers = []
    for _ in range(cfg.num_layers):
        layers.append(
            {
                "wqkv": r(d, cfg.q_size + 2 * cfg.kv_size),
                "wo": r(cfg.q_size, d),
                "ln_attn": 1 + r(d),
                "ln_mlp": 1 + r(d),
                "q_norm": 1 + r(cfg.head_dim),
                "k_norm": 1 + r(cfg.head_dim),
                "router": r(d, e, s=1.0),
                "w_gate_up": r(e, d, 2 * f),
                "w_down": r(e, f, d),
            }
        )
    params = {
        "embed": jnp.asarray(r(v, d, s=1.0)),
        "lm_head": jnp.asarray(r(d, v)),
        "final_norm": jnp.ones(d, jnp.float32),
        "inv_freq": jnp.asarray(cfg.rope.inv_freq()[0]),
        "rope_scale": jnp.float32(1.0),
        "layers": [{k: jnp.asarray(a) for k, a in lp.items()} for lp in layers],
    }
    return LoadedModel("random-qwen3-moe", qwen3_moe, cfg, params, None, ())


def distinct_experts_per_step(model: LoadedModel, batch: int) -> float:
    """Mean distinct experts one decode step selects per MoE layer, for random tokens.

    Measured by routing the layer inputs of a real forward (hooked MLP), not estimated.
    """
    counts: list[int] = []
    cfg = model.cfg

    def hooked(cfg_, lp, x):
        if "router" in lp:
            _, idx = route(lp["router"], x.reshape(-1, x.shape[-1]), cfg.top_k, cfg.norm_topk_prob)
            jax.debug.callback(lambda i: counts.append(len(np.unique(np.asarray(i)))), idx)
        return qwen3_moe.moe_mlp(cfg_, lp, x)

    ps = 16
    pool = KVPool.create(cfg.num_layers, batch + 1, ps, cfg.num_kv_heads, cfg.head_dim)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (batch, 1)).astype(np.int32)
    table = (1 + np.arange(batch, dtype=np.int32))[:, None]
    jax.jit(
        lambda p, k, v: qwen3_moe.llama.forward(
            cfg,
            p,
            tokens,
            np.zeros((batch, 1), np.int32),
            k,
            v,
            table,
            np.zeros(batch, np.int32),
            mlp=hooked,
        )
    )(model.params, pool.k, pool.v)[0].block_until_ready()
    jax.effects_barrier()
    return float(np.mean(counts))


def bench_moe(
    model: LoadedModel,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    bandwidth: float,
    impl: str = "auto",
) -> dict:
    cfg = dataclasses.replace(model.cfg, moe_impl=impl)
    times, _ = time_decode(model, cfg, batch, context, steps, warmup)
    stats = summary.run_stats(times)  # every decode bench's statistic
    ms = stats.median_ms
    p = model.params
    expert_keys = ("w_gate_up", "w_down")
    dense = sum(int(a.nbytes) for lp in p["layers"] for k, a in lp.items() if k not in expert_keys)
    dense += int(p["lm_head"].nbytes) + batch * cfg.hidden_size * 4
    per_expert = sum(int(lp[k][0].nbytes) for k in expert_keys for lp in p["layers"][:1])
    distinct = distinct_experts_per_step(model, batch)
    experts_read = int(distinct * per_expert * len(cfg.moe_layers))
    if impl == "dense":
        experts_read = per_expert * cfg.num_experts * len(cfg.moe_layers)
    kv = batch * context * cfg.num_layers * 2 * cfg.kv_size * 4
    floor_bytes = dense + int(distinct * per_expert * len(cfg.moe_layers)) + kv
    floor_ms = summary.floor_ms(floor_bytes, bandwidth)
    return {
        "engine": f"megaserve-xla-moe[{impl}]",
        "precision": "f32",
        "batch": batch,
        "context": context,
        **stats.fields("ms_per_step"),
        "tokens_per_s": summary.tokens_per_s(batch, ms),
        "dense_bytes": dense,
        "expert_bytes_read": experts_read,
        "kv_bytes": kv,
        "distinct_experts_per_layer": distinct,
        "experts_total": cfg.num_experts,
        "bytes_per_step": dense + experts_read + kv,
        "floor_ms": floor_ms,
        "floor_fraction": summary.floor_fraction(floor_ms, ms),
    }


# One MoE layer per shape, (hidden, moe_intermediate, experts, top_k): BENCH_CONFIG's, and
# Qwen3-30B-A3B's (2048, 768, 128, 8) with hidden and intermediate halved to fit a CPU.
PREFILL_SHAPES = {"bench": (512, 256, 64, 8), "qwen3-30b-a3b/2": (1024, 384, 128, 8)}
# dense: the reference, every expert on every token (timed first: its output is the truth);
# ours: what a prefill program runs (`moe_prefill`: the expert loop off TPU); ragged_dot: the
# path it replaced (on CPU XLA it multiplies every pair by every expert: k x dense).
PREFILL_IMPLS = {"dense": moe_dense, "ours": moe_prefill, "ragged_dot": moe_grouped}
# An impl whose warm-up call takes longer is timed once (ragged_dot at 2048 tokens: minutes).
SLOW_CALL_S = 10.0


def _timed_calls(fn, args, runs: int, warmup: int) -> tuple[list[float], np.ndarray]:
    """Seconds of each timed call after max(1, warmup) untimed ones (the first compiles), and
    the last output."""
    t0 = time.perf_counter()
    out = fn(*args).block_until_ready()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1 if first < SLOW_CALL_S else 0):
        fn(*args).block_until_ready()
    times = []
    for _ in range(runs if first < SLOW_CALL_S else 1):
        t0 = time.perf_counter()
        out = fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times, np.asarray(out)


def bench_moe_prefill(shape: str, tokens: int, runs: int, warmup: int) -> list[dict]:
    """One f32 MoE layer (routing excluded) on `tokens` random tokens, routed by a random
    router: each impl's ms per call (median of `runs`) and its largest difference from the
    dense reference."""
    d, f, e, k = PREFILL_SHAPES[shape]
    rng = np.random.default_rng(tokens)
    w_gate_up = jnp.asarray(0.05 * rng.standard_normal((e, d, 2 * f), dtype=np.float32))
    w_down = jnp.asarray(0.05 * rng.standard_normal((e, f, d), dtype=np.float32))
    x = jnp.asarray(rng.standard_normal((tokens, d), dtype=np.float32))
    weights, idx = route(jnp.asarray(rng.standard_normal((d, e), dtype=np.float32)), x, k, True)
    args = (w_gate_up, w_down, weights, idx, x)
    active = 2 * tokens * k * 3 * d * f  # the flops of the selected experts only
    rows, ref = [], None
    for name, impl in PREFILL_IMPLS.items():
        times, out = _timed_calls(jax.jit(impl), args, runs, warmup)
        ref = out if ref is None else ref
        stats = summary.run_stats(times)
        rows.append(
            {
                "shape": shape,
                "hidden": d,
                "moe_intermediate": f,
                "experts": e,
                "top_k": k,
                "tokens": tokens,
                "impl": name,
                **stats.fields("ms_per_call"),
                "active_gflop_per_s": active / stats.median_ms / 1e6,
                "max_abs_diff_vs_dense": float(np.max(np.abs(out - ref))),
            }
        )
    return rows
