"""`megaserve kernels compile --topology T --tp N`: the tensor-parallel decode step and prefill
chunk a worker runs over a mesh, compiled for a compile-only TPU topology's devices, with
per-device memory, HBM bytes per step against the per-device floor, the collectives read back
from the HLO (rounds, ICI bytes), and the projected step time (HBM vs ICI)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from megaserve_app.collectives import collectives, summarize

# Per JAX device (one TensorCore; a tpu7x chip is two): half the chip's published 7.37 TB/s
# HBM, and of its 1.2 TB/s bidirectional ICI, a quarter each way (two devices share the
# chip's links; a ring sends and receives at once). Assumptions for projections only.
HBM_BYTES_PER_S = 7.37e12 / 2
ICI_SEND_BYTES_PER_S = 1.2e12 / 4
# A collective's fixed cost (launch, barrier, hops), assumed: the rounds term of the projection.
ROUND_LATENCY_S = 10e-6


@dataclass(frozen=True)
class MeshCompile:
    """What `kernels compile --topology` builds: one model over tp devices of a topology."""

    config_path: str
    topology: str = "tpu7x:2x2x1"
    tp: int = 8
    ep: int = 1
    batch: int = 8
    context: int = 4096
    chunk: int = 512  # prefill: new tokens per call (one sequence at `context`)
    page_size: int = 16
    dtype: str = "bf16"


def topology_mesh(topology: str, parallel: Any):
    """(Mesh, processes) over a compile-only topology's devices, laid out as a worker's
    `make_mesh`; ValueError unless the mesh uses all of them (a tpu7x host's 8 devices, 16
    over 2 processes for 2x2x2, ...)."""
    from jax.experimental import topologies

    from kernels.megakernel.target import quiet_env
    from megaserve.parallel.mesh import make_mesh

    quiet_env()
    try:
        devs = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    except Exception as e:  # libtpu's message names what it refused
        raise ValueError(f"--topology {topology!r}: {e}") from e
    if parallel.devices != len(devs):
        raise ValueError(
            f"the mesh has tp={parallel.tp} x ep={parallel.ep} = {parallel.devices} devices "
            f"but {topology} has {len(devs)}: they must be equal"
        )
    return make_mesh(parallel, list(devs)), len({d.process_index for d in devs})


def _sharded_bytes(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of abstract arrays under their shardings."""
    import jax

    leaves, shards = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    return sum(
        math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        for x, s in zip(leaves, shards, strict=True)
    )


def _setup(cfg: Any, lay: Any, mesh: Any, dtype: Any):
    """(abstract global params, specs, programs) of the tensor (x expert) parallel step, as
    `TpXlaRunner` jits them."""
    import jax

    from kernels.registry import family_for
    from kernels.tp_llama import param_specs
    from kernels.tp_step import tp_decode_program, tp_jit, tp_prefill_program

    family, _ = family_for(cfg.model_type)
    params = family.abstract_params(cfg, dtype)
    # `shard_major_params`' global shapes: q|k|v with each shard's KV heads (replicas
    # repeated), the lm_head padded to tp x vocab_local columns.
    qkv = lay.tp * (lay.heads + 2 * lay.kv_heads) * cfg.head_dim

    def widen(x, cols):
        return jax.ShapeDtypeStruct((*x.shape[:-1], cols), x.dtype)

    for lp in params["layers"]:
        lp.update({k: widen(lp[k], qkv) for k in ("wqkv", "bqkv") if k in lp})
    params["lm_head"] = widen(params["lm_head"], lay.tp * lay.vocab)
    specs = param_specs(params)

    def jit(program, n_rest, *static):
        return tp_jit(partial(program, cfg, lay, mesh, specs, *static), mesh, specs, n_rest)

    programs = {"decode": jit(tp_decode_program, 4, 1, True), "prefill": jit(tp_prefill_program, 5)}
    return params, specs, programs


