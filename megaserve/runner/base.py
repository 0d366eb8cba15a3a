"""The seam between engines and device programs: one interface, one implementation per
backend (XLA everywhere, the Pallas megakernel on TPU)."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kernels.kv_cache import KVPool
from kernels.programs import Program, ProgramCache
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig
from megaserve.sampling_params import SamplingArrays


@dataclass(frozen=True)
class PositionLogprobs:
    """What a scoring prefill returns for each position of its padded chunk (rows and columns
    as the call's padded tokens: row s, column t is the row's t-th new token)."""

    target: np.ndarray  # f32[S, T] log-probability of the target token at each position
    top_ids: np.ndarray  # i32[S, T, K] the K most likely next tokens, most likely first
    top: np.ndarray  # f32[S, T, K] their log-probabilities


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
    def prefill_with_logprobs(
        self, batch: TokenBatch, sampling: SamplingArrays, targets: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, PositionLogprobs]:
        """`prefill` that also scores every new token's position (prompt log-probabilities):
        the log-softmax of the model's raw logits there, reduced on the device.

        A separate program (`logprob_programs`), so plain prefill computes no per-position
        logits. Chunks pad to one length, `logprob_chunk`.

        Args:
          targets: i32[N] per new token (in `batch.tokens` order), the token whose
            log-probability to return at its position (the next prompt token).
        Returns:
          (i32[S] next tokens, f32[S, V] last-token logits, PositionLogprobs with K =
          min(MAX_LOGPROBS, V) alternatives).
        """

    @abc.abstractmethod
    def logprob_programs(self) -> list[Program]:
        """The `prefill_with_logprobs` programs, abstract: engines that serve prompt
        log-probabilities add them to their compiled set."""

    @property
    @abc.abstractmethod
    def logprob_chunk(self) -> int:
        """The one chunk length `prefill_with_logprobs` pads to (>= the largest token bucket
        and the page size): the largest chunk, so one program per row bucket."""

    @abc.abstractmethod
    def decode(
        self,
        batch: TokenBatch,
        sampling: SamplingArrays,
        n_steps: int | None = None,
        want_logits: bool = False,
        while_running: Callable[[Callable[[], bool]], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Runs n_steps decode steps (default `step_cfg.steps_per_call`) in one device call.

        Args:
          batch: one new token per row (its last token, at position num_cached); each
            row's pages must cover positions up to num_cached + n_steps.
          while_running: called once with `done` (True once the step's results are ready)
            after the step is dispatched, with the pool already the step's output, before
            its tokens are read back: the engine serves its commands there until done().
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
