"""AOT compilation of the megakernel for TPU v7 on a CPU host (libtpu compile-only topology)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# libtpu reads these when jax first initialises it; without them it probes GCE metadata and
# prints pages of warnings. Only defaults: a real TPU host's own settings win.
_QUIET_LIBTPU = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_WORKER_ID": "0",
    # Compile-only use touches no chip, so several processes may hold libtpu at once (a test
    # process and the CLI it runs); without this the second fails on /tmp/libtpu_lockfile.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}

# Compile-only topologies by target name; `tpu7x` is TPU v7 (Ironwood), one chip = 2 cores.
TOPOLOGIES = {"tpu7x": "tpu7x:2x2x1", "v6e": "v6e:1x1", "v5e": "v5e:1x1"}
# HBM bandwidth per chip used for the projected step time. TPU7x (Ironwood): 7.37 TB/s per
# chip (Cloud TPU7x spec; the launch post said 7.2 TB/s), 192 GiB HBM on two dies of one
# TensorCore each. v6e: 1.64 TB/s; v5e: 0.82 TB/s (one TensorCore per chip).
HBM_BYTES_PER_S = {"tpu7x": 7.37e12, "v6e": 1.64e12, "v5e": 0.819e12}
# TensorCores per chip: one pallas_call runs on one core, which on tpu7x sits on one die with
# half the chip's HBM and bandwidth, so the per-core projection divides by this.
CORES_PER_CHIP = {"tpu7x": 2, "v6e": 1, "v5e": 1}


@dataclass(frozen=True)
class CompileRequest:
    config_path: str
    target: str = "tpu7x"
    batch: int = 1
    context: int = 4096
    page_size: int = 16
    emit_logits: bool = True
    # Force ring A's depth (skips the VMEM fit): to see the compiler's own verdict on a plan.
    depth_a: int | None = None


def _quiet_env() -> None:
    for k, v in _QUIET_LIBTPU.items():
        os.environ.setdefault(k, v)


def load_config(path: str) -> Any:
    """The family config built from an HF-style config.json; ValueError naming the problem."""
    from kernels.registry import family_for

    try:
        hf = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read config {path}: {e}") from e
    _, config_cls = family_for(hf.get("model_type"))
    return config_cls.from_hf(hf)


def _relayout_copies(hlo: str, shapes: list[tuple[int, ...]]) -> list[str]:
    """HLO copy instructions on any of the given (large) shapes: a re-layout XLA inserted."""
    out = []
    for shape in shapes:
        pat = re.escape("[" + ",".join(map(str, shape)) + "]") + r"\S*\s+copy\("
        out += [ln.strip()[:160] for ln in hlo.splitlines() if re.search(pat, ln)]
    return out


def compile_megakernel(req: CompileRequest) -> dict[str, Any]:
    """Compiles one decode step at real shapes for `req.target` and accounts its bytes.

    Returns:
      a JSON-able dict: compiled (bool), error (the compiler's message when not), vmem_bytes,
      hbm_bytes_per_step, floor_bytes_per_step, their ratio, projected_ms_per_step, and the
      breakdowns behind them.
    Raises:
      ValueError for a bad request (unknown target, unreadable or unsupported config).
    """
    if req.target not in TOPOLOGIES:
        raise ValueError(f"target {req.target!r} is not one of {sorted(TOPOLOGIES)}")
    if req.batch < 1 or req.context < 2:
        raise ValueError(f"batch={req.batch} must be >= 1 and context={req.context} >= 2")
    _quiet_env()
    from kernels.megakernel.plan import make_plan

    cfg = load_config(req.config_path)
    pages = math.ceil(req.context / req.page_size)
    forced = {} if req.depth_a is None else {"depth_a": req.depth_a, "vmem_budget": 2**40}
    plan = make_plan(cfg, req.batch, req.page_size, pages, emit_logits=req.emit_logits, **forced)
    result = _accounting(req, cfg, plan)
    _compile(req, plan, result)
    return result


def _accounting(req: CompileRequest, cfg: Any, plan: Any) -> dict[str, Any]:
    """The request's result dict before compiling: VMEM, bytes per step, floor, projections."""
    from kernels.megakernel import schedule

    # Every row at the end of a full context: it reads context - 1 earlier tokens.
    positions = [req.context - 1] * req.batch
    distinct = [schedule.expected_distinct_experts(plan.num_experts, plan.top_k, req.batch)] * len(
        plan.moe_layers
    )
    dma = schedule.dma_bytes(plan, positions, distinct)
    floor = schedule.floor_bytes(cfg, plan, positions, distinct)
    # Beyond the kernel's own DMAs: the embedding rows XLA gathers before it, and the f32
    # logits block the pallas_call writes back after it.
    outside = floor["embedding_rows"]
    if plan.emit_logits:
        outside += plan.batch * plan.vocab_tiles * plan.ta * 4
    hbm = sum(dma.values()) + outside
    hbm_padded = sum(schedule.dma_bytes(plan, positions, distinct, padded=True).values())
    hbm_padded += outside
    floor_total = sum(floor.values())
    bandwidth = HBM_BYTES_PER_S[req.target]
    return {
        "config": str(req.config_path),
        "model_type": cfg.model_type,
        "target": req.target,
        "batch": req.batch,
        "context": req.context,
        "page_size": req.page_size,
        "compiled": False,
        "vmem_bytes": plan.vmem_bytes(),
        "vmem_limit_bytes": 64 * 2**20,
        "hbm_bytes_per_step": hbm,
        "floor_bytes_per_step": floor_total,
        "bytes_over_floor": round(hbm / floor_total, 4),
        # The same DMAs counted in (8,128)-tiled HBM layout: lanes padded to 128.
        "hbm_bytes_per_step_tile_padded": hbm_padded,
        "tile_padded_over_floor": round(hbm_padded / floor_total, 4),
        "hbm_bytes_per_s_assumed": bandwidth,
        "projected_ms_per_step": round(hbm / bandwidth * 1e3, 4),
        "projected_ms_per_step_one_core": round(
            hbm * CORES_PER_CHIP[req.target] / bandwidth * 1e3, 4
        ),
        "floor_ms_per_step": round(floor_total / bandwidth * 1e3, 4),
        "distinct_experts_per_moe_layer": distinct[0] if distinct else 0,
        "dma_bytes": dma,
        "outside_kernel_bytes": outside,
        "floor_bytes": floor,
        "plan": {
            "tile_a": [plan.hidden, plan.ta],
            "tile_b": [plan.ta, plan.hidden_p],
            "ring_a_tiles": plan.n_a,
            "ring_b_tiles": plan.n_b,
            "depth_a": plan.depth_a,
            "depth_b": plan.depth_b,
            "depth_kv": plan.depth_kv,
            "depth_e": plan.depth_e,
            "vmem_breakdown": plan.vmem_breakdown(),
        },
    }


def _compile(req: CompileRequest, plan: Any, result: dict[str, Any]) -> None:
    """AOT-compiles the step on the target's compile-only topology; records it in `result`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.experimental.layout import Format, Layout
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from kernels.megakernel.pack import abstract_params
    from kernels.megakernel.step import megakernel_step

    topo = topologies.get_topology_desc(topology_name=TOPOLOGIES[req.target], platform="tpu")
    dev = topo.devices[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)

    def sds(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    mparams = jax.tree.map(sds, abstract_params(plan))
    pages = plan.pages_per_seq
    n_pages = req.batch * pages + 1  # one null page plus every row's pages
    kv_shape = (plan.num_layers, n_pages, req.page_size, plan.kv)  # the kernel's pool layout
    # The pool is pinned to row-major: for a K/V row that is not a lane multiple (SmolLM2,
    # 192) XLA's default layout of a large pool moves the page dim minor, which the kernel's
    # page DMAs cannot use (it then re-lays out the pool around the kernel). A TPU runner
    # allocates the pool with this same Format.
    row_major = Format(Layout(major_to_minor=tuple(range(len(kv_shape)))), sharding)
    kv = jax.ShapeDtypeStruct(kv_shape, plan.kv_dtype, sharding=row_major)
    i32 = jnp.int32
    args = (
        mparams,
        kv,
        kv,
        jax.ShapeDtypeStruct((req.batch,), i32, sharding=sharding),
        jax.ShapeDtypeStruct((req.batch,), i32, sharding=sharding),
        jax.ShapeDtypeStruct((req.batch, pages), i32, sharding=sharding),
    )

    def step(mp, k, v, tok, pos, pt):
        return megakernel_step(plan, mp, k, v, tok, pos, pt)[:4]

    # Lowering needs the chip generation (integer rem/div rules): an abstract TPU mesh.
    mesh = AbstractMesh(
        (1,),
        ("x",),
        (AxisType.Explicit,),
        abstract_device=AbstractDevice(device_kind=dev.device_kind, num_cores=1, platform="tpu"),
    )
    # Compile-only executables cannot be reloaded from the persistent cache (it needs a
    # client): keep them out of it, then restore the caller's setting.
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            traced = jax.jit(
                step,
                donate_argnums=(1, 2),
                out_shardings=(sharding, None, row_major, row_major),
            ).trace(*args)
        compiled = traced.lower().compile()
    except Exception as e:  # the compiler's own message is the useful output
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        return
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was)
    result["compiled"] = True
    mem = compiled.memory_analysis()
    if mem is not None:
        result["compiled_memory"] = {
            "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
        }
    big = [s for s, _ in plan.hbm_shapes().values()] + [kv_shape]
    result["relayout_copies"] = _relayout_copies(compiled.as_text(), big)
