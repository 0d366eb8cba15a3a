"""The decode engine: continuous batching gives each request exactly its solo tokens."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.events import TokenEvent
from decode_service.scheduler import SchedulerConfig
from decode_service.sequence import Sequence
from megaserve.offline import OfflineGenerator
from megaserve.sampling_params import SamplingParams


def _requests(n: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, vocab, int(rng.integers(3, 60))).tolist()
        sp = SamplingParams() if i % 2 else SamplingParams(temperature=0.8, top_k=20, seed=i)
        if i % 3 == 0:  # some rows penalized: the batch mixes penalized and plain rows
            sp = SamplingParams(
                sp.temperature, sp.top_k, seed=i, repetition_penalty=1.3, frequency_penalty=0.2
            )
        out.append((f"r{i}", prompt, sp, int(rng.integers(1, 24))))
    return out


def _run(engine: DecodeEngine, reqs, max_iters: int = 5000):
    events: dict[str, list[TokenEvent]] = {}
    for rid, prompt, sp, n in reqs:
        engine.submit(
            Sequence(rid, prompt, sp, n, frozenset()),
            lambda e: events.setdefault(e.request_id, []).append(e),
        )
    for _ in range(max_iters):
        if engine.idle:
            break
        engine.run_once()
    assert engine.idle
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()
    return {rid: [t for e in evs for t in e.token_ids] for rid, evs in events.items()}, events


@pytest.mark.parametrize("budget_pages", [400, 40])
def test_concurrent_equals_solo(tiny_model, budget_pages):
    """Small pools force preemption and recompute; outputs must not change."""
    probe = EngineConfig()
    cfg = tiny_model.cfg
    per_page = 2 * cfg.num_layers * probe.page_size * cfg.num_kv_heads * cfg.head_dim * 4
    engine = DecodeEngine(
        tiny_model,
        EngineConfig(
            kv_budget_bytes=budget_pages * per_page,
            max_context=128,
            scheduler=SchedulerConfig(max_running=16, prefill_chunk=32),
        ),
    )
    reqs = _requests(24, cfg.vocab_size)
    got, _ = _run(engine, reqs)
    solo = OfflineGenerator(tiny_model, max_context=128)
    for rid, prompt, sp, n in reqs:
        want = solo.generate(prompt, n, sp, ignore_eos=True).token_ids
        assert got[rid] == want, rid
    if budget_pages == 40:
        assert engine.sched.preemptions > 0


def test_admission_does_not_stall_running_streams(tiny_model):
    """A long prompt arriving mid-stream costs running sequences at most its chunk steps."""
    engine = DecodeEngine(
        tiny_model,
        EngineConfig(max_context=256, scheduler=SchedulerConfig(max_running=8, prefill_chunk=16)),
    )
    steps: list[int] = []
    engine.submit(
        Sequence("a", [1, 2, 3], SamplingParams(), 40, frozenset()), lambda e: steps.append(e.step)
    )
    for _ in range(5):
        engine.run_once()
    long_prompt = list(np.random.default_rng(1).integers(0, 90, 100))
    engine.submit(Sequence("b", long_prompt, SamplingParams(), 4, frozenset()), lambda e: None)
    while not engine.idle:
        engine.run_once()
    # "a" gets a token at every decode step: prefill chunks of "b" run beside decode steps.
    gaps = np.diff(steps[1:])
    assert gaps.max() == 1, gaps


def test_full_queue_is_refused_and_nothing_leaks(tiny_model):
    from megaserve.errors import NoCapacity as Full

    engine = DecodeEngine(
        tiny_model,
        EngineConfig(max_context=64, scheduler=SchedulerConfig(max_running=2, max_waiting=3)),
    )
    for i in range(3):
        engine.submit(Sequence(f"q{i}", [1, 2], SamplingParams(), 2, frozenset()), lambda e: None)
    with pytest.raises(Full, match="queue full"):
        engine.submit(Sequence("q3", [1, 2], SamplingParams(), 2, frozenset()), lambda e: None)
    while not engine.idle:
        engine.run_once()
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()


def test_warm_up_compiles_every_program_the_engine_then_runs(tiny_model):
    """After warm_up, a mixed workload (sampled, penalized, greedy; batches and contexts of
    every size the buckets allow) and imported KV compile nothing more."""
    engine = DecodeEngine(
        tiny_model,
        EngineConfig(max_context=128, scheduler=SchedulerConfig(max_running=8, prefill_chunk=32)),
    )
    n, _ = engine.warm_up()
    programs = engine.programs()
    assert n == len(programs) == len({(p.name, p.key) for p in programs})
    assert engine.memory.temp_max > 0 and engine.memory.fits
    _run(engine, _requests(24, tiny_model.cfg.vocab_size))
    pool = engine.pool
    k = np.zeros(pool.heads_shape(5), np.float32)
    pool.write_pages(np.arange(1, 6, dtype=np.int32), k, k)
    assert engine.runner.programs_run.late_compiles == 0
    assert pool.programs_run.late_compiles == 0


def _wrap_hook(engine: DecodeEngine, wrap) -> None:
    """engine.runner.decode with its `while_running` hook replaced by wrap(hook)."""
    real = engine.runner.decode
    engine.runner.decode = lambda b, s, n, want, hook: real(b, s, n, want, wrap(hook))


def test_commands_run_while_the_step_is_on_the_device(tiny_model, monkeypatch):
    """The runner hands over after the step's dispatch (the pool already its output), before
    any read-back; the engine serves its commands there until the step is done."""
    from megaserve.runner import xla

    engine = DecodeEngine(tiny_model, EngineConfig(max_context=64))
    order: list[str] = []
    real_to_host = xla.to_host
    monkeypatch.setattr(xla, "to_host", lambda x: order.append("to_host") or real_to_host(x))
    before: list = []

    def wrap(hook):
        def held(done):
            order.append("hook")
            assert engine.pool.k is not before[-1]  # the step's output, being computed
            # A Reserve queued now (from another thread, as a gRPC handler would) is served
            # before the step's tokens are read back.
            res = []
            t = threading.Thread(target=lambda: res.append(engine.reserve("r", [4, 5], 30.0)))
            engine._thread = t  # the engine counts as started: the command only queues
            t.start()
            end = time.monotonic() + 10
            hook(lambda: (bool(res) or time.monotonic() > end) and done())
            order.append(f"reserved {res[0].request_id}" if res else "not served")
            engine._thread = None
            engine._run_commands()  # (only when the hook did not serve it: unblocks the call)
            t.join()

        return held

    _wrap_hook(engine, wrap)
    engine.submit(Sequence("a", [1, 2, 3], SamplingParams(), 2, frozenset()), lambda e: None)
    engine.run_once()  # its prefill: no decode step yet
    before.append(engine.pool.k)
    order.clear()
    engine.run_once()  # one decode step
    assert order == ["hook", "reserved r", "to_host"], order
    assert "r" in engine.reservations
    assert engine.drop_reservation("r")
    while not engine.idle:
        engine.run_once()
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()
