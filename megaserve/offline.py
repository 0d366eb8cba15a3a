"""In-process generation over the paged KV pool: the engine behind `megaserve generate`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kernels.kv_cache import KVPool
from megaserve.errors import RequestError, check_prompt_ids
from megaserve.finish import FinishReason
from megaserve.model import LoadedModel
from megaserve.parallel.mesh import ParallelConfig
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig
from megaserve.runner.factory import make_runner
from megaserve.sampling_params import SamplingArrays, SamplingParams


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: FinishReason  # STOP (an EOS / stop id) or LENGTH


class OfflineGenerator:
    """One sequence at a time through the same prefill/decode programs the decode tier runs.

    The pool is sized once for `max_context` so every call reuses the compiled programs.
    """

    def __init__(
        self,
        model: LoadedModel,
        page_size: int = 16,
        max_context: int | None = None,
        steps_per_call: int = 1,
        prefill_chunk: int = 512,
        backend: str = "xla",
        parallel: ParallelConfig | None = None,
    ):
        """parallel: tp > 1 runs the tensor-parallel XLA step (the pool split by KV heads)."""
        cfg = model.cfg
        self.model = model
        self.max_context = min(max_context or 4096, cfg.max_position_embeddings)
        pages_per_seq = math.ceil((self.max_context + steps_per_call) / page_size)
        dtype = model.params["embed"].dtype
        if parallel is not None and parallel.devices > 1:
            from megaserve.parallel.tp_pool import tp_pool

            self.pool = tp_pool(cfg, parallel, pages_per_seq + 1, page_size, dtype)
        else:
            self.pool = KVPool.create(
                cfg.num_layers, pages_per_seq + 1, page_size, cfg.num_kv_heads, cfg.head_dim, dtype
            )
        self.prefill_chunk = prefill_chunk
        step_cfg = StepConfig.for_limits(1, prefill_chunk, pages_per_seq, steps_per_call)
        self.runner = make_runner(
            model.family, cfg, model.params, self.pool, step_cfg, backend, parallel=parallel
        )
        # A single sequence owns pages 1..N in order; page 0 is the null page.
        self.pages = np.arange(1, pages_per_seq + 1, dtype=np.int32)

    def validate(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        check_prompt_ids(prompt_ids, self.model.cfg.vocab_size, "prompt")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if len(prompt_ids) + max_new_tokens > self.max_context:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"the context length {self.max_context}"
            )

    def _rows(self, sampling: SamplingParams, prompt: list[int], out: list[int]):
        return SamplingArrays.build([sampling], [(list(prompt), out)], self.model.cfg.vocab_size)

    def prefill(self, prompt_ids: list[int], sampling: SamplingParams) -> tuple[int, np.ndarray]:
        """Writes the prompt's KV chunk by chunk; returns (first sampled token, its logits)."""
        rows = self._rows(sampling, prompt_ids, [])
        ids = np.asarray(prompt_ids, np.int32)
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = ids[start : start + self.prefill_chunk]
            batch = TokenBatch.from_rows([(chunk.tolist(), start, self.pages)])
            nxt, logits = self.runner.prefill(batch, rows)
        return int(nxt[0]), logits[0]

    def stream(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        ignore_eos: bool = False,
        stop_token_ids: tuple[int, ...] = (),
    ) -> Iterator[int]:
        """Yields generated token ids as each device call returns them (stop id included)."""
        sampling = sampling or SamplingParams()
        self.validate(prompt_ids, max_new_tokens)
        stops = set(stop_token_ids) | (set() if ignore_eos else set(self.model.eos_token_ids))
        tok, _ = self.prefill(prompt_ids, sampling)
        yield tok
        count, last = 1, tok
        out = [tok]
        pos = len(prompt_ids)  # position of `last`
        steps = self.runner.step_cfg.steps_per_call
        while last not in stops and count < max_new_tokens:
            batch = TokenBatch.from_rows([([last], pos, self.pages)])
            toks, _ = self.runner.decode(
                batch, self._rows(sampling, prompt_ids, out), n_steps=steps
            )
            for t in toks[: min(steps, max_new_tokens - count), 0].tolist():
                count, last, pos = count + 1, int(t), pos + 1
                out.append(last)
                yield last
                if last in stops:
                    break

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        ignore_eos: bool = False,
        stop_token_ids: tuple[int, ...] = (),
    ) -> GenerationResult:
        out = list(self.stream(prompt_ids, max_new_tokens, sampling, ignore_eos, stop_token_ids))
        stops = set(stop_token_ids) | (set() if ignore_eos else set(self.model.eos_token_ids))
        reason = FinishReason.STOP if out[-1] in stops else FinishReason.LENGTH
        return GenerationResult(out, reason)
