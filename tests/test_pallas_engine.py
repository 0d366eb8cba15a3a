"""The decode engine on the `pallas` backend (the megakernel, in the TPU interpreter) serves a
mixed workload over the pool its own prefill writes with the XLA backend's greedy tokens:
sequences joining and leaving, page boundaries, a prefix-cache hit and preemptions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.scheduler import SchedulerConfig
from decode_service.sequence import Sequence
from megaserve.runner.pallas import MegakernelRunner
from megaserve.sampling_params import SamplingParams

PAGE = 16


def _engine(model, backend: str, pages: int) -> DecodeEngine:
    cfg = model.cfg
    per_page = 2 * cfg.num_layers * PAGE * cfg.num_kv_heads * cfg.head_dim * 4
    return DecodeEngine(
        model,
        EngineConfig(
            page_size=PAGE,
            kv_budget_bytes=pages * per_page,
            max_context=96,
            backend=backend,
            # f32 matmul inputs in the kernel: the same arithmetic as the f32 XLA backend.
            kernel_matmul_dtype=jnp.float32,
            scheduler=SchedulerConfig(max_running=4, prefill_chunk=32),
        ),
    )


def _phase(engine: DecodeEngine, reqs) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rid, prompt, n in reqs:
        seq = Sequence(rid, prompt, SamplingParams(), n, frozenset())
        engine.submit(seq, lambda e: out.setdefault(e.request_id, []).extend(e.token_ids))
    for _ in range(3000):
        if engine.idle:
            break
        engine.run_once()
    assert engine.idle
    engine.alloc.check_invariants()
    return out


def _workload(vocab: int):
    rng = np.random.default_rng(5)
    shared = rng.integers(0, vocab, 2 * PAGE + 1).tolist()  # two full pages, then more

    def prompt(n):
        return rng.integers(0, vocab, n).tolist()

    first = [("a", shared + prompt(4), 6)]
    # Joining while others run, leaving at different steps, crossing page boundaries
    # (prompt + output spans 1-4 pages); "b" reuses "a"'s two cached prefix pages.
    second = [("b", shared + prompt(7), 12)]
    second += [
        (f"r{i}", prompt(int(rng.integers(3, 40))), int(rng.integers(2, 22))) for i in range(7)
    ]
    return first, second


def _bf16_exact(kind: str):
    """The tiny models with bf16-representable weights: the kernel's bf16 rings then hold
    exactly the XLA backend's f32 weights."""
    from megaserve.checkpoint import Checkpoint
    from megaserve.model import LoadedModel
    from tests.conftest import (
        random_moe_tensors,
        random_tensors,
        tiny_llama_config,
        tiny_moe_config,
    )
    from tests.megakernel_minis import _bf16_round

    hf = tiny_moe_config() if kind == "moe" else tiny_llama_config()
    tensors = (random_moe_tensors if kind == "moe" else random_tensors)(hf)
    return LoadedModel.from_checkpoint(Checkpoint(kind, hf, _bf16_round(tensors), None, ()))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_pallas_engine_serves_the_xla_backends_tokens(kind):
    model = _bf16_exact(kind)
    first, second = _workload(model.cfg.vocab_size)
    got = {}
    for backend in ("xla", "pallas"):
        # 8 pages for up to 4 rows of up to 4 pages each: the scheduler must preempt.
        engine = _engine(model, backend, pages=8)
        if backend == "pallas":
            assert isinstance(engine.runner, MegakernelRunner) and engine.runner.interpret
        tokens = _phase(engine, first) | _phase(engine, second)
        assert engine.cached_prompt_tokens >= 2 * PAGE, engine.cached_prompt_tokens
        assert engine.sched.preemptions > 0
        assert engine.step_failures == 0
        got[backend] = tokens
    assert got["pallas"] == got["xla"]
    assert {len(t) for t in got["xla"].values()} > {6}  # the lengths really differ
