"""In-flight prefix sharing: a prompt whose prefix another in-flight prompt is computing
takes that prompt's pages instead of computing the same KV again (decode and prefill tiers)."""

from __future__ import annotations

import numpy as np
import pytest

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.scheduler import SchedulerConfig
from decode_service.sequence import Sequence
from megaserve.offline import OfflineGenerator
from megaserve.sampling_params import SamplingParams
from prefill_service.engine import PrefillConfig, PrefillEngine, _Job


def _prompts(vocab: int, prefix: int, tails: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, vocab, prefix).tolist()
    return [shared + rng.integers(1, vocab, t).tolist() for t in tails]


@pytest.mark.parametrize(("prefix", "chunk"), [(80, 256), (100, 32)])
def test_decode_worker_computes_a_shared_prefix_once(tiny_model, prefix, chunk):
    """Three prompts admitted together share `prefix` tokens: the first computes them, the
    others take its pages when their turn comes; every output equals its solo run."""
    engine = DecodeEngine(
        tiny_model,
        EngineConfig(
            max_context=256, scheduler=SchedulerConfig(max_running=8, prefill_chunk=chunk)
        ),
    )
    prompts = _prompts(tiny_model.cfg.vocab_size, prefix, [7, 30, 16])
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.submit(
            Sequence(f"r{i}", p, SamplingParams(), 6, frozenset()),
            lambda e: got.setdefault(e.request_id, []).extend(e.token_ids),
        )
    for _ in range(500):
        if engine.idle:
            break
        engine.run_once()
    assert engine.idle
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()
    ps = engine.cfg.page_size
    shared_blocks = prefix // ps
    # Later prompts took the shared blocks: none of their KV was computed twice.
    assert engine.sched.shared_inflight_blocks == 2 * shared_blocks
    assert engine.prefill_tokens == sum(len(p) for p in prompts) - 2 * shared_blocks * ps
    assert engine.cached_prompt_tokens == 2 * shared_blocks * ps
    solo = OfflineGenerator(tiny_model, max_context=256)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == solo.generate(p, 6, SamplingParams(), ignore_eos=True).token_ids


def test_a_prompt_inside_another_keeps_its_last_token_computed(tiny_model):
    """A prompt that is a page-aligned prefix of an earlier one still computes its last
    token (its logits are needed), taking only the blocks before it."""
    engine = DecodeEngine(tiny_model, EngineConfig(max_context=256))
    long = _prompts(tiny_model.cfg.vocab_size, 64, [40])[0]
    short = long[:64]
    got: dict[str, list[int]] = {}
    for rid, p in (("long", long), ("short", short)):
        engine.submit(
            Sequence(rid, p, SamplingParams(), 4, frozenset()),
            lambda e: got.setdefault(e.request_id, []).extend(e.token_ids),
        )
    while not engine.idle:
        engine.run_once()
    assert engine.sched.shared_inflight_blocks == 3  # blocks of short[:-1]
    solo = OfflineGenerator(tiny_model, max_context=256)
    assert got["short"] == solo.generate(short, 4, SamplingParams(), ignore_eos=True).token_ids


def _prefill_all(engine: PrefillEngine, prompts: list[list[int]]):
    """Admits every prompt into one batch and steps the engine until all are done, from this
    thread (the engine thread stays parked on its empty queue). Returns each prompt's
    (first token, {page index: (K, V)})."""
    sent: list[dict] = [{} for _ in prompts]
    jobs = []
    for i, p in enumerate(prompts):

        def on_pages(first, k, v, i=i):
            for j in range(k.shape[1]):
                sent[i][first + j] = (np.asarray(k[:, j]), np.asarray(v[:, j]))

        jobs.append(_Job(p, SamplingParams(), 0, on_pages))
        engine._admit(jobs[-1])
    for _ in range(100):
        if not engine._active:
            break
        engine._step()
    return [(j.future.result(timeout=0).first_token, s) for j, s in zip(jobs, sent)]


def test_prefill_worker_computes_a_shared_prefix_once(tiny_model):
    """Prompts batched together with a common 6-chunk prefix: one computes it, the others
    wait for its pages chunk by chunk; each sends the same KV and first token as alone."""
    cfg = PrefillConfig(chunk=16, max_context=256)
    prompts = _prompts(tiny_model.cfg.vocab_size, 96, [5, 21, 9], seed=1)
    batched = PrefillEngine(tiny_model, cfg)
    got = _prefill_all(batched, prompts)
    assert batched.shared_inflight_pages == 2 * 6
    # Rows computed: 7 chunks for the first (96 + 5 tokens), then only the tails: 2 for
    # 21 tokens and 1 for 9 (without sharing: 7 + 8 + 7).
    assert batched.rows_computed == 7 + 2 + 1
    batched.alloc.check_invariants()
    assert batched.alloc.all_free_or_cached()
    for p, (tok, pages) in zip(prompts, got):
        alone = PrefillEngine(tiny_model, cfg)
        [(want_tok, want_pages)] = _prefill_all(alone, [p])
        assert tok == want_tok
        assert sorted(pages) == sorted(want_pages) == list(range(-(-len(p) // 16)))
        for j, (k, v) in want_pages.items():
            np.testing.assert_allclose(pages[j][0], k, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(pages[j][1], v, rtol=1e-5, atol=1e-5)


def test_prefill_waiter_computes_itself_when_the_first_prompt_goes(tiny_model):
    """If the prompt computing a shared prefix is cancelled, the one waiting on it is not
    stranded: it computes the rest of the prefix itself."""
    cfg = PrefillConfig(chunk=16, max_context=256)
    prompts = _prompts(tiny_model.cfg.vocab_size, 64, [3, 3], seed=2)
    engine = PrefillEngine(tiny_model, cfg)
    jobs = [_Job(p, SamplingParams(), 0, lambda *a: None) for p in prompts]
    for j in jobs:
        engine._admit(j)
    engine._step()  # the first computed one chunk; the second took nothing yet and waited
    assert jobs[0].done == 16 and jobs[1].done == 0
    jobs[0].future.cancel()
    for _ in range(20):
        if not engine._active:
            break
        engine._step()
    assert jobs[1].future.result(timeout=0).prefix_hit_pages == 1
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()
