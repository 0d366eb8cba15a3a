"""The router-overhead benchmark's arithmetic on synthetic numbers: paired differences,
process CPU per request, and the router's own CPU aggregation by component (router/costs.py),
laps and background work included."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megaserve_app.bench.router_overhead import (
    component_rows,
    costs_summaries,
    paired_overhead,
    process_cpu_per_request,
)
from router import costs


def test_paired_overhead_takes_percentiles_of_the_differences():
    direct = [10.0, 20.0, 30.0, 40.0]
    via = [11.0, 23.0, 31.0, 48.0]  # differences 1, 3, 1, 8
    out = paired_overhead(direct, via)
    assert out["pairs"] == 4
    assert out["added_p50_ms"] == pytest.approx(2.0)  # sorted 1, 1, 3, 8: halfway 1..3
    assert out["added_p99_ms"] == pytest.approx(3 + 0.97 * 5)  # numpy's interpolation
    assert out["added_mean_ms"] == pytest.approx(3.25)
    assert out["direct_p50_ms"] == pytest.approx(25.0)
    assert out["router_p50_ms"] == pytest.approx(27.0)
    assert out["added_p99_ms"] == pytest.approx(float(np.percentile([1, 3, 1, 8], 99)))


def test_paired_differences_cancel_drift_that_percentiles_of_each_side_do_not():
    # The machine slows down halfway; every router call costs exactly 0.5 ms more.
    direct = [100.0] * 50 + [300.0] * 50
    via = [d + 0.5 for d in direct]
    out = paired_overhead(direct, via)
    assert out["added_p50_ms"] == pytest.approx(0.5)
    assert out["added_p99_ms"] == pytest.approx(0.5)


def test_paired_overhead_names_unequal_or_empty_counts():
    with pytest.raises(ValueError, match="3 vs 2"):
        paired_overhead([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="0 vs 0"):
        paired_overhead([], [])


def test_process_cpu_per_request_less_the_idle_rate():
    measured = {"requests": 100, "process_cpu_ms": 250.0, "window_s": 10.0}
    idle = {"requests": 0, "process_cpu_ms": 20.0, "window_s": 2.0}  # 10 ms/s in the background
    out = process_cpu_per_request(measured, idle)
    assert out["process_cpu_ms_per_request"] == pytest.approx(2.5)
    assert out["idle_cpu_ms_per_s"] == pytest.approx(10.0)
    assert out["process_cpu_ms_per_request_less_idle"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no requests"):
        process_cpu_per_request({**measured, "requests": 0}, idle)


def test_costs_summaries_reads_the_routers_records_in_order():
    rec = {"requests": 2, "cpu_us": {}, "event": "request costs", "level": "info"}
    lines = [
        "READY router r1 grpc=127.0.0.1:1\n",
        json.dumps({"event": "request", "request_id": "request costs"}) + "\n",  # not the event
        json.dumps(rec) + "\n",
        '{"event": "request costs", broken\n',
        json.dumps({**rec, "requests": 5}) + "\n",
    ]
    assert [r["requests"] for r in costs_summaries(lines)] == [2, 5]


class FakeCPU:
    """Stands in for time.thread_time: advanced by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def cpu(monkeypatch):
    clock = FakeCPU()
    monkeypatch.setattr(costs.time, "thread_time", clock)
    monkeypatch.setattr(costs, "_background", [0.0])
    return clock


def test_laps_charge_each_component_the_cpu_since_the_previous_lap(cpu):
    c = costs.RequestCost()
    cpu.t += 0.000_050
    c.lap("validate")
    cpu.t += 0.000_020
    c.lap("claim")
    cpu.t += 0.000_010
    c.lap("validate")  # a component met twice adds up
    c.add("validate", 0.000_100)  # CPU on another thread (a long prompt's tokenizing)
    assert c.cpu["validate"] == pytest.approx(0.000_160)
    assert c.cpu["claim"] == pytest.approx(0.000_020)
    assert c.total == pytest.approx(0.000_180)


