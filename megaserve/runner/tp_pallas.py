"""The `pallas` backend over a tensor-parallel mesh: the tp XLA prefill programs, each decode
step one megakernel call per device (h all-reduced inside it, `kernels.megakernel.tp`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import numpy as np

from kernels.megakernel.plan import MegaPlan
from kernels.megakernel.tp import pack_tp_megakernel, place, tp_megakernel_step, tp_plan
from kernels.programs import is_abstract
from megaserve.errors import BackendError
from megaserve.runner.pallas import MegakernelRunner, pallas_decode
from megaserve.runner.tp import TpXlaRunner


@dataclass
class TpMegakernelRunner(TpXlaRunner):
    """`TpXlaRunner` whose decode steps run the tp megakernel (interpreted off TPU).

    It holds the weights twice per device: the shard-major layout its XLA prefill programs
    read, and each shard's megakernel rings (a prefill over the rings under shard_map, as the
    one-device `MegakernelRunner` has, would hold them once: not built yet). Llama family on
    one host: MoE plans and multi-process groups are a BackendError.
    """

    interpret: bool | None = None
    vmem_budget: int | None = None  # as MegakernelRunner
    matmul_dtype: Any = None  # as MegakernelRunner

    # The decode side is MegakernelRunner's (programs by batch bucket, full-width tables,
    # n kernel calls per decode call); only the plan and the step differ.
    max_batch = MegakernelRunner.max_batch
    decode_widths = MegakernelRunner.decode_widths
    decode_program = MegakernelRunner.decode_program
    decode_call = MegakernelRunner.decode_call

    def __post_init__(self):
        if jax.process_count() > 1:
            raise BackendError(
                f"--backend pallas with tp={self.parallel.tp} over {jax.process_count()} "
                "processes: the tp megakernel runs on one host's devices (use --backend xla)"
            )
        if self.interpret is None:
            self.interpret = jax.default_backend() != "tpu"
        self.kv_dtype = self.pool.k.dtype
        self.weight_dtype = self.params["embed"].dtype
        self.layout = self.parallel.check_model(self.cfg)
        try:
            base = self.plan_for(1, 1)
        except ValueError as e:  # MoE, or a shape the kernel does not take
            raise BackendError(f"--backend pallas: {e}") from e
        if is_abstract(self.params):  # compile-worker: shapes, no weights
            raise BackendError("--backend pallas with tp > 1: compile-worker is not built yet")
        host = jax.tree.map(np.asarray, self.params)  # (split params are gathered first)
        rings = pack_tp_megakernel(base, self.cfg, self.layout, host)
        super().__post_init__()  # the mesh, the XLA prefill params and programs
        self._pallas: dict[int, Any] = {}
        self.mparams = place(rings, self.mesh)

    plan_overrides = MegakernelRunner.plan_overrides

    def plan_for(self, batch: int, pages: int) -> MegaPlan:
        over = self.plan_overrides(self.pool.k.shape[-1] // self.parallel.tp)  # a shard's row
        return tp_plan(self.cfg, self.layout, batch, self.pool.page_size, pages, **over)

    def decode_params(self) -> Any:
        return self.mparams

    def _pallas_fn(self, b: int):
        if b not in self._pallas:
            plan = self.plan_for(b, self.step_cfg.max_pages_per_seq)
            step = partial(tp_megakernel_step, plan, self.layout, self.mesh)
            self._pallas[b] = jax.jit(
                partial(pallas_decode, step, self.interpret), donate_argnums=(1, 2)
            )
        return self._pallas[b]