def _args(kind: str, req: MeshCompile, params: Any, kv: Any) -> tuple:
    import jax

    from kernels.programs import abstract
    from megaserve.sampling_params import SamplingArrays

    i32 = np.int32
    b = req.batch if kind == "decode" else 1
    width = math.ceil(req.context / req.page_size)
    s = abstract(SamplingArrays.greedy(b).padded(b))
    if kind == "decode":
        tok = jax.ShapeDtypeStruct((b,), i32)
        return params, kv, kv, tok, tok, jax.ShapeDtypeStruct((b, width), i32), s
    rows = jax.ShapeDtypeStruct((b, req.chunk), i32)
    return (params, kv, kv, rows, rows, jax.ShapeDtypeStruct((b, width), i32),
            jax.ShapeDtypeStruct((b,), i32), s)  # fmt: skip


def _compile(fn, args) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        compiled = fn.trace(*args).lower().compile()
    except Exception as e:  # the compiler's message is the useful output
        return {"compiled": False, "error": f"{type(e).__name__}: {e}"[:2000],
                "compile_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    return {
        "compiled": True,
        "compile_s": round(time.perf_counter() - t0, 2),
        "hbm_temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        **summarize(collectives(hlo)),
        "_hlo": hlo,
    }


def _decode_bytes(cfg, req: MeshCompile, held: dict, row: int, w: int) -> dict:
    """HBM bytes one device moves per decode step (every row at the end of `context`): the
    weights it holds but the embedding table (only the batch's rows) and, of its routed
    experts, the share a batch selects under uniform routing; and its KV of every token. The
    floor: the single-device minimum (weights unpadded, each KV head once, the selected
    experts once) split evenly over the mesh, so replication (KV heads below tp, attention
    on every ep shard) shows as bytes over the floor. held: `_held_bytes`; w: bytes per
    weight and KV element."""
    from kernels.megakernel.schedule import expected_distinct_experts

    d, b, layers = cfg.hidden_size, req.batch, cfg.num_layers
    e = getattr(cfg, "num_experts", 0)
    picked = expected_distinct_experts(e, getattr(cfg, "top_k", 0), b) / e if e else 0.0
    kv = b * req.context * layers * 2 * row * w
    ours = held["weights"] - held["embed"] - held["experts"] * (1 - picked) + b * d * w + kv
    attn = d * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * d
    moe = set(getattr(cfg, "moe_layers", ()))
    per_expert = 3 * d * getattr(cfg, "moe_intermediate_size", 0)
    single = (
        sum(
            attn
            + 2 * d
            + (d * e + per_expert * e * picked if i in moe else 3 * d * cfg.intermediate_size)
            for i in range(layers)
        )
        * w
        + (d * cfg.vocab_size + d) * w
    )
    kv_floor = b * (req.context - 1) * layers * 2 * cfg.kv_size * w
    floor = (single + b * d * w + kv_floor) / (req.tp * req.ep)
    return {
        "hbm_bytes_per_step": int(ours),
        "floor_bytes_per_step": int(floor),
        "bytes_over_floor": round(ours / floor, 4),
        "experts_selected_fraction": round(picked, 4),
    }


def _held_bytes(params: dict, named: dict) -> dict:
    """Bytes one device holds: all weights, the embedding table, the routed experts."""
    experts = [
        (lp[k], nl[k])
        for lp, nl in zip(params["layers"], named["layers"], strict=True)
        if "router" in lp
        for k in ("w_gate_up", "w_down")
    ]
    return {
        "weights": _sharded_bytes(params, named),
        "embed": _sharded_bytes(params["embed"], named["embed"]),
        "experts": _sharded_bytes([x for x, _ in experts], [n for _, n in experts]),
    }


def _project(r: dict, nbytes: str) -> None:
    """r["projected_ms"]: HBM, ICI and per-round terms at the assumed rates (projected)."""
    hbm_ms = 1e3 * r[nbytes] / HBM_BYTES_PER_S
    ici_ms = 1e3 * r["ici_bytes_per_device"] / ICI_SEND_BYTES_PER_S
    rounds_ms = 1e3 * r["collective_rounds"] * ROUND_LATENCY_S
    r["projected_ms"] = {
        "hbm": round(hbm_ms, 4), "ici": round(ici_ms, 4), "rounds": round(rounds_ms, 4),
        "serial_total": round(hbm_ms + ici_ms + rounds_ms, 4),
    }  # fmt: skip


