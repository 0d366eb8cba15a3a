"""The one place a backend is chosen: every engine (decode, prefill, offline) builds its
runner here."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax
import structlog

from kernels.kv_cache import KVPool
from megaserve.choices import BACKEND_CHOICES
from megaserve.errors import BackendError
from megaserve.parallel.mesh import ParallelConfig
from megaserve.runner.base import Runner
from megaserve.runner.buckets import StepConfig

log = structlog.get_logger("megaserve.runner")


def default_backend() -> str:
    """`pallas` (the megakernel) on TPU, `xla` everywhere else."""
    return "pallas" if jax.default_backend() == "tpu" else "xla"


def choose_backend(
    cfg: Any, page_size: int, requested: str | None = "auto", platform: str | None = None
) -> tuple[str, str]:
    """(backend, why) for a --backend value: `auto` is the megakernel on TPU when it supports
    the config, XLA otherwise; an explicit `pallas` the config cannot take is a BackendError.
    `platform` defaults to this process's (`compile-worker` passes its target's)."""
    from kernels.megakernel.plan import unsupported

    requested = requested or "auto"
    if requested not in BACKEND_CHOICES:
        raise BackendError(f"backend={requested!r} is not one of {BACKEND_CHOICES}")
    why_not = unsupported(cfg, page_size)
    if requested == "pallas":
        if why_not:
            raise BackendError(f"--backend pallas: {why_not}")
        return "pallas", "requested"
    if requested == "xla":
        return "xla", "requested"
    platform = platform or jax.default_backend()
    if platform != "tpu":
        return "xla", f"auto: platform {platform!r} is not TPU"
    if why_not:
        return "xla", f"auto: falling back, {why_not}"
    return "pallas", "auto: TPU and the megakernel supports this config"


def make_runner(
    family: ModuleType,
    cfg: Any,
    params: dict,
    pool: KVPool,
    step_cfg: StepConfig | None = None,
    backend: str | None = "auto",
    vmem_budget: int | None = None,
    matmul_dtype: Any = None,
    parallel: ParallelConfig | None = None,
) -> Runner:
    """The runner for a --backend value (None = auto), logging which and why; `pallas` off
    TPU runs the megakernel in the TPU interpreter. `vmem_budget` caps the megakernel's plan;
    `matmul_dtype` sets its matmul inputs (None: bf16). `parallel` with tp > 1: the XLA step
    over a tensor-parallel mesh (the pool from `megaserve.parallel.tp_pool.tp_pool`)."""
    step_cfg = step_cfg or StepConfig()
    if parallel is not None and parallel.devices > 1:
        kernel = {"vmem_budget": vmem_budget, "matmul_dtype": matmul_dtype}
        return _tp_runner(family, cfg, params, pool, step_cfg, backend, parallel, kernel)
    backend, why = choose_backend(cfg, pool.page_size, backend)
    log.info("backend", backend=backend, why=why)
    if backend == "pallas":
        from megaserve.runner.pallas import MegakernelRunner

        return MegakernelRunner(
            family, cfg, params, pool, step_cfg, vmem_budget=vmem_budget, matmul_dtype=matmul_dtype
        )
    from megaserve.runner.xla import XlaRunner

    return XlaRunner(family, cfg, params, pool, step_cfg)


def _tp_runner(family, cfg, params, pool, step_cfg, backend, parallel, kernel: dict) -> Runner:
    """The tensor-parallel runner: an explicit `pallas` (Llama family, ep 1) runs the tp
    megakernel for decode, else the XLA step under shard_map (`auto` too: the tp megakernel
    holds the weights twice, see `TpMegakernelRunner`)."""
    mesh = f"tp={parallel.tp} x ep={parallel.ep}"
    if backend == "pallas":
        if parallel.ep > 1:
            raise BackendError(f"--backend pallas with {mesh}: the megakernel splits no experts")
        why = choose_backend(cfg, pool.page_size, backend)[1]
        log.info("backend", backend="pallas", why=f"{why}, {mesh}: the tp megakernel")
        from megaserve.runner.tp_pallas import TpMegakernelRunner

        return TpMegakernelRunner(family, cfg, params, pool, step_cfg, parallel=parallel, **kernel)
    log.info("backend", backend="xla", why=f"{mesh}: the XLA step under shard_map")
    from megaserve.runner.tp import TpXlaRunner

    return TpXlaRunner(family, cfg, params, pool, step_cfg, parallel=parallel)
