"""`megaserve kernels compile-worker`: a worker's whole program set, compiled for a target
from this host (libtpu compile-only topology), with each program's memory, the re-layouts
XLA inserted and the per-device memory plan."""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from megaserve.memory_plan import MemoryPlan, default_kv_budget
from megaserve_app.relayouts import relayout_ops

# HBM per JAX device when the compiler cannot be asked (see `device_hbm_bytes`): a TPU7x
# chip's two TensorCores are separate devices with half the chip's HBM each.
HBM_PER_DEVICE = {"tpu7x": int(94.74 * 2**30), "v6e": 32 * 2**30, "v5e": 16 * 2**30}


@dataclass(frozen=True)
class WorkerTarget:
    """What `compile-worker` builds: one worker's configuration for one target."""

    config_path: str
    target: str = "tpu7x"
    role: str = "decode"  # decode | prefill
    max_running: int = 64  # decode batch (decode role)
    max_batch: int = 8  # prompts per prefill call (prefill role)
    prefill_chunk: int = 256
    max_context: int = 8192
    page_size: int = 16
    kv_budget_mb: int | None = None  # None: what the device has left (see memory_plan)
    dtype: str = "bf16"
    backend: str = "auto"  # decode programs: auto | pallas | xla
    jobs: int = 2  # programs compiling at once


