"""Run in a subprocess with forced host devices (test_megakernel_tp): the megakernel on one
device and over tp shards in the TPU interpreter, several greedy steps; one JSON line."""

from __future__ import annotations

import json
import os
import sys
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from kernels.megakernel import mlp  # noqa: E402
from kernels.megakernel import tp as mtp  # noqa: E402
from kernels.megakernel.pack import pack_megakernel  # noqa: E402
from kernels.megakernel.plan import make_plan  # noqa: E402
from kernels.megakernel.step import megakernel_step, reference_step  # noqa: E402
from kernels.tp_llama import KV_SPEC, tp_layout  # noqa: E402
from megaserve import compile_cache  # noqa: E402
from megaserve.parallel.mesh import ParallelConfig, make_mesh  # noqa: E402
from tests.megakernel_minis import PS, mini_model  # noqa: E402

compile_cache.configure_jax()

# Ragged rows: mid-page, on a page boundary, the very first token, and a padding row.
PAGE_TABLE = np.array([[1, 2, 3, 4], [5, 6, 0, 0], [7, 0, 0, 0], [0, 0, 0, 0]], np.int32)
POSITIONS = np.array([40, 16, 0, -1], np.int32)
TOKENS = np.array([3, 9, 11, 0], np.int32)
F32 = dict(act_dtype=jnp.float32)  # f32 matmul inputs: only the summation order differs


def _pools(cfg, seed=0):
    rng = np.random.default_rng(seed)
    shape = (cfg.num_layers, 9, PS, cfg.num_kv_heads * cfg.head_dim)
    return [(rng.standard_normal(shape) * 0.5).astype(np.float32) for _ in range(2)]


def _tp_pool(a: np.ndarray, cfg, lay, mesh):
    """The one-device pool re-laid per shard: KV heads in order, each repeated kv_replicas."""
    a = a.reshape(*a.shape[:3], cfg.num_kv_heads, cfg.head_dim)
    a = np.repeat(a, lay.kv_replicas, axis=3).reshape(*a.shape[:3], -1)
    return jax.device_put(jnp.asarray(a, jnp.bfloat16), NamedSharding(mesh, KV_SPEC))


def _one_device_pool(a, lay, cfg):
    """A tp pool back in one device's layout (the first replica of each KV head)."""
    a = np.asarray(a.astype(jnp.float32)).reshape(*a.shape[:3], -1, cfg.head_dim)
    return a[:, :, :, :: lay.kv_replicas].reshape(*a.shape[:3], -1)


