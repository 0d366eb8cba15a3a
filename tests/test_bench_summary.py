"""The benchmarks' summary arithmetic on synthetic timestamps, against hand-computed values:
timed-run statistics (median [min-max]) and decode rows, bandwidth floor and fraction of it,
ITL splitting, steady-state decode throughput, percentiles, goodput, the router's overhead and
fairness (the KV hand-off's rows: tests/test_bench_handoff_summary.py)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from megaserve_app.bench import serve, summary
from tests.conftest import FakeClock

approx = pytest.approx


def test_percentile_interpolates_linearly_and_is_nan_without_samples():
    assert summary.percentile([4, 1, 3, 2], 50) == 2.5  # halfway between 2 and 3
    # p99 of 4 samples: rank 0.99 * 3 = 2.97, so 3 + 0.97 * (4 - 3).
    assert summary.percentile([1, 2, 3, 4], 99) == approx(3.97)
    assert summary.percentile([7.0], 99) == 7.0
    assert math.isnan(summary.percentile([], 50))


def test_bandwidth_floor_and_fraction_of_it():
    # 2 GB at 1 TB/s: 2 ms at best; a step measured at 8 ms reaches a quarter of the floor.
    assert summary.floor_ms(2_000_000_000, 1e12) == 2.0
    assert summary.floor_fraction(2.0, 8.0) == 0.25
    assert summary.floor_fraction(2.0, 2.0) == 1.0
    assert summary.tokens_per_s(8, 4.0) == 2000.0  # 8 tokens every 4 ms


def test_step_bytes_counts_weights_once_and_kv_per_sequence():
    from megaserve_app.bench.decode import step_bytes

    f32 = np.float32
    params = {
        "layers": [{"w": np.zeros((4, 4), f32)}],  # 64 bytes
        "lm_head": np.zeros((8, 4), f32),  # 128
        "final_norm": np.zeros(4, f32),  # 16
        "embed": np.zeros((8, 4), f32),  # one 16-byte row read per sequence
    }
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=4)
    model = SimpleNamespace(params=params, cfg=cfg)
    # KV row per token: 1 layer * (K, V) * 2 heads * 4 dims * 4 bytes = 64 bytes.
    # Batch 2 at context 10: 64 + 128 + 16 + 2 * 16 weights, 2 * 10 rows read, 2 rows written.
    want = 64 + 128 + 16 + 2 * 16 + 2 * 10 * 64 + 2 * 64
    assert step_bytes(model, batch=2, context=10, kv_itemsize=4) == want == 1648
    assert summary.floor_ms(want, 1648e3) == 1.0  # at 1.648 MB/s: 1 ms


def test_itl_splits_a_message_gap_over_its_tokens():
    # Messages at 1.0 (1 token: the first, no gap), 1.5 (1), 2.5 (2 tokens), 2.75 (3 tokens).
    arrivals = [(1.0, 1), (1.5, 1), (2.5, 2), (2.75, 3)]
    assert summary.split_gaps(arrivals) == [0.5, 0.5, 0.5, 0.25 / 3, 0.25 / 3, 0.25 / 3]
    assert summary.split_gaps([(1.0, 4)]) == []  # one message: no inter-token sample
    r = summary.stream_result(7, 0.75, arrivals)
    assert r == {
        "prompt": 7,
        "tokens": 7,
        "ttft": 0.25,
        "gaps": summary.split_gaps(arrivals),
        "itl_mean": approx(1.75 / 6),  # (2.75 - 1.0) s over the 6 tokens after the first
        "total": 2.0,
    }
    assert summary.stream_result(3, 0.0, [(0.5, 2)])["itl_mean"] == 0.0


class _Stub:
    """A Generation stub streaming scripted messages; each advances the clock first."""

    def __init__(self, clock, script, error=None):
        self.clock, self.script, self.error = clock, script, error

    def Generate(self, req, timeout=None):  # noqa: N802
        async def stream():
            for dt, ids in self.script:
                self.clock.advance(dt)
                yield SimpleNamespace(token_ids=ids)
            if self.error is not None:
                raise self.error

        return stream()


def test_bench_serve_request_times_messages_and_skips_empty_ones(monkeypatch):
    clock = FakeClock(10.0)
    monkeypatch.setattr(serve.time, "perf_counter", clock)
    # First token after 0.25 s; an empty message; one token 0.5 s later; three 0.75 s later.
    script = [(0.25, [5]), (0.125, []), (0.375, [6]), (0.75, [7, 8, 9])]
    r = asyncio.run(serve._request(_Stub(clock, script), [1, 2, 3], 5, "r"))
    assert r == {
        "prompt": 3,
        "tokens": 5,
        "ttft": 0.25,
        "gaps": [0.5, 0.25, 0.25, 0.25],
        "itl_mean": 0.3125,
        "total": 1.5,
    }
    assert asyncio.run(serve._request(_Stub(clock, [(1.0, [])]), [1], 5, "e")) == {
        "error": "no tokens streamed",
        "prompt": 1,
    }
    err = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="gone"
    )
    got = asyncio.run(serve._request(_Stub(clock, [(0.5, [1])], err), [1, 2], 5, "x"))
    assert got == {"error": "UNAVAILABLE: gone", "prompt": 2}


def test_steady_decode_window():
    # Stream A's tokens at 1..5 s, B's at 2, 2.5, 3, 3.5: every stream is past its first token
    # from 2 s (B's first) and none has ended until 3.5 s (B's last). In (2, 3.5]: A's 3 and
    # B's 2.5, 3, 3.5: 4 tokens in 1.5 s.
    a, b = (0.0, [1.0, 2.0, 3.0, 4.0, 5.0]), (0.0, [2.0, 2.5, 3.0, 3.5])
    assert summary.steady_decode_tps([a, b]) == approx(4 / 1.5)
    # One stream ends before the other starts: no such window.
    assert summary.steady_decode_tps([(0.0, [1.0, 2.0]), (0.0, [3.0, 4.0])]) is None


def test_server_row_over_waves():
    wave1 = ([(0.0, [1.0, 2.0, 3.0, 4.0, 5.0]), (0.0, [2.0, 2.5, 3.0, 3.5])], 6.0)
    wave2 = ([(0.5, [1.0, 2.0]), (2.5, [3.0, 4.0])], 4.0)  # no steady window
    row = summary.server_row([wave1, wave2], concurrency=2, prompt_len=64, new_tokens=5)
    # TTFTs 1, 2, 0.5, 0.5 s; ITL samples: A 1,1,1,1; B 0.5,0.5,0.5; C 1; D 1.
    assert row == {
        "concurrency": 2,
        "prompt_len": 64,
        "new_tokens": 5,
        "output_tokens_per_s": 13 / 10.0,  # 13 tokens over 6 + 4 s of waves
        "decode_tokens_per_s": approx(4 / 1.5),  # the median over waves with a window
        "itl_p50_ms": 1000.0,
        "itl_p99_ms": 1000.0,
        "ttft_p50_ms": 750.0,
    }
    one = summary.server_row([wave2], 2, 64, 5)
    assert one["decode_tokens_per_s"] == 0.0  # no wave had a steady window
    # ITL [1, 1]: flat; TTFT [0.5, 0.5].
    assert one["itl_p99_ms"] == 1000.0 and one["ttft_p50_ms"] == 500.0


def test_admission_gaps_overlapping_the_newcomers_prefill():
    # A running stream's tokens at 0, 1, 3, 3.5, 4 s; the newcomer arrives at 1.5 s and gets
    # its first token at 3.25 s: the gaps (1, 3) and (3, 3.5) overlap that, (0, 1) and
    # (3.5, 4) do not.
    stamps = [(0.0, [0.0, 1.0, 3.0, 3.5, 4.0])]
    gaps, during = summary.admission_gaps(stamps, t_admit=1.5, t_first=3.25)
    assert gaps == [1.0, 2.0, 0.5, 0.5] and during == [2.0, 0.5]
    assert summary.admission_gaps(stamps, 4.5, 5.0)[1] == []  # after the stream: none


def _ok(ttft, gaps, tokens, prompt=10):
    return {
        "prompt": prompt,
        "tokens": tokens,
        "ttft": ttft,
        "gaps": gaps,
        "itl_mean": float(np.mean(gaps)) if gaps else 0.0,
        "total": ttft + sum(gaps),
    }


def test_goodput_counts_requests_meeting_both_slos():
    results = [
        _ok(0.5, [0.1, 0.1], 3),  # meets both
        _ok(1.5, [0.1], 2),  # TTFT over 1000 ms
        _ok(0.2, [0.3, 0.3, 0.3], 4),  # mean ITL over 200 ms
        _ok(1.0, [0.2], 2, prompt=30),  # exactly at both SLOs: met
        {"error": "UNAVAILABLE: gone", "prompt": 20},
        {"error": "UNAVAILABLE: gone", "prompt": 30},
    ]
    got = summary.serve_summary(results, wall=2.0, slo_ttft_ms=1000.0, slo_itl_ms=200.0)
    assert got == {
        "requests": 6,
        "errors": 2,
        "error_messages": ["UNAVAILABLE: gone"],
        "wall_s": 2.0,
        "prompt_tokens_mean": 110 / 6,
        "output_tokens": 11,
        # TTFTs 200, 500, 1000, 1500 ms.
        "ttft_p50_ms": 750.0,
        "ttft_p99_ms": approx(1485.0),  # rank 2.97: 1000 + 0.97 * 500
        # ITL samples 100, 100, 100, 200, 300, 300, 300 ms.
        "itl_p50_ms": approx(200.0),
        "itl_p99_ms": approx(300.0),
        "output_tok_s": 5.5,
        "req_s": 2.0,  # 4 answered in 2 s
        "goodput_req_s": 1.0,  # 2 within both SLOs
        "slo_met_fraction": 2 / 6,  # of all requests, errors included
    }
    s = serve.Settings(slo_ttft_ms=1000.0, slo_itl_ms=200.0)
    assert serve.summarize(results, 2.0, s) == got
    strict = serve.summarize(results, 2.0, serve.Settings(slo_ttft_ms=400.0, slo_itl_ms=200.0))
    assert strict["goodput_req_s"] == 0.0 and strict["slo_met_fraction"] == 0.0
    empty = summary.serve_summary([{"error": "x", "prompt": 4}], 1.0, 1.0, 1.0)
    assert empty["req_s"] == 0.0 and math.isnan(empty["ttft_p50_ms"])


def test_router_drive_summary_and_overhead():
    def usage(p, c):
        return SimpleNamespace(prompt_tokens=p, cached_tokens=c)

    results = [
        {"ttft": 0.010, "tokens": 8, "usage": usage(200, 0)},
        {"ttft": 0.020, "tokens": 8, "usage": usage(200, 192)},
        {"ttft": 0.060, "tokens": 8, "usage": usage(200, 160)},
    ]
    got = summary.drive_summary(results, wall=4.0)
    assert got == {
        "requests": 3,
        "hit_rate": 352 / 600,
        "ttft_mean_ms": approx(30.0),
        "ttft_p50_ms": approx(20.0),
        "ttft_p99_ms": approx(59.2),  # rank 1.98: 20 + 0.98 * 40
        "output_tok_s": 6.0,
        "wall_s": 4.0,
    }
    out = summary.router_overhead([10.0, 20.0, 30.0], [12.0, 25.0, 40.0])
    assert list(out) == [
        "direct_p50_ms",
        "direct_p99_ms",
        "router_p50_ms",
        "router_p99_ms",
        "added_p50_ms",
        "added_p99_ms",
    ]
    assert out["added_p50_ms"] == 5.0
    assert out["direct_p99_ms"] == approx(29.8) and out["router_p99_ms"] == approx(39.7)
    assert out["added_p99_ms"] == approx(9.9)
    assert summary.max_over_fair([30, 34], 64) == 34 / 32
    assert summary.max_over_fair([16, 16, 16, 16], 64) == 1.0


def test_run_stats_median_and_min_max_of_the_runs():
    # Runs of 4, 2 and 9 ms: median 4, spread 2-9 (the mean, 5, would follow the 9).
    s = summary.run_stats([0.004, 0.002, 0.009])
    assert s == approx((4.0, 2.0, 9.0, 3))
    assert s.fields("ms_per_step") == {
        "ms_per_step": approx(4.0),
        "ms_min": approx(2.0),
        "ms_max": approx(9.0),
        "runs": 3,
    }
    # An even count: the middle two's mean. Runs of a batch of 4 prompts: each run / 4 first.
    assert summary.run_stats([0.001, 0.002, 0.003, 0.010]).median_ms == approx(2.5)
    assert summary.run_stats([0.004, 0.012, 0.008], per=4) == approx((2.0, 1.0, 3.0, 3))
    assert summary.spread_text(25.54, 24.06, 131.0) == "25.5 [24.1-131.0]"
    with pytest.raises(ValueError, match="no timed runs"):
        summary.run_stats([])


def test_decode_row_statistic_tokens_per_s_and_floor_from_step_times():
    from megaserve_app.bench.decode import decode_row

    # Batch 8; steps of 40, 20, 25, 30 and 200 ms: median 30 [20-200] (the mean is 63).
    times = [0.040, 0.020, 0.025, 0.030, 0.200]
    raw = {"engine": "transformers", "precision": "f32", "batch": 8, "context": 512}
    row = decode_row(raw | {"times_s": times}, bytes_per_step=6_000_000_000, bandwidth=1e12)
    assert row == raw | {
        "ms_per_step": approx(30.0),
        "ms_min": approx(20.0),
        "ms_max": approx(200.0),
        "runs": 5,
        "tokens_per_s": approx(8000 / 30),  # 8 tokens per 30 ms step
        "bytes_per_step": 6_000_000_000,
        "floor_ms": 6.0,  # 6 GB at 1 TB/s
        "floor_fraction": approx(0.2),  # 6 ms of floor / 30 ms
        "times_s": times,
    }
    no_floor = decode_row(raw | {"times_s": times}, None, 1e12)
    assert "floor_ms" not in no_floor and no_floor["tokens_per_s"] == row["tokens_per_s"]
    assert decode_row(raw | {"error": "timeout"}, None, 1e12) == raw | {"error": "timeout"}
