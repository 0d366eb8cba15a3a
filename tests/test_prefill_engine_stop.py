"""PrefillEngine.stop: the engine thread ends after the prefill call it is in (a process
must not exit inside one), the prompts it holds or has queued fail with NoCapacity (the
router retries those elsewhere), and their pages are freed."""

from __future__ import annotations

import threading

import pytest

from megaserve.errors import NoCapacity
from megaserve.sampling_params import SamplingParams
from prefill_service.engine import PrefillConfig, PrefillEngine

PROMPT = [(i * 7) % 90 + 3 for i in range(200)]


def test_stop_waits_for_the_call_then_fails_what_the_engine_holds(tiny_model):
    engine = PrefillEngine(tiny_model, PrefillConfig(chunk=32, max_context=256, max_batch=1))
    entered, gate = threading.Event(), threading.Event()
    real = engine.runner.prefill

    def held(batch, sampling):  # the first call waits on the gate
        entered.set()
        assert gate.wait(60)
        return real(batch, sampling)

    engine.runner.prefill = held
    running = engine.submit(PROMPT, SamplingParams(), 0, lambda *a: None)
    assert entered.wait(60)
    queued = engine.submit(PROMPT[:40], SamplingParams(), 0, lambda *a: None)  # max_batch 1
    out: list[bool] = []
    stopper = threading.Thread(target=lambda: out.append(engine.stop(60)))
    stopper.start()
    stopper.join(0.5)
    assert stopper.is_alive() and not out  # it cannot end while the call is held
    gate.set()
    stopper.join(60)
    assert out == [True]
    for fut in (running, queued):
        with pytest.raises(NoCapacity, match="stopping"):
            fut.result(timeout=0)
    engine.alloc.check_invariants()
    assert engine.alloc.all_free_or_cached()
