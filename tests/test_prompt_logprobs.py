"""Prompt log-probabilities on the decode engine: every prompt token's log-probability (and the
top-n there) equals log-softmax of the in-process prefill's logits for its prefix, chunk by
chunk, over prefix-cache hits (scored on scratch pages, the cached pages untouched), under
preemption, on the pallas backend's ring prefill, and from the warm-up's program set."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.scheduler import SchedulerConfig
from decode_service.sequence import Sequence
from megaserve.errors import RequestError
from megaserve.offline import OfflineGenerator
from megaserve.sampling_params import SamplingParams

TOP = 3


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def reference(model, prompt: list[int]) -> list[np.ndarray]:
    """Log-softmax of the in-process prefill's last logits for each prefix prompt[:i], i >= 1."""
    gen = OfflineGenerator(model, max_context=128)
    return [
        log_softmax(gen.prefill(prompt[:i], SamplingParams())[1]) for i in range(1, len(prompt))
    ]


def assert_scores(entries, prompt: list[int], ref: list[np.ndarray], top: int = TOP, atol=1e-5):
    assert len(entries) == len(prompt) - 1
    for p, (tok, lp, ids, vals) in enumerate(entries):
        assert tok == prompt[p + 1]
        assert abs(lp - ref[p][tok]) < atol, (p, lp, ref[p][tok])
        want = np.argsort(-ref[p], kind="stable")[:top].tolist()
        assert ids == want, (p, ids, want)
        assert np.allclose(vals, ref[p][want], atol=atol)


def _engine(model, chunk=16, pages=None, **kw) -> DecodeEngine:
    cfg = model.cfg
    per_page = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    budget = {} if pages is None else {"kv_budget_bytes": pages * per_page}
    sched = SchedulerConfig(max_running=4, prefill_chunk=chunk)
    return DecodeEngine(model, EngineConfig(max_context=128, scheduler=sched, **budget, **kw))


def run(engine: DecodeEngine, reqs, max_tokens: int = 2) -> dict[str, list]:
    """reqs: (id, prompt, prompt top-n or None); returns each request's events."""
    events: dict[str, list] = {}
    for rid, prompt, n in reqs:
        seq = Sequence(rid, prompt, SamplingParams(), max_tokens, frozenset())
        engine.submit(seq, lambda e: events.setdefault(e.request_id, []).append(e), None, n)
    for _ in range(5000):
        if engine.idle:
            break
        engine.run_once()
    assert engine.idle
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()
    return events


