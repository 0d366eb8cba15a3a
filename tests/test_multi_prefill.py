"""Ragged multi-sequence prefill: one iteration's prefill call carries pieces of several
prompts under a token budget (decode and prefill workers), greedy output stays exactly
transformers', and a short prompt is not held behind a long one."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.scheduler import SchedulerConfig
from decode_service.sequence import Sequence
from megaserve.finish import FinishReason
from megaserve.model import LoadedModel
from megaserve.offline import OfflineGenerator
from megaserve.runner.buckets import StepConfig, bucket
from megaserve.sampling_params import SamplingParams
from prefill_service.engine import PrefillConfig, PrefillEngine, _Job
from tests.conftest import FIXTURES


def _engine(model, budget: int, rows: int = 4, max_context: int = 256) -> DecodeEngine:
    sched = SchedulerConfig(max_running=8, prefill_chunk=budget, prefill_rows=rows)
    return DecodeEngine(
        model, EngineConfig(kv_budget_bytes=8 << 20, max_context=max_context, scheduler=sched)
    )


class PrefillCalls:
    """Records each runner.prefill call's rows (new tokens per row)."""

    def __init__(self, engine: DecodeEngine):
        self.real, self.calls = engine.runner.prefill, []
        engine.runner.prefill = self

    def __call__(self, batch, sampling):
        self.calls.append(batch.num_new.tolist())
        return self.real(batch, sampling)


def _submit(engine: DecodeEngine, rid: str, prompt: list[int], n: int, got: dict) -> None:
    engine.submit(
        Sequence(rid, prompt, SamplingParams(), n, frozenset()),
        lambda e: got.setdefault(e.request_id, []).append(e),
    )


def _drain(engine: DecodeEngine, max_iters: int = 2000) -> None:
    for _ in range(max_iters):
        if engine.idle:
            break
        engine.run_once()
    assert engine.idle
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _assert_in_budget(step: StepConfig, calls: list[list[int]]) -> None:
    """Every call's padded shape (rows bucket x token bucket) is within the budget."""
    for rows in calls:
        b = bucket(len(rows), step.prefill_batch_buckets, "rows")
        t = bucket(max(rows), step.token_buckets, "tokens")
        assert b * t <= step.prefill_budget, rows


def test_budget_split_rule():
    """The oldest always runs; a later prompt joins when it finishes in the shared call."""
    step = replace(StepConfig.for_limits(64, 256, 64), prefill_rows=4)
    assert [step.prefill_cap(k) for k in range(1, 6)] == [256, 128, 64, 64, 0]
    assert step.prefill_pieces([]) == []
    assert step.prefill_pieces([1000]) == [256]
    assert step.prefill_pieces([1000, 40]) == [128, 40]  # the short one rides along
    assert step.prefill_pieces([1000, 300]) == [256, 0]  # two long ones: one at a time
    assert step.prefill_pieces([1000, 2000, 10]) == [128, 0, 10]  # not behind either
    assert step.prefill_pieces([1000, 30, 30, 30, 30]) == [64, 30, 30, 30, 0]  # 4 rows
    assert step.prefill_pieces([100, 100, 100]) == [100, 100, 0]  # a 3rd would not finish
    # A lone piece padded far past the bucket below is cut to it; the rest pads less later.
    assert step.prefill_pieces([150]) == [128]  # 128 + 32 padded, not 256
    assert step.prefill_pieces([230]) == [230]  # 128 + 128 would not save a call's cost
    wide = replace(StepConfig.for_limits(8, 512, 64), prefill_rows=4)
    assert wide.prefill_pieces([300]) == [256]  # 256 + 64, not 512
    assert wide.prefill_pieces([300, 200]) == [256, 200]  # 200 must finish: no narrower call
    assert wide.prefill_pieces([130, 40]) == [128, 40]
    small = replace(StepConfig.for_limits(8, 32, 64), prefill_rows=4)
    assert [small.prefill_cap(k) for k in (1, 2, 3)] == [32, 16, 0]


def test_one_iteration_prefills_several_prompts_in_one_call(tiny_model):
    """A long prompt and three short ones submitted together: the first iteration runs one
    prefill call with a piece of each (4 rows of 16 tokens at most, budget 64); every call
    stays within the budget and every output equals its solo run."""
    engine = _engine(tiny_model, budget=64)
    assert engine.runner.step_cfg.prefill_batch_buckets == (1, 2, 4)
    keys = {p.key for p in engine.programs() if p.name == "prefill"}
    assert keys == {(1, 16), (1, 32), (1, 64), (2, 16), (2, 32), (4, 16)}
    rec = PrefillCalls(engine)
    rng = np.random.default_rng(3)
    prompts = {
        "long": rng.integers(1, 90, 150).tolist(),
        **{f"s{i}": rng.integers(1, 90, n).tolist() for i, n in enumerate((10, 16, 5))},
    }
    got: dict = {}
    for rid, p in prompts.items():
        _submit(engine, rid, p, 5, got)
    engine.run_once()
    assert rec.calls == [[16, 10, 16, 5]]
    assert {rid for rid in got} == {"s0", "s1", "s2"}  # their first tokens, in one step
    _drain(engine)
    assert rec.calls[1:] == [[64], [64], [6]]  # alone, the long one takes the budget
    _assert_in_budget(engine.runner.step_cfg, rec.calls)
    assert engine.prefill_tokens == sum(map(len, prompts.values()))
    solo = OfflineGenerator(tiny_model, max_context=256)
    for rid, p in prompts.items():
        assert _tokens(got[rid]) == solo.generate(p, 5, ignore_eos=True).token_ids, rid


