"""The seam between engines and device programs: one interface, one implementation per
backend (XLA everywhere, the Pallas megakernel on TPU)."""

from __future__ import annotations

import abc

import numpy as np

from kernels.kv_cache import KVPool
from kernels.programs import Program, ProgramCache
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig
from megaserve.sampling_params import SamplingArrays


class Runner(abc.ABC):
    """Runs prefill pieces and decode steps of one model over one KV pool.

    Every call is one device program per shape bucket; the pool is donated, so K/V are
    written in place (`pool.k` / `pool.v` are replaced after each call).
    """

    pool: KVPool
    step_cfg: StepConfig
    programs_run: ProgramCache  # the executables its calls run (filled by warm-up)

    @abc.abstractmethod
    def programs(self) -> list[Program]:
        """Every device program this runner's calls can need, with abstract arguments: what
        a worker compiles before serving and `compile-worker` compiles for a target."""

    @abc.abstractmethod
    def prefill(self, batch: TokenBatch, sampling: SamplingArrays) -> tuple[np.ndarray, np.ndarray]:
        """Writes the K/V of each row's new tokens and samples each row's next token.

        Args:
          batch: S rows, each with its own new tokens and cached length.
          sampling: S rows.
        Returns:
          (i32[S] next tokens, f32[S, V] logits at each row's last new token).
        """

    @abc.abstractmethod
    def decode(
        self,
        batch: TokenBatch,
        sampling: SamplingArrays,
        n_steps: int | None = None,
        want_logits: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Runs n_steps decode steps (default `step_cfg.steps_per_call`) in one device call.

        Args:
          batch: one new token per row (its last token, at position num_cached); each
            row's pages must cover positions up to num_cached + n_steps.
        Returns:
          (i32[n_steps, S] sampled tokens, f32[n_steps, S, V] logits or None).
        """

    def max_batch(self) -> tuple[int, str]:
        """The most rows one decode call can take, and why (the largest batch bucket, or
        less where the device program cannot be built for more)."""
        return self.step_cfg.batch_buckets[-1], "the largest batch bucket"

    @property
    @abc.abstractmethod
    def compiled_programs(self) -> int:
        """Distinct executables built so far (bounded by the bucket product)."""
