"""The per-device memory plan a worker checks at start: weights + KV pool + the largest program
temp against the device's capacity, and the KV budget that is left when none is given."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

# Kept free beyond weights, pool and program temps: the runtime's own buffers, fragmentation,
# host-transfer staging. 5% of the device.
MARGIN = 0.05
# Program temps may take this fraction of the pool (the pool is sized to leave it).
TEMP_FRACTION = 0.05
# Without an accelerator the pool keeps a fixed default: a CPU host's memory is shared with
# everything else on it, so "what is left" is not the worker's to take.
CPU_KV_BUDGET = 256 * 2**20


class MemoryPlanError(ValueError):
    """The plan does not fit; the message names every term and the capacity."""


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of a pytree (arrays or ShapeDtypeStructs)."""
    import jax

    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def device_capacity(device: Any = None) -> int:
    """Bytes one device holds: the runtime's limit on TPU/GPU, physical memory on CPU."""
    import jax

    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_kv_budget(capacity: int, weights: int, platform: str) -> int:
    """The pool bytes left on the device after weights, the margin and the temp allowance."""
    if platform == "cpu":
        return CPU_KV_BUDGET
    return max(0, int((capacity * (1 - MARGIN) - weights) / (1 + TEMP_FRACTION)))


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv_pool: int
    temp_max: int
    capacity: int

    @property
    def margin(self) -> int:
        return int(self.capacity * MARGIN)

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.temp_max

    @property
    def fits(self) -> bool:
        return self.total + self.margin <= self.capacity

    def describe(self) -> str:
        gb = 1e9
        return (
            f"weights {self.weights / gb:.3f} GB + KV pool {self.kv_pool / gb:.3f} GB + largest "
            f"program temp {self.temp_max / gb:.3f} GB + margin {self.margin / gb:.3f} GB "
            f"({MARGIN:.0%}) = {(self.total + self.margin) / gb:.3f} GB, device capacity "
            f"{self.capacity / gb:.3f} GB"
        )

    def check(self) -> None:
        if not self.fits:
            raise MemoryPlanError(f"memory plan does not fit: {self.describe()}")

    def as_dict(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "kv_pool": self.kv_pool,
            "temp_max": self.temp_max,
            "margin": self.margin,
            "total": self.total,
            "capacity": self.capacity,
        }


def temp_bytes(executables) -> int:
    """The largest temp allocation among compiled executables (their memory analysis)."""
    most = 0
    for exe in executables:
        mem = exe.memory_analysis() if hasattr(exe, "memory_analysis") else None
        if mem is not None:
            most = max(most, int(mem.temp_size_in_bytes))
    return most


def start_plan(weights: int, requested_kv: int | None) -> MemoryPlan:
    """The plan before any program compiles (temp 0): the requested KV budget, or what the
    device has left; MemoryPlanError when even that does not fit."""
    import jax

    capacity = device_capacity()
    kv = requested_kv
    if kv is None:
        kv = default_kv_budget(capacity, weights, jax.default_backend())
    plan = MemoryPlan(weights, kv, 0, capacity)
    plan.check()
    return plan


def after_warm_up(plan: MemoryPlan, weights: int, kv_pool: int, executables) -> MemoryPlan:
    """The plan with the real weights (every resident copy), the pool as allocated and the
    largest compiled temp; MemoryPlanError when it does not fit."""
    done = MemoryPlan(weights, kv_pool, temp_bytes(executables), plan.capacity)
    done.check()
    return done


def planned_pool(model: Any, page_size: int, requested_kv: int | None, parallel: Any = None):
    """(the start plan, the KV pool it sizes) for a worker of `model` (a LoadedModel): the
    plan is checked before the pool is allocated, so a pool that cannot fit is never made.

    `parallel` (a ParallelConfig) with tp > 1: the pool is split over its mesh and the KV
    budget is the whole pool's, every device and every replica of a KV head counted (the
    plan still weighs whole weights and pool against one device: right on CPU, where the
    devices share host memory; conservative on an accelerator)."""
    from kernels.kv_cache import KVPool

    mc = model.cfg
    plan = start_plan(tree_bytes(model.params), requested_kv)
    if parallel is not None and parallel.devices > 1:
        from megaserve.parallel.tp_pool import tp_pool_for_budget

        dtype = model.params["embed"].dtype
        return plan, tp_pool_for_budget(mc, parallel, page_size, plan.kv_pool, dtype)
    pool = KVPool.for_budget(
        mc.num_layers, page_size, mc.num_kv_heads, mc.head_dim, plan.kv_pool,
        model.params["embed"].dtype,
    )  # fmt: skip
    return plan, pool
