"""`megaserve kernels compile --topology T --tp N --megakernel`: the tensor-parallel megakernel
step (one kernel per device, h all-reduced inside it by remote DMA) compiled for a
compile-only topology's devices, with VMEM, per-device HBM bytes/step vs floor, the in-kernel
and XLA collectives, and the projected step time (HBM vs ICI)."""

from __future__ import annotations

import math
import time
from typing import Any

from megaserve_app.collectives import collectives, summarize
from megaserve_app.compile_mesh import (
    HBM_BYTES_PER_S,
    ICI_SEND_BYTES_PER_S,
    ROUND_LATENCY_S,
    MeshCompile,
    _project,
    topology_mesh,
)


def _abstract_args(plan: Any, mesh: Any, req: MeshCompile, pages: int, row: int) -> tuple:
    """ShapeDtypeStructs of `tp_megakernel_step`'s arguments on the topology's mesh: the
    stacked rings split over tp, the pool split by KV heads and pinned row-major (as
    `target.compile_plan` pins it: the kernel's page DMAs need that layout)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.layout import Format, Layout
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kernels.megakernel.pack import abstract_params
    from kernels.tp_llama import AXIS, KV_SPEC

    by_tp = NamedSharding(mesh, P(AXIS))
    mp = {
        k: jax.ShapeDtypeStruct((req.tp, *v.shape), v.dtype, sharding=by_tp)
        for k, v in abstract_params(plan).items()
    }
    shape = (plan.num_layers, pages, req.page_size, req.tp * row)
    pool = Format(Layout(major_to_minor=tuple(range(4))), NamedSharding(mesh, KV_SPEC))
    kv = jax.ShapeDtypeStruct(shape, plan.kv_dtype, sharding=pool)
    rep = NamedSharding(mesh, P())
    b, i32 = req.batch, jnp.int32
    host = [jax.ShapeDtypeStruct((b,), i32, sharding=rep) for _ in range(2)]
    pt = jax.ShapeDtypeStruct((b, plan.pages_per_seq), i32, sharding=rep)
    return (mp, kv, kv, *host, pt), pool, rep


def _step_bytes(cfg: Any, plan: Any, req: MeshCompile, pages_per_seq: int) -> dict[str, int]:
    """Per-device HBM bytes of one step (every row at the end of `context`): the kernel's
    DMAs by the schedule walk, the embedding rows, and the page scatter after the kernel
    (read the kernel's page outputs, write them into the pool); the floor: one device's
    minimum (`schedule.floor_bytes`) split over tp."""
    import numpy as np

    from kernels.megakernel import schedule
    from kernels.megakernel.plan import make_plan

    positions = [req.context - 1] * req.batch
    dma = schedule.dma_bytes(plan, positions)
    kvb = np.dtype(plan.kv_dtype).itemsize
    scatter = 2 * 2 * plan.num_layers * req.batch * req.page_size * plan.kv_row * kvb
    embed = req.batch * plan.hidden_p * np.dtype(plan.weight_dtype).itemsize
    whole = make_plan(cfg, req.batch, req.page_size, pages_per_seq, vmem_budget=2**62)
    floor = sum(schedule.floor_bytes(cfg, whole, positions).values()) / req.tp
    total = sum(dma.values()) + scatter + embed
    return {
        "hbm_bytes_per_step": int(total),
        "floor_bytes_per_step": int(floor),
        "bytes_over_floor": round(total / floor, 4),
        "dma_bytes": dma,
        "page_scatter_bytes": scatter,
    }


def _all_reduce_traffic(plan: Any) -> tuple[int, int]:
    """(rounds, ICI bytes one device sends) per step of the kernel's own all-reduces: two per
    layer of f32[B, hidden_p]; one_shot sends the whole partial to tp - 1 peers in one round,
    two_phase a 1/tp column block to each peer twice (reduce-scatter, all-gather)."""
    n, tp, b = 2 * plan.num_layers, plan.tp, plan.batch
    if plan.all_reduce == "one_shot":
        return n, n * (tp - 1) * b * plan.hidden_p * 4
    return 2 * n, n * 2 * (tp - 1) * b * plan.reduce_block_cols * 4


def compile_megakernel_mesh(req: MeshCompile) -> dict[str, Any]:
    """Compiles the tp megakernel step (batch, context) over the topology's mesh; returns the
    JSON-able report. ValueError on a bad request (mesh size, tp not dividing, MoE)."""
    import jax

    from kernels.kv_cache import pool_row
    from kernels.megakernel import tp as mtp
    from kernels.megakernel.aot import _relayout_copies, load_config
    from megaserve.parallel.mesh import ParallelConfig

    if req.ep != 1:
        raise ValueError(f"--megakernel with --ep {req.ep}: the megakernel splits no experts yet")
    cfg = load_config(req.config_path)
    lay = ParallelConfig(req.tp, 1).check_model(cfg)
    mesh, processes = topology_mesh(req.topology, ParallelConfig(req.tp, 1))
    per_seq = math.ceil(req.context / req.page_size)
    row = pool_row(lay.kv_heads, cfg.head_dim, "tpu")
    plan = mtp.tp_plan(cfg, lay, req.batch, req.page_size, per_seq, kv_row=row, emit_logits=False)
    pages = req.batch * per_seq + 1
    args, pool, rep = _abstract_args(plan, mesh, req, pages, row)

    def step(mp, k, v, tok, pos, pt):
        return mtp.tp_megakernel_step(plan, lay, mesh, mp, k, v, tok, pos, pt)[:4]

    head = {
        "config": req.config_path,
        "model_type": cfg.model_type,
        "topology": req.topology,
        "processes": processes,
        "program": "megakernel",
        "tp": req.tp,
        "kv_heads_per_device": lay.kv_heads,
        "kv_replicas": lay.kv_replicas,
        "batch": req.batch,
        "context": req.context,
        "assumed": {
            "hbm_bytes_per_s_per_device": HBM_BYTES_PER_S,
            "ici_send_bytes_per_s_per_device": ICI_SEND_BYTES_PER_S,
            "round_latency_s": ROUND_LATENCY_S,
        },
    }
    fn = jax.jit(step, donate_argnums=(1, 2), out_shardings=(rep, None, pool, pool))
    t0 = time.perf_counter()
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # compile-only: no client
    try:
        compiled = fn.trace(*args).lower().compile()
    except Exception as e:  # the compiler's message is the useful output
        return head | {"compiled": False, "error": f"{type(e).__name__}: {e}"[:4000]}
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was)
    mem, hlo = compiled.memory_analysis(), compiled.as_text()
    xla = summarize(collectives(hlo))
    ar_rounds, ar_bytes = _all_reduce_traffic(plan)
    r: dict[str, Any] = {
        "compiled": True,
        "compile_s": round(time.perf_counter() - t0, 2),
        "vmem_bytes": plan.vmem_bytes(),
        "depths": {"a": plan.depth_a, "b": plan.depth_b, "kv": plan.depth_kv},
        "argument_bytes": int(mem.argument_size_in_bytes),
        "hbm_temp_bytes": int(mem.temp_size_in_bytes),
        "relayout_copies": _relayout_copies(hlo, [args[1].shape]),
        "in_kernel_all_reduce": {
            "kind": plan.all_reduce,
            "rounds": ar_rounds,
            "ici_bytes_per_device": ar_bytes,
        },
        "xla_collectives": xla,
        "collective_rounds": ar_rounds + xla["collective_rounds"],
        "ici_bytes_per_device": ar_bytes + xla["ici_bytes_per_device"],
        **_step_bytes(cfg, plan, req, per_seq),
    }
    _project(r, "hbm_bytes_per_step")
    return head | {"compiled": True, "decode": r}