def test_every_chunk_and_cache_hit_is_scored(tiny_model):
    """Chunks of 16 over a 45-token prompt; then the same prompt (its full blocks all cached),
    and one sharing its first 32 tokens: equal scores, on the first event only."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, tiny_model.cfg.vocab_size, 45).tolist()
    other = prompt[:32] + rng.integers(0, tiny_model.cfg.vocab_size, 9).tolist()
    engine = _engine(tiny_model)
    first = run(engine, [("a", prompt, TOP)])["a"]
    cached_before = {p: engine.pool.k[:, p].copy() for p in engine.alloc.by_hash.values()}
    again = run(engine, [("b", prompt, TOP), ("c", other, TOP), ("d", prompt, None)])
    ref = reference(tiny_model, prompt)
    assert_scores(first[0].prompt_logprobs, prompt, ref)
    assert first[0].cached_tokens == 0 and all(e.prompt_logprobs is None for e in first[1:])
    assert again["b"][0].cached_tokens == 32  # 2 full blocks (the last token's never)
    assert_scores(again["b"][0].prompt_logprobs, prompt, ref)
    assert again["c"][0].cached_tokens == 32
    assert_scores(again["c"][0].prompt_logprobs, other, reference(tiny_model, other))
    assert again["d"][0].prompt_logprobs is None  # not asked: plain prefill
    assert [e.token_ids for e in again["d"]] == [e.token_ids for e in first]
    # Scoring hits wrote no cached page (their K/V went to scratch pages).
    for p, k in cached_before.items():
        assert np.array_equal(np.asarray(engine.pool.k[:, p]), k), p


def test_scores_equal_solo_under_preemption(tiny_model):
    """A pool too small for all at once: preempted and recomputed prompts score the same."""
    rng = np.random.default_rng(1)
    vocab = tiny_model.cfg.vocab_size
    prompts = {
        f"r{i}": rng.integers(0, vocab, int(rng.integers(20, 50))).tolist() for i in range(5)
    }
    engine = _engine(tiny_model, pages=12)
    got = run(engine, [(rid, p, 1) for rid, p in prompts.items()], max_tokens=24)
    for rid, p in prompts.items():
        assert_scores(got[rid][0].prompt_logprobs, p, reference(tiny_model, p), top=1)
        assert sum(e.prompt_logprobs is not None for e in got[rid]) == 1
    assert engine.sched.preemptions > 0


def test_cache_hits_in_a_short_pool_score_a_page_at_a_time(tiny_model):
    """One page to spare: the cached prefix scores in one-page chunks (then the rest)."""
    prompt = list(range(20, 84))  # 4 pages; its first 3 are hits the second time
    engine = _engine(tiny_model, chunk=64, pages=6)
    assert engine.alloc.num_pages == 6  # 5 allocatable: a request's 65 tokens take all
    run(engine, [("a", prompt, None)], max_tokens=1)
    calls = []
    scored = engine.runner.prefill_with_logprobs
    engine.runner.prefill_with_logprobs = lambda b, *a: calls.append(b.num_new[0]) or scored(b, *a)
    got = run(engine, [("b", prompt, TOP)], max_tokens=1)["b"][0]
    assert got.cached_tokens == 48 and calls == [16, 16, 16, 16]
    assert_scores(got.prompt_logprobs, prompt, reference(tiny_model, prompt))


def test_warm_up_compiles_the_scoring_program(tiny_model):
    """The scoring prefill is in the warm-up set (one program): scoring requests, penalized
    and cached ones included, compile nothing while serving."""
    engine = _engine(tiny_model, chunk=32)
    engine.warm_up()
    scoring = [p for p in engine.programs() if p.name == "prefill_logprobs"]
    assert [p.key for p in scoring] == [(1, 32)]
    prompt = list(range(3, 60))
    events = run(engine, [("a", prompt, 2)])
    events |= run(engine, [("b", prompt, 0), ("c", prompt[:40], None)])
    penal = SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3)
    engine.submit(Sequence("p", prompt, penal, 3, frozenset()), lambda e: None, None, 1)
    while not engine.idle:
        engine.run_once()
    assert engine.runner.programs_run.late_compiles == 0
    assert events["b"][0].cached_tokens == 48
    ref = reference(tiny_model, prompt)
    assert_scores(events["a"][0].prompt_logprobs, prompt, ref, top=2)
    assert_scores(events["b"][0].prompt_logprobs, prompt, ref, top=0)


def test_pallas_ring_prefill_scores_as_xla(tiny_model):
    """The pallas backend scores over its rings (f32): the XLA backend's values."""
    prompt = list(range(90, 50, -1))
    engine = _engine(tiny_model, backend="pallas", kernel_matmul_dtype=jnp.float32)
    got = run(engine, [("a", prompt, TOP)], max_tokens=1)  # prefill only: no kernel step
    assert_scores(got["a"][0].prompt_logprobs, prompt, reference(tiny_model, prompt), atol=1e-4)


def test_imported_kv_cannot_be_scored(tiny_model):
    engine = _engine(tiny_model)
    engine.reserve("imp", [1, 2, 3, 4], 30.0)
    with pytest.raises(RequestError, match="'imp': prompt log-probabilities need the prompt"):
        engine.submit(
            Sequence("imp", [1, 2, 3, 4], SamplingParams(), 2, frozenset()), print, None, 0
        )
    engine.drop_reservation("imp")