def _loop(step, k, v, steps: int):
    """`steps` greedy steps from TOKENS/POSITIONS; (tokens per step, logits per step, k, v)."""
    tokens, positions = TOKENS, POSITIONS
    live = POSITIONS >= 0
    out_tokens, out_logits = [], []
    for _ in range(steps):
        greedy, logits, k, v, _ = step(k, v, tokens, positions, PAGE_TABLE)
        out_tokens.append(np.asarray(greedy)[live].tolist())
        out_logits.append(np.asarray(logits)[live])
        tokens = np.where(live, np.asarray(greedy), 0).astype(np.int32)
        positions = np.where(live, positions + 1, -1).astype(np.int32)
    return out_tokens, out_logits, k, v


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def main(kind: str, tp: int, steps: int, one_slot: bool, reduce: str) -> dict:
    if one_slot:  # negative control: both all-reduces share a slot, a race the checker sees
        mlp.MLP_SLOT = 0
    model, _ = mini_model(kind)
    cfg = model.cfg
    k, v = _pools(cfg)
    plan1 = make_plan(cfg, 4, PS, 4, **F32)
    mp1 = pack_megakernel(plan1, model.params)
    bf = partial(jnp.asarray, dtype=jnp.bfloat16)
    one = jax.jit(partial(megakernel_step, plan1, mp1, interpret=True))
    ref = jax.jit(partial(reference_step, plan1, mp1))
    t1, l1, k1, v1 = _loop(one, bf(k), bf(v), steps)
    tr, lr, _, _ = _loop(ref, bf(k), bf(v), steps)
    lay = tp_layout(cfg, tp)
    mesh = make_mesh(ParallelConfig(tp=tp))
    plan = mtp.tp_plan(cfg, lay, 4, PS, 4, all_reduce=reduce, **F32)
    mp = mtp.place(mtp.pack_tp_megakernel(plan, cfg, lay, model.params), mesh)
    races = pltpu.InterpretParams(detect_races=True)
    step = jax.jit(partial(mtp.tp_megakernel_step, plan, lay, mesh, mp, interpret=races))
    kt, vt = _tp_pool(k, cfg, lay, mesh), _tp_pool(v, cfg, lay, mesh)
    t2, l2, k2, v2 = _loop(step, kt, vt, steps)
    # Pools compared in bf16 ulps of their values (a 1e-7 f32 difference can round a bf16
    # element to its neighbour).
    kv_ulps = max(
        float(
            np.max(
                np.abs(_one_device_pool(b, lay, cfg) - np.asarray(a.astype(jnp.float32)))
                / np.maximum(np.abs(np.asarray(a.astype(jnp.float32))), 1e-3)
                * 128
            )
        )
        for a, b in ((k1, k2), (v1, v2))
    )
    return {
        "devices": len(jax.devices()),
        "kv_replicas": lay.kv_replicas,
        "one_tokens": t1,
        "tp_tokens": t2,
        "ref_tokens": tr,
        "tp_vs_one": max(_rel(a, b) for a, b in zip(l2, l1)),
        "tp_vs_ref": max(_rel(a, b) for a, b in zip(l2, lr)),
        "one_vs_ref": max(_rel(a, b) for a, b in zip(l1, lr)),
        "kv_ulps": kv_ulps,
    }


def runner_main(tp: int) -> dict:
    """`make_runner(backend="pallas", parallel=tp)` against the tp XLA runner: a 2-row prefill
    (one row 8 tokens, one 2) then 3 decode steps, f32 matmul inputs in the kernel."""
    from megaserve.parallel.tp_pool import tp_pool
    from megaserve.runner.batch import TokenBatch
    from megaserve.runner.buckets import StepConfig
    from megaserve.runner.factory import make_runner
    from megaserve.sampling_params import SamplingArrays

    model, _ = mini_model("dense")
    cfg, parallel = model.cfg, ParallelConfig(tp=tp)
    step_cfg = StepConfig(batch_buckets=(1, 2), max_pages_per_seq=4)
    prompt = np.array([[5, 9, 2, 7, 1, 3, 8, 4], [6, 1, 0, 0, 0, 0, 0, 0]], np.int32)
    positions = np.array([np.arange(8), [0, 1, -1, -1, -1, -1, -1, -1]], np.int32)
    table = np.array([[1, 2, 0, 0], [3, 0, 0, 0]], np.int32)
    out, kinds = {}, {}
    for backend in ("xla", "pallas"):
        pool = tp_pool(cfg, parallel, 9, PS, model.params["embed"].dtype)
        r = make_runner(model.family, cfg, model.params, pool, step_cfg, backend,
                        matmul_dtype=jnp.float32, parallel=parallel)  # fmt: skip
        kinds[backend] = type(r).__name__
        first, _ = r.prefill(TokenBatch.from_padded(prompt, positions, table),
                             SamplingArrays.greedy(2))  # fmt: skip
        batch = TokenBatch.decode(first, np.array([8, 2], np.int32), table)
        toks, logits = r.decode(batch, SamplingArrays.greedy(2), 3, True)
        out[backend] = (np.asarray(first).tolist(), np.asarray(toks).tolist(), logits)
    return {
        "devices": len(jax.devices()),
        "runners": kinds,
        "tokens": {b: [o[0], o[1]] for b, o in out.items()},
        "logits_vs_xla": _rel(out["pallas"][2], out["xla"][2]),
    }


if __name__ == "__main__":
    if sys.argv[1] == "runner":
        print(json.dumps(runner_main(int(sys.argv[2]))))
        sys.exit(0)
    kind, tp, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    reduce = "two_phase" if "--two-phase" in sys.argv else "one_shot"
    print(json.dumps(main(kind, tp, steps, "--one-slot" in sys.argv, reduce)))
