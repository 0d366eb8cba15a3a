"""--cpu-turns: workers on the same cores compute one at a time, in turn (alternating when
both wait); a worker that dies holding its turn lets the others go; the prefill and decode
engines take a turn for each step and compute nothing while another holds it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from decode_service.engine import DecodeEngine, EngineConfig
from decode_service.sequence import Sequence
from megaserve.cpu_turns import CpuTurns
from megaserve.sampling_params import SamplingParams
from megaserve.worker_args import turns_path
from prefill_service.engine import PrefillConfig, PrefillEngine

TURN_S = 0.02  # long beside a thread's way from one turn's end to the gate (microseconds)


def _take_turns(path, name: str, n: int, log: list) -> None:
    turns = CpuTurns(path)
    try:
        for _ in range(n):
            with turns:
                log.append((name, time.monotonic(), "in"))
                time.sleep(TURN_S)
                log.append((name, time.monotonic(), "out"))
    finally:
        turns.close()


def test_two_workers_alternate_and_never_overlap(tmp_path):
    log: list = []
    ts = [
        threading.Thread(target=_take_turns, args=(tmp_path / "turns", name, 12, log))
        for name in ("a", "b")
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=30)
    assert len(log) == 48
    # Never two at once: every "in" is followed by the same worker's "out".
    assert all(log[i][0] == log[i + 1][0] and log[i + 1][2] == "out" for i in range(0, 48, 2))
    order = [name for name, _, what in log if what == "in"]
    # Both waiting: each turn goes to the other one. A plain lock lets the worker that just
    # let go take it again before the waiting one wakes (checked: 7-12 repeats in 24 turns).
    both = order[order.index("b") if order[0] == "a" else order.index("a") :]
    both = both[: len(both) - (both[::-1].index("a" if both[-1] == "b" else "b"))]
    repeats = sum(x == y for x, y in zip(both, both[1:]))
    assert repeats <= 1, order


def test_a_worker_that_dies_holding_its_turn_lets_the_others_go(tmp_path):
    path = tmp_path / "turns"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from megaserve.cpu_turns import CpuTurns\n"
            f"t = CpuTurns({str(path)!r}); t.__enter__(); print('held', flush=True); "
            "time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        got = threading.Event()
        mine = CpuTurns(path)

        def take():
            with mine:
                got.set()

        t = threading.Thread(target=take, daemon=True)
        t.start()
        assert not got.wait(0.5)  # held by the other process
        holder.kill()
        assert got.wait(10)
        t.join(5)
        assert mine.turns == 1 and mine.waited_s >= 0.5
        mine.close()
    finally:
        holder.kill()
        holder.wait()


def test_a_path_in_a_missing_directory_is_refused_by_name(tmp_path):
    import argparse

    bad = str(tmp_path / "nowhere" / "turns")
    with pytest.raises(argparse.ArgumentTypeError, match="nowhere"):
        turns_path(bad)
    assert turns_path(str(tmp_path / "turns")) == str(tmp_path / "turns")


def test_the_prefill_engine_takes_a_turn_per_call(tiny_model, tmp_path):
    path = tmp_path / "turns"
    engine = PrefillEngine(
        tiny_model, PrefillConfig(chunk=16, max_context=128, max_batch=2, cpu_turns=str(path))
    )
    other = CpuTurns(path)
    with other:  # taken before the prompt is queued: the engine's first call waits for it
        fut = engine.submit(list(range(1, 40)), SamplingParams(), 0, lambda *a: None)
        time.sleep(0.5)
        assert engine.batched_calls == 0 and not fut.done()
    other.close()
    assert fut.result(timeout=60).first_token >= 0
    assert engine.batched_calls >= 3 and engine.turns.turns >= engine.batched_calls
    assert engine.turns.waited_s >= 0.4 and engine.stats()["cpu_turn_wait_s"] >= 0.4


def test_the_decode_engine_takes_a_turn_per_iteration(tiny_model, tmp_path):
    path = tmp_path / "turns"
    engine = DecodeEngine(
        tiny_model, EngineConfig(kv_budget_bytes=8 << 20, max_context=128, cpu_turns=str(path))
    )
    events = []
    engine.start()
    try:
        other = CpuTurns(path)
        with other:
            engine.submit(
                Sequence("r", list(range(1, 20)), SamplingParams(), 8, frozenset()),
                events.append,
            )
            time.sleep(0.5)
            assert not events and engine.steps == 0
        other.close()
        end = time.monotonic() + 60
        while not (events and events[-1].finish_reason) and time.monotonic() < end:
            time.sleep(0.01)
        assert events and events[-1].finish_reason
        assert engine.turns.turns >= engine.steps >= 7 and engine.turns.waited_s >= 0.4
        assert engine.stats()["cpu_turn_wait_s"] >= 0.4
    finally:
        engine.stop()
