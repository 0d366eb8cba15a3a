"""AOT compilation of the megakernel for TPU v7 on a CPU host (libtpu compile-only topology)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.megakernel.target import TOPOLOGIES, compile_plan, pool_shape, quiet_env

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
    # Pages in the KV pool (default: every row's context, plus the null page). Smaller when
    # weights plus that pool exceed one TensorCore's HBM (Qwen3-30B-A3B, batch 64 x 8192).
    pool_pages: int | None = None


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
    quiet_env()
    from kernels.kv_cache import pool_row
    from kernels.megakernel.plan import make_plan

    cfg = load_config(req.config_path)
    pages = math.ceil(req.context / req.page_size)
    # The target's pool layout: rows padded to lanes on TPU (`kv_cache.pool_row`).
    row = pool_row(cfg.num_kv_heads, cfg.head_dim, "tpu")
    shape = {"emit_logits": req.emit_logits, "kv_row": row}
    if req.depth_a is not None:  # a forced plan gets the compiler's verdict, no retry
        forced = {"depth_a": req.depth_a, "vmem_budget": 2**40}
        plan = make_plan(cfg, req.batch, req.page_size, pages, **shape, **forced)
        result = _accounting(req, cfg, plan)
        _compile(req, plan, result)
        return result
    # make_plan first: a request no plan fits is a bad request (ValueError), as before.
    plan = make_plan(cfg, req.batch, req.page_size, pages, **shape)
    from kernels.megakernel.fit import compile_fitting  # fit builds on this module

    try:
        fitted = compile_fitting(
            cfg,
            req.batch,
            req.page_size,
            pages,
            target=req.target,
            pool_pages=req.pool_pages,
            **shape,
        )
    except Exception as e:  # refused even at depth 2, or not a VMEM verdict
        result = _accounting(req, cfg, plan)
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        return result
    result = _accounting(req, cfg, fitted.plan)
    result["fit"] = {
        "vmem_budget": fitted.vmem_budget,
        "refused_vmem_bytes": [v for v, _ in fitted.refused],
        "from_cache": fitted.from_cache,
    }
    _record_compiled(fitted.compiled, fitted.plan, result, req.pool_pages)
    return result


def _accounting(req: CompileRequest, cfg: Any, plan: Any) -> dict[str, Any]:
    """The request's result dict before compiling: VMEM, bytes per step, floor, projections."""
    from kernels.megakernel import cost, schedule

    # Every row at the end of a full context: it reads context - 1 earlier tokens.
    positions = [req.context - 1] * req.batch
    distinct = [schedule.expected_distinct_experts(plan.num_experts, plan.top_k, req.batch)] * len(
        plan.moe_layers
    )
    dma = schedule.dma_bytes(plan, positions, distinct)
    floor = schedule.floor_bytes(cfg, plan, positions, distinct)
    # Beyond the kernel's own DMAs (which include the logits tiles): the embedding rows XLA
    # gathers before it.
    outside = floor["embedding_rows"]
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
        # Static cost from the kernel's schedule at tpu7x peaks, per TensorCore device.
        "cost": cost.step_cost(plan, positions, distinct),
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
    """AOT-compiles the step for `req.target`; records the verdict and facts in `result`."""
    try:
        compiled = compile_plan(plan, req.target, req.pool_pages)
    except Exception as e:  # the compiler's own message is the useful output
        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        return
    _record_compiled(compiled, plan, result, req.pool_pages)


def _record_compiled(
    compiled: Any, plan: Any, result: dict[str, Any], pool_pages: int | None = None
) -> None:
    """Marks `result` compiled; adds the compiled HBM sizes and any re-layout copies."""
    result["compiled"] = True
    mem = compiled.memory_analysis()
    if mem is not None:
        result["compiled_memory"] = {
            "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "alias_bytes": int(mem.alias_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
        }
    pool = pool_shape(plan, pool_pages)
    result["pool_pages"] = pool[1]
    big = [s for s, _ in plan.hbm_shapes().values()] + [pool]
    result["relayout_copies"] = _relayout_copies(compiled.as_text(), big)
