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
from kernels.tp_llama import AXIS, TpLayout, tp_layout
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
    ep: expert parallelism (Qwen3-MoE), not implemented yet: `make_mesh` refuses ep > 1.
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
        """The shard plan for cfg; MeshError naming the numbers when tp does not fit it."""
        if self.tp > 1 and type(cfg) is not LlamaConfig:
            raise MeshError(
                f"tp={self.tp}: tensor parallelism is implemented for the Llama family only "
                f"(model_type {cfg.model_type!r} comes in a later slice)"
            )
        try:
            return tp_layout(cfg, self.tp)
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


def make_mesh(cfg: ParallelConfig) -> Mesh:
    """The first tp devices of this process as a mesh with the axis ("tp",)."""
    if cfg.ep > 1:
        raise NotImplementedError(f"ep={cfg.ep}: expert parallelism is a later slice")
    devices = jax.devices()
    if len(devices) < cfg.tp:
        raise MeshError(
            f"tp={cfg.tp} needs {cfg.tp} devices; this process has {len(devices)} "
            f"{jax.default_backend()} device(s)"
        )
    return Mesh(np.asarray(devices[: cfg.tp]), (AXIS,))
