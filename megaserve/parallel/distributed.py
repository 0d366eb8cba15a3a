"""A worker's place in a multi-host group (the LeaderWorkerSet's JAX_* variables), and joining
JAX's distributed runtime with it before anything starts JAX's backend."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from megaserve.errors import MeshError

# What the LeaderWorkerSet manifest sets from LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and
# LWS_WORKER_INDEX (deploy/overlays/gke-tpu7x/decode-lws.yaml).
ADDRESS, PROCESSES, PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


@dataclass(frozen=True)
class GroupConfig:
    """`processes` processes running one SPMD program over all their devices: process 0
    (the leader) serves and registers, the others follow its calls (megaserve.parallel.group).

    timeout_s: JAX's heartbeat timeout (the runtime ends every other process of the group
    within it once one dies); the leader withdraws its registration while a group call is
    stuck for half of it and exits once one is stuck for twice it (`group.lead`).
    """

    coordinator: str = ""  # host:port of process 0's coordination service
    processes: int = 1
    process_id: int = 0
    timeout_s: int = 10

    @property
    def multi(self) -> bool:
        return self.processes > 1

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, timeout_s: int = 10) -> GroupConfig:
        """From the JAX_* variables (absent or JAX_NUM_PROCESSES=1: one process); MeshError
        naming a value that is not a number, out of range or missing."""
        try:
            n = int(env.get(PROCESSES) or 1)
            i = int(env.get(PROCESS_ID) or 0)
        except ValueError as e:
            raise MeshError(f"{PROCESSES}/{PROCESS_ID}: {e}") from e
        if n < 1 or not 0 <= i < n:
            raise MeshError(f"{PROCESS_ID}={i} must be in [0, {PROCESSES}={n})")
        address = env.get(ADDRESS, "")
        if n > 1 and ":" not in address:
            raise MeshError(f"{PROCESSES}={n} needs {ADDRESS}=host:port (got {address!r})")
        if timeout_s < 1:
            raise MeshError(f"group timeout {timeout_s} s must be >= 1")
        return cls(address, n, i, timeout_s)

    def local_devices(self, devices: int) -> int:
        """This process's share of a mesh of `devices` (every process holds as many)."""
        if devices % self.processes:
            raise MeshError(
                f"tp x ep = {devices} devices do not split over {self.processes} processes "
                f"({PROCESSES}): each process must hold the same number"
            )
        return devices // self.processes


def join(group: GroupConfig) -> None:
    """jax.distributed.initialize for a group of several processes (nothing for one): CPU
    collectives over gloo, `timeout_s` for heartbeats and for the shutdown barrier. Call
    before anything starts JAX's backend; `jax.devices()` then lists every process's."""
    if not group.multi:
        return
    import jax

    # Only shapes the CPU backend (the TPU runtime brings its own collectives).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        group.coordinator,
        num_processes=group.processes,
        process_id=group.process_id,
        heartbeat_timeout_seconds=group.timeout_s,
        shutdown_timeout_seconds=group.timeout_s,
    )