def test_short_prompt_is_not_held_behind_a_long_one(tiny_model):
    """A short prompt submitted while a long one prefills gets its first token the next
    iteration, long before the long prompt's own first token."""
    engine = _engine(tiny_model, budget=32)
    rec = PrefillCalls(engine)
    rng = np.random.default_rng(4)
    long, short = rng.integers(1, 90, 200).tolist(), rng.integers(1, 90, 12).tolist()
    got: dict = {}
    _submit(engine, "long", long, 3, got)
    engine.run_once()
    _submit(engine, "short", short, 3, got)
    engine.run_once()
    assert "short" in got and "long" not in got
    assert rec.calls == [[32], [16, 12]]
    _drain(engine)
    assert got["long"][0].step > got["short"][0].step
    solo = OfflineGenerator(tiny_model, max_context=256)
    assert _tokens(got["short"]) == solo.generate(short, 3, ignore_eos=True).token_ids
    assert _tokens(got["long"]) == solo.generate(long, 3, ignore_eos=True).token_ids


def test_a_failed_multi_row_prefill_ends_only_its_rows(tiny_model):
    """The call holding two prompts' pieces raises: those two end with ERROR; the running
    sequence decodes on, exact, and later prompts are served."""
    engine = _engine(tiny_model, budget=32)
    got: dict = {}
    _submit(engine, "a", [5, 6, 7], 12, got)
    for _ in range(3):
        engine.run_once()
    real = engine.runner.prefill

    def fail(batch, sampling):
        if batch.num_seqs > 1:
            raise RuntimeError("injected")
        return real(batch, sampling)

    engine.runner.prefill = fail
    _submit(engine, "b", list(range(10, 30)), 4, got)
    _submit(engine, "c", list(range(40, 50)), 4, got)
    engine.run_once()
    for rid in ("b", "c"):
        assert got[rid][-1].finish_reason == FinishReason.ERROR, rid
    engine.runner.prefill = real
    _submit(engine, "d", list(range(40, 50)), 4, got)
    _drain(engine)
    assert engine.step_failures == 1
    solo = OfflineGenerator(tiny_model, max_context=256)
    assert _tokens(got["a"]) == solo.generate([5, 6, 7], 12, ignore_eos=True).token_ids
    assert _tokens(got["d"]) == solo.generate(list(range(40, 50)), 4, ignore_eos=True).token_ids


# Tiny transformers fixtures with short prompts: prompt + greedy[:k] is a prompt whose
# greedy continuation is greedy[k:], so one fixture gives prompts of many lengths.
PARITY = ["llama_gqa4", "qwen2_bias", "qwen3_moe_e8k2"]


def _fixture(name: str):
    d = FIXTURES / "tiny" / name
    ref = json.loads((d / "reference.json").read_text())
    if "lowest_index_first" in ref:
        ref = ref | ref["lowest_index_first"]
    return LoadedModel.load(str(d), progress=False), ref["prompt_ids"], ref["greedy_ids"]


@pytest.mark.parametrize("name", PARITY)
def test_decode_worker_matches_transformers_with_shared_calls(name):
    """Two long prompts (several chunks each) and three short ones share prefill calls
    (budget 32: up to 2 rows of 16); every request's greedy tokens equal transformers'."""
    model, prompt, greedy = _fixture(name)
    engine = _engine(model, budget=32, max_context=len(prompt) + len(greedy) + 16)
    rec = PrefillCalls(engine)
    cut = {"long0": 28, "long1": 22, "s0": 0, "s1": 4, "s2": 6}  # k: prompt + greedy[:k]
    got: dict = {}
    for rid, k in cut.items():
        _submit(engine, rid, prompt + greedy[:k], len(greedy) - k, got)
    _drain(engine)
    for rid, k in cut.items():
        assert _tokens(got[rid]) == greedy[k:], rid
    assert max(len(c) for c in rec.calls) == 2  # several sequences per call
    assert sum(len(c) > 1 and max(c) == 16 for c in rec.calls) >= 2  # long pieces shared
    _assert_in_budget(engine.runner.step_cfg, rec.calls)


def _prefill_all(engine: PrefillEngine, prompts: list[list[int]]) -> list[int]:
    """Steps the prefill engine from this thread (its own stays parked on the empty queue);
    each prompt's first token."""
    jobs = [_Job(p, SamplingParams(), 0, lambda *a: None) for p in prompts]
    for j in jobs:
        engine._admit(j)
    for _ in range(200):
        if not engine._active:
            break
        engine._step()
    return [j.future.result(timeout=0).first_token for j in jobs]


@pytest.mark.parametrize("name", PARITY[:2])
def test_prefill_worker_budget_matches_transformers(name):
    """The prefill worker's calls carry pieces of several prompts within the budget
    (sum of padded rows <= chunk); the first tokens equal transformers'."""
    model, prompt, greedy = _fixture(name)
    engine = PrefillEngine(model, PrefillConfig(chunk=32, max_context=128, max_batch=4))
    calls: list[list[int]] = []
    real = engine.runner.prefill
    engine.runner.prefill = lambda b, s: calls.append(b.num_new.tolist()) or real(b, s)
    cut = [28, 0, 22, 5, 3]
    firsts = _prefill_all(engine, [prompt + greedy[:k] for k in cut])
    assert firsts == [greedy[k] for k in cut]
    assert max(len(c) for c in calls) == 2 and engine.batched_calls == len(calls)
    _assert_in_budget(engine.runner.step_cfg, calls)
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()
