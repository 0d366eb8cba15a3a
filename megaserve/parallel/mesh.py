"""A worker's device mesh: the parallel config, forced host devices on CPU, and the jax Mesh."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from kernels.llama import LlamaConfig
from kernels.qwen3_moe import Qwen3MoeConfig
from kernels.tp_llama import AXIS, EP_AXIS, TpLayout, tp_layout
from kernels.tp_moe import expert_layout
from megaserve.errors import MeshError

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


@dataclass(frozen=True)
class ParallelConfig:
    """How one worker splits its model across devices (tp x ep devices).

    tp: tensor parallelism. Attention by heads (q/k/v column-parallel, o row-parallel), the
      MLP column-parallel (gate/up) then row-parallel (down), the lm_head by vocabulary with
      a distributed argmax, the embedding replicated, the KV pool by KV heads. tp must divide
      num_attention_heads and intermediate_size (`check_model`). Where num_key_value_heads
      < tp, each KV head is replicated on tp / Hkv devices (tp must be a multiple of Hkv), so
      that every device's query heads share the one KV head it holds. That costs tp / Hkv
      times the KV pool memory of the whole mesh (each device holds 1 head's K/V instead of
      Hkv / tp), the same factor on k/v projection weights, and the replicas compute the
      same K/V: per device it is one KV head, so a device's KV bytes per token never drop
      below 2 x L x head_dim x dtype.
    ep: expert parallelism (Qwen3-MoE): each device holds num_experts / ep whole experts
      (of which, with tp > 1, its tp shard's gate|up columns and down rows), the router
      replicated; attention, dense layers, the lm_head and the KV pool are split over tp
      and replicated on the ep shards. ep must divide num_experts, tp
      moe_intermediate_size. A routed layer's output is one psum over all tp x ep devices.
    """

    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshError(f"{name}={value!r} must be an integer >= 1")

    @property
    def devices(self) -> int:
        return self.tp * self.ep

    def check_model(self, cfg: Any) -> TpLayout:
        """The shard plan for cfg; MeshError naming the numbers when tp or ep does not fit."""
        moe = type(cfg) is Qwen3MoeConfig
        if self.devices > 1 and type(cfg) is not LlamaConfig and not moe:
            raise MeshError(
                f"tp={self.tp} x ep={self.ep}: parallelism is implemented for the Llama family "
                f"and Qwen3-MoE only (model_type {cfg.model_type!r} comes in a later slice)"
            )
        if self.ep > 1 and not moe:
            raise MeshError(
                f"ep={self.ep}: expert parallelism needs a mixture-of-experts model "
                f"(model_type {cfg.model_type!r} has no experts)"
            )
        try:
            lay = tp_layout(cfg, self.tp)
            return expert_layout(cfg, lay, self.ep) if moe else lay
        except ValueError as e:
            raise MeshError(str(e)) from e


def with_device_count(flags: str, n: int) -> str:
    """XLA_FLAGS text with at least n forced host devices (other flags kept, a larger count
    already there kept)."""
    m = re.search(rf"{HOST_DEVICES_FLAG}=(\d+)", flags)
    if m is None:
        return f"{flags} {HOST_DEVICES_FLAG}={n}".strip()
    if int(m.group(1)) >= n:
        return flags
    return flags.replace(m.group(0), f"{HOST_DEVICES_FLAG}={n}")


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public query; the flag only counts before this

    return xla_bridge.backends_are_initialized()


def ensure_host_devices(n: int) -> None:
    """Makes this process's CPU backend have n devices, by XLA_FLAGS, before JAX starts.

    XLA reads the flag once, when the backend starts: afterwards a process with fewer
    devices is a MeshError (set the flag at its start). Harmless on TPU, where the flag
    only shapes the unused CPU backend and the TPU's devices are what `make_mesh` counts.
    """
    if n <= 1:
        return
    if _backend_started():
        have = jax.device_count()
        if have < n:
            raise MeshError(
                f"{n} devices needed but JAX already started with {have} "
                f"{jax.default_backend()} device(s): start the process with "
                f"XLA_FLAGS={HOST_DEVICES_FLAG}={n}"
            )
        return
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n)


def make_mesh(cfg: ParallelConfig, devices: list | None = None) -> Mesh:
    """The first tp x ep devices of this process as a [tp, ep] mesh, axes ("tp", "ep").

    A tp group (one ep index) is tp consecutive devices: the psum every layer runs stays
    among neighbours (on tpu7x, at tp=2, the two TensorCores of one chip). devices: this
    process's by default; a compile-only topology's (`megaserve kernels compile --topology`)."""
    devices = jax.devices() if devices is None else devices
    if len(devices) < cfg.devices:
        shape = f"tp={cfg.tp}" + (f" x ep={cfg.ep}" if cfg.ep > 1 else "")
        raise MeshError(
            f"{shape} needs {cfg.devices} devices; this process has {len(devices)} "
            f"{jax.default_backend()} device(s)"
        )
    grid = np.asarray(devices[: cfg.devices]).reshape(cfg.ep, cfg.tp).T  # [tp, ep]
    return Mesh(grid, (AXIS, EP_AXIS))
