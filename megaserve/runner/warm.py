"""Compile before serving: a worker's whole program set, compiled (or loaded from JAX's
persistent compilation cache) once at start, and a log line for any shape compiled later."""

from __future__ import annotations

import time

import structlog

from kernels.exec_cache import LoadedProgram
from kernels.kv_cache import KVPool
from kernels.programs import Program
from megaserve.memory_plan import MemoryPlan, after_warm_up, tree_bytes
from megaserve.runner.base import Runner

log = structlog.get_logger("megaserve.programs")


def weight_copies(runner: Runner) -> dict[str, int]:
    """Bytes of each weight copy the runner holds on the device: the XLA params, and on the
    pallas backend the megakernel's rings (then the only copy)."""
    out = {"xla_params": tree_bytes(runner.params)}
    if hasattr(runner, "mparams"):
        out["megakernel_rings"] = tree_bytes(runner.mparams)
    return {k: v for k, v in out.items() if v}


def warm_up(
    runner: Runner, pool: KVPool, programs: list[Program], plan: MemoryPlan
) -> tuple[MemoryPlan, int, float]:
    """Compiles every program into the cache its calls run from (the pool's page programs
    into the pool's, the rest into the runner's), then checks the memory plan with the
    largest compiled temp; returns (that plan, programs, seconds). MemoryPlanError when the
    plan does not fit."""
    t0 = time.perf_counter()
    page = [p for p in programs if p.name.startswith("kv_")]
    rest = [p for p in programs if not p.name.startswith("kv_")]
    n = pool.programs_run.warm(page)[0] + runner.programs_run.warm(rest)[0]
    secs = time.perf_counter() - t0
    names = sorted({p.name for p in programs})
    counts = {name: sum(p.name == name for p in programs) for name in names}
    exes = [*pool.programs_run.executables.values(), *runner.programs_run.executables.values()]
    loaded = sum(isinstance(e, LoadedProgram) for e in exes)
    log.info(
        "programs compiled",
        programs=n,
        seconds=round(secs, 1),
        by_name=counts,
        from_exec_cache=loaded,
    )
    pool_bytes = tree_bytes((pool.k, pool.v))
    plan = after_warm_up(plan, sum(weight_copies(runner).values()), pool_bytes, exes)
    log.info("memory plan", **plan.as_dict())
    for cache in (pool.programs_run, runner.programs_run):
        cache.on_late = lambda label: log.warning(
            "program compiled while serving (not in the warm-up set)", program=label
        )
    return plan, n, secs