def test_background_work_during_a_lap_is_not_charged_to_the_request(cpu):
    c = costs.RequestCost()
    cpu.t += 0.001_000  # the lap spans a 0.8 ms view refresh
    costs.charge_background(0.000_800)
    c.lap("worker_call")
    assert c.cpu["worker_call"] == pytest.approx(0.000_200)
    cpu.t += 0.000_100  # a refresh measured longer than the lap (it interleaved): not negative
    costs.charge_background(0.000_300)
    c.lap("respond")
    assert c.cpu["respond"] == 0.0


def test_module_lap_charges_the_tasks_current_request(cpu):
    costs.lap("pick")  # no request timed in this context: nothing happens
    c = costs.begin()
    cpu.t += 0.000_030
    costs.lap("pick")
    assert c.cpu["pick"] == pytest.approx(0.000_030)


def test_cost_stats_percentiles_by_component_and_reset(cpu):
    stats = costs.CostStats()
    for i in range(1, 101):  # validate 1..100 us, claim 10 us each
        c = costs.RequestCost()
        c.add("validate", i * 1e-6)
        c.add("claim", 10e-6)
        stats.record(c)
    s = stats.summary()
    assert s["requests"] == 100
    assert s["cpu_us"]["validate"]["p50"] == pytest.approx(50.5)
    assert s["cpu_us"]["validate"]["p99"] == pytest.approx(99.0)  # 99.01, to 0.1 us
    assert s["cpu_us"]["validate"]["mean"] == pytest.approx(50.5)
    assert s["cpu_us"]["claim"]["p99"] == pytest.approx(10.0)
    assert s["cpu_us"]["total"]["p50"] == pytest.approx(60.5)
    assert s["cpu_us"]["release"]["p50"] == 0.0  # met by no request: zero, not missing
    assert list(s["cpu_us"]) == [*costs.COMPONENTS, "total"]
    assert stats.summary()["requests"] == 0  # the summary started a new window


def test_cost_stats_keep_only_the_latest_samples(cpu):
    stats = costs.CostStats(keep=3)
    for us in (1000, 1, 2, 3):
        c = costs.RequestCost()
        c.add("pick", us * 1e-6)
        stats.record(c)
    s = stats.summary()
    assert s["requests"] == 4
    assert s["cpu_us"]["pick"]["p99"] == pytest.approx(3.0)  # the 1000 us one was dropped


def test_component_rows_put_total_last():
    summary = {"cpu_us": {"total": {"p50": 3, "p99": 4, "mean": 3}}}
    summary["cpu_us"] |= {c: {"p50": 1, "p99": 2, "mean": 1} for c in ("validate", "claim")}
    rows = component_rows(summary)
    assert [r[0] for r in rows] == ["validate", "claim", "total"]
    assert rows[-1] == ("total", 3, 4, 3)


def test_percentile_matches_numpy():
    xs = [5.0, 1.0, 9.0, 2.0, 7.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert costs.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert np.isnan(costs.percentile([], 50))


def test_instant_worker_answers_every_step_at_once():
    import sys

    import grpc

    from megaserve.rpc import decode_pb2, decode_pb2_grpc
    from megaserve_app.bench.instant_worker import TOKEN
    from megaserve_app.launch import Proc

    proc = Proc([sys.executable, "-m", "megaserve_app.bench.instant_worker"], "instant")
    try:
        proc.wait_ready(timeout=60)
        req = decode_pb2.GenerateRequest(
            request_id="r",
            prompt_token_ids=[1, 2, 3],
            stopping=decode_pb2.StoppingParams(max_tokens=3),
        )
        with grpc.insecure_channel(proc.address) as ch:
            out = list(decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=30))
    finally:
        proc.stop()
    assert [list(m.token_ids) for m in out] == [[TOKEN]] * 3
    assert [m.finish_reason for m in out] == [0, 0, decode_pb2.FINISH_REASON_LENGTH]