def compile_mesh(req: MeshCompile) -> dict[str, Any]:
    """Compiles the decode step (batch, context) and the prefill chunk (1 x chunk at
    context) over the topology's mesh; returns the JSON-able report. ValueError on a bad
    request (a mesh that is not the topology's size, tp not dividing the heads...)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernels.megakernel.aot import load_config
    from kernels.tp_llama import KV_SPEC, local_pool_row
    from megaserve.memory_plan import MemoryPlan
    from megaserve.parallel.mesh import ParallelConfig
    from megaserve_app.compile_prefill import _vmem, chunk_bytes, chunk_flops
    from megaserve_app.compile_worker import HBM_PER_DEVICE

    for name in ("batch", "context", "chunk", "page_size"):
        if getattr(req, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(req, name)} must be >= 1")
    cfg = load_config(req.config_path)
    parallel = ParallelConfig(req.tp, req.ep)
    lay = parallel.check_model(cfg)  # MeshError (a ValueError) naming the numbers
    mesh, processes = topology_mesh(req.topology, parallel)
    dtype = jnp.bfloat16 if req.dtype == "bf16" else jnp.float32
    params, specs, programs = _setup(cfg, lay, mesh, dtype)
    row, kvb = local_pool_row(cfg, lay, "tpu"), np.dtype(dtype).itemsize
    pages = req.batch * math.ceil(req.context / req.page_size) + 1
    kv = jax.ShapeDtypeStruct((cfg.num_layers, pages, req.page_size, req.tp * row), dtype)
    named = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
    held = _held_bytes(params, named)
    pool = _sharded_bytes(kv, NamedSharding(mesh, KV_SPEC))
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # compile-only: no client
    try:
        out = {k: _compile(fn, _args(k, req, params, kv)) for k, fn in programs.items()}
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was)
    dec, pre = out["decode"], out["prefill"]
    dec.update(_decode_bytes(cfg, req, held, row, kvb))
    for r in (dec, pre):
        r["vmem_bytes"] = _vmem(r.pop("_hlo", ""))
    flops = chunk_flops(cfg, 1, req.chunk, req.context)
    pre["flops_per_chunk_per_device"] = sum(flops.values()) // (req.tp * req.ep)
    block_q = next(n for n in (128, 64, 32, 16, 8, 1) if req.chunk % n == 0)
    pre["hbm_bytes_per_chunk"] = chunk_bytes(
        held["weights"], cfg, 1, req.chunk, req.context, row, kvb, block_q
    )
    for r, nbytes in ((dec, "hbm_bytes_per_step"), (pre, "hbm_bytes_per_chunk")):
        if r["compiled"]:
            _project(r, nbytes)
    capacity = HBM_PER_DEVICE["tpu7x"]
    temp = max(r.get("hbm_temp_bytes") or 0 for r in (dec, pre))
    plan = MemoryPlan(held["weights"], pool, temp, capacity)
    return {
        "config": req.config_path,
        "model_type": cfg.model_type,
        "topology": req.topology,
        "processes": processes,
        "tp": req.tp,
        "ep": req.ep,
        "kv_heads_per_device": lay.kv_heads,
        "kv_replicas": lay.kv_replicas,
        "batch": req.batch,
        "context": req.context,
        "chunk": req.chunk,
        "dtype": req.dtype,
        "compiled": dec["compiled"] and pre["compiled"],
        "decode": dec,
        "prefill": pre,
        "hbm_per_device": plan.as_dict() | {"kv_pool_pages": pages},
        "fits": plan.fits,
        "assumed": {
            "hbm_bytes_per_s_per_device": HBM_BYTES_PER_S,
            "ici_send_bytes_per_s_per_device": ICI_SEND_BYTES_PER_S,
            "round_latency_s": ROUND_LATENCY_S,
        },
    }
