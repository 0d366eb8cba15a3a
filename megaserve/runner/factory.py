"""The one place a backend is chosen: every engine (decode, prefill, offline) builds its
runner here."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax

from kernels.kv_cache import KVPool
from megaserve.runner.base import Runner
from megaserve.runner.buckets import StepConfig

BACKENDS = ("xla", "pallas")


def default_backend() -> str:
    """`pallas` (the megakernel) on TPU, `xla` everywhere else."""
    return "pallas" if jax.default_backend() == "tpu" else "xla"


def make_runner(
    family: ModuleType,
    cfg: Any,
    params: dict,
    pool: KVPool,
    step_cfg: StepConfig | None = None,
    backend: str | None = None,
) -> Runner:
    """The runner for a backend (None = `default_backend()`); `pallas` off TPU runs the
    megakernel in the TPU interpreter."""
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    step_cfg = step_cfg or StepConfig()
    if backend == "pallas":
        from megaserve.runner.pallas import MegakernelRunner

        return MegakernelRunner(family, cfg, params, pool, step_cfg)
    from megaserve.runner.xla import XlaRunner

    return XlaRunner(family, cfg, params, pool, step_cfg)