def device_hbm_bytes(device, target: str) -> int:
    """The HBM one device offers, read back from the compiler: a program that needs more
    than any device has is refused with "exceeds available HBM (94.74G)" (G = GiB); on
    tpu7x this reads 94.74 GiB. Falls back to HBM_PER_DEVICE if the message changes."""
    import jax
    import jax.numpy as jnp

    big = jax.ShapeDtypeStruct(
        (2**38 // 4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
    )
    try:
        jax.jit(lambda a: a + 1).trace(big).lower().compile()
    except Exception as e:  # the refusal carries the number
        m = re.search(r"available HBM \(([\d.]+)G\)", str(e))
        if m:
            return int(float(m.group(1)) * 2**30)
    return HBM_PER_DEVICE[target]


def _setup(t: WorkerTarget, kv_pages: int):
    """(role's programs, runner, abstract pool, backend, why, served) for a pool of kv_pages
    pages; served: `_served`'s report fields (decode role) or {}."""
    import jax
    import jax.numpy as jnp

    from decode_service import programs as decode_programs
    from decode_service.scheduler import SchedulerConfig
    from kernels.kv_cache import KVPool, pool_row
    from kernels.megakernel.aot import load_config
    from kernels.registry import family_for
    from megaserve.runner.factory import choose_backend
    from megaserve.runner.pallas import MegakernelRunner
    from megaserve.runner.xla import XlaRunner
    from prefill_service import engine as prefill_engine

    cfg = load_config(t.config_path)
    family, _ = family_for(cfg.model_type)
    dtype = jnp.bfloat16 if t.dtype == "bf16" else jnp.float32
    params = family.abstract_params(cfg, dtype)
    row = pool_row(cfg.num_kv_heads, cfg.head_dim, "tpu")  # the target's rows: lane-padded
    shape = (cfg.num_layers, kv_pages, t.page_size, row)
    kv = jax.ShapeDtypeStruct(shape, dtype)
    pool = KVPool(kv, kv, cfg.num_kv_heads, cfg.head_dim)
    max_pages = math.ceil(t.max_context / t.page_size)
    if t.role == "prefill":
        backend, why = "xla", "prefill programs are XLA on every backend"
        step = prefill_engine.step_config(_prefill_cfg(t), max_pages)
        runner = XlaRunner(family, cfg, params, pool, step)
        programs = prefill_engine.engine_programs(runner, pool, max_pages)
        return programs, runner, pool, backend, why, {}
    # The worker's own choice, for a TPU target (a BackendError is a ValueError: exit 2).
    backend, why = choose_backend(cfg, t.page_size, t.backend, platform="tpu")
    sched = SchedulerConfig(max_running=t.max_running, prefill_chunk=t.prefill_chunk)
    step = decode_programs.step_config(sched, t.max_running, max_pages)
    if backend == "pallas":
        runner = MegakernelRunner(family, cfg, params, pool, step, interpret=False)
    else:
        runner = XlaRunner(family, cfg, params, pool, step)
    # The worker's own set (`decode_programs.fit_running`): a batch one call cannot take (the
    # megakernel's VMEM plan) is never run; max_running is lowered and the report says so.
    served = _served(runner, t)
    if served["max_running_served"] < t.max_running:
        runner.step_cfg = decode_programs.step_config(
            sched, served["max_running_served"], max_pages
        )
    programs = decode_programs.engine_programs(runner, pool, max_pages)
    return programs, runner, pool, backend, why, served


def _prefill_cfg(t: WorkerTarget):
    from prefill_service.engine import PrefillConfig

    return PrefillConfig(
        page_size=t.page_size, max_context=t.max_context, chunk=t.prefill_chunk,
        max_batch=t.max_batch,
    )  # fmt: skip


def _pool_pages(t: WorkerTarget, capacity: int, weights: int, bytes_per_page: int) -> int:
    """Pages of the pool: from --kv-budget-mb, else what the device has left after weights,
    the margin and the program-temp allowance (`megaserve.memory_plan`, as a worker does)."""
    budget = t.kv_budget_mb * 2**20 if t.kv_budget_mb is not None else None
    if budget is None:
        budget = default_kv_budget(capacity, weights, "tpu")
    return max(2, budget // bytes_per_page)


def _compile_one(program, sharding, mesh) -> dict[str, Any]:
    import jax

    def place(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    args = jax.tree.map(place, program.args)
    row = {"name": program.name, "key": list(program.key), "compiled": False}
    t0 = time.perf_counter()
    try:
        # Mosaic lowering needs the chip generation (the abstract TPU mesh); XLA programs are
        # traced without it (its explicit axes refuse ragged_dot's sharding inference).
        ctx = jax.sharding.use_abstract_mesh(mesh) if program.name.startswith("pallas") else None
        with ctx or contextlib.nullcontext():
            traced = program.fn.trace(*args)
        compiled = traced.lower().compile()
    except Exception as e:  # the compiler's message is the useful output
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        return row
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    row["compiled"] = True
    mem = compiled.memory_analysis()
    row["hbm_temp_bytes"] = int(mem.temp_size_in_bytes) if mem is not None else None
    row["_hlo"] = compiled.as_text()
    return row


def compile_worker(t: WorkerTarget) -> dict[str, Any]:
    """Compiles every program of the worker `t` describes; returns the JSON-able report."""
    import jax

    from kernels.megakernel.target import target_device
    from megaserve.runner.warm import weight_copies

    if t.role not in ("decode", "prefill"):
        raise ValueError(f"--role {t.role!r} is not decode or prefill")
    for name in ("max_running", "max_batch", "prefill_chunk", "max_context", "page_size", "jobs"):
        if getattr(t, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(t, name)} must be >= 1")
    dev, sharding, mesh = target_device(t.target)  # ValueError naming a bad target
    t0 = time.perf_counter()
    capacity = device_hbm_bytes(dev, t.target)
    _, runner, pool, _, _, _ = _setup(t, 2)  # sizes only: weights, bytes per page
    weights = weight_copies(runner)
    bytes_per_page = pool.bytes_per_page
    pages = _pool_pages(t, capacity, sum(weights.values()), bytes_per_page)
    programs, runner, pool, backend, why, served = _setup(t, pages)
    resident = [runner.params, getattr(runner, "mparams", None)]
    weight_shapes = [x.shape for x in jax.tree.leaves(resident) if x.ndim >= 2]
    pool_bytes = pages * bytes_per_page
    # Compile-only executables cannot go through the persistent cache (it needs a client).
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    rows = []
    # XLA's compile of one program runs mostly on one core and releases the GIL: `jobs`
    # programs compile at once (2 on these 2-core hosts halves the sweep).
    pool_exec = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, t.jobs))
    try:
        compiled = pool_exec.map(lambda p: _compile_one(p, sharding, mesh), programs)
        for program, row in zip(programs, compiled):
            hlo = row.pop("_hlo", "")
            ops = relayout_ops(hlo, pool.k.shape, weight_shapes) if row["compiled"] else []
            row["relayout_ops"] = len(ops)
            if ops:
                row["relayout_lines"] = ops[:4]
            row["vmem_bytes"] = _vmem_bytes(runner, program)
            temp = row.get("hbm_temp_bytes")
            row["temp_over_pool"] = None if temp is None else round(temp / pool_bytes, 5)
            rows.append(row)
    finally:
        pool_exec.shutdown()
        jax.config.update("jax_enable_compilation_cache", cache_was)
    temp_max = max((r.get("hbm_temp_bytes") or 0 for r in rows), default=0)
    plan = MemoryPlan(sum(weights.values()), pool_bytes, temp_max, capacity)
    return {
        "role": t.role,
        "config": t.config_path,
        "target": t.target,
        "backend": backend,
        "backend_why": why,
        "max_running": t.max_running if t.role == "decode" else None,
        **served,
        "max_batch": t.max_batch if t.role == "prefill" else None,
        "max_context": t.max_context,
        "page_size": t.page_size,
        "dtype": t.dtype,
        "programs": rows,
        "program_count": len(rows),
        "all_compiled": all(r["compiled"] for r in rows),
        "relayout_ops_total": sum(r["relayout_ops"] for r in rows),
        "temp_max_over_pool": round(temp_max / pool_bytes, 5),
        "hbm_per_device": plan.as_dict() | {"weights_by_copy": weights, "kv_pool_pages": pages},
        "fits": plan.fits,
        "memory_plan": plan.describe(),
        "compile_s": round(time.perf_counter() - t0, 1),
    }


def _served(runner, t: WorkerTarget) -> dict[str, Any]:
    """The decode batch the worker serves at most, and why when it is below --max-running."""
    most, why = runner.max_batch()
    served = min(most, t.max_running)
    out: dict[str, Any] = {"max_running_served": served}
    if served < t.max_running:
        out["max_running_why"] = f"lowered from {t.max_running} as the worker does: {why}"
    return out


def _vmem_bytes(runner, program) -> int | None:
    """The megakernel plan's VMEM for pallas programs (XLA programs report none)."""
    if program.name != "pallas_decode":
        return None
    return runner.plan_for(program.key[0], runner.step_cfg.max_pages_per_seq).vmem_bytes()
