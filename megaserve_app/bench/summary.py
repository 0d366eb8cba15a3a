"""The benchmarks' summary arithmetic as pure functions of measured numbers and timestamps
(unit-tested on synthetic ones): timed-run statistics, bandwidth floors, KV hand-off splits,
inter-token latency, steady-state throughput, percentiles and goodput. Measuring stays in the
benchmarks."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# -- percentiles -----------------------------------------------------------------------------


def percentile(xs, q) -> float:
    """numpy's (linearly interpolated) q-th percentile; NaN for no samples."""
    return float(np.percentile(xs, q)) if xs else float("nan")


# -- timed runs: the one statistic of every engine in every bench ---------------------------


class RunStats(NamedTuple):
    """N timed runs of one measurement, in ms: their median and their min-max spread."""

    median_ms: float
    min_ms: float
    max_ms: float
    runs: int

    def fields(self, median_key: str) -> dict:
        """A row's columns: the median under `median_key`, then ms_min, ms_max, runs."""
        return {
            median_key: self.median_ms,
            "ms_min": self.min_ms,
            "ms_max": self.max_ms,
            "runs": self.runs,
        }


def run_stats(seconds: list[float], per: int = 1) -> RunStats:
    """Median and min-max of timed runs given in seconds, each run's time divided by `per`
    (the prompts or steps one run covers), in ms. Throughputs are taken of the median."""
    if not seconds:
        raise ValueError("no timed runs")
    ms = [1000 * s / per for s in seconds]
    return RunStats(float(np.median(ms)), min(ms), max(ms), len(ms))


def spread_text(median: float, lo: float, hi: float) -> str:
    """How every bench table shows a RunStats: `median [min-max]`, 0.1 ms."""
    return f"{median:.1f} [{lo:.1f}-{hi:.1f}]"


# -- decode step vs the memory-bandwidth floor -----------------------------------------------


def floor_ms(nbytes: int, bandwidth: float) -> float:
    """The fastest a step moving `nbytes` can run at `bandwidth` bytes/s, in ms."""
    return 1000 * nbytes / bandwidth


def floor_fraction(floor: float, ms: float) -> float:
    """How close a measured step (ms) comes to its floor (ms): 1.0 = at the floor."""
    return floor / ms


def tokens_per_s(batch: int, ms_per_step: float) -> float:
    """Decode throughput: one token per sequence per step."""
    return batch * 1000 / ms_per_step


# -- disaggregated hand-off ------------------------------------------------------------------


def transfer_tail_ms(first_chunk_sent_ms: float, transfer_ms: float, compute_ms: float) -> float:
    """The exposed tail of a KV transfer: how long it ran on after the prefill compute ended
    (all three measured from the start of compute)."""
    return max(0.0, first_chunk_sent_ms + transfer_ms - compute_ms)


def hidden_fraction(tail_ms: float, raw_push_ms: float) -> float:
    """Share of the transfer hidden behind compute: 1 - exposed tail / what pushing the same
    bytes costs alone (a raw push, measured in the same run), in [0, 1]; 1.0 when nothing
    is sent. Not tail / transfer span: the span runs from the first chunk to the commit, so
    it grows with the compute and the share would tend to 100% for any long prompt."""
    if raw_push_ms <= 0:
        return 1.0
    return min(1.0, max(0.0, 1 - tail_ms / raw_push_ms))


def handoff_row(
    prompt_len: int,
    bytes_sent: int,
    compute_ms: float,
    transfer_ms: float,
    first_chunk_sent_ms: float,
    t0: float,
    t1: float,
    t2: float,
    stamps: list[float],
    raw_push_ms: float,
) -> dict:
    """One hand-off: Reserve sent at t0 (s), answered at t1, Prefill answered at t2; the
    prefill worker's own compute/transfer figures (ms); `stamps`: the first two tokens'
    arrival times (s); `raw_push_ms`: a raw push of the same bytes alone (same run)."""
    tail = transfer_tail_ms(first_chunk_sent_ms, transfer_ms, compute_ms)
    return {
        "prompt": prompt_len,
        "bytes": bytes_sent,
        "reserve_ms": 1000 * (t1 - t0),
        "prefill_compute_ms": compute_ms,
        "transfer_ms": transfer_ms,
        "transfer_tail_ms": tail,
        "raw_push_ms": raw_push_ms,
        "hidden_fraction": hidden_fraction(tail, raw_push_ms),
        "prefill_rpc_ms": 1000 * (t2 - t1),
        "first_token_ms": 1000 * (stamps[0] - t0),
        "first_decode_step_ms": 1000 * (stamps[1] - stamps[0]),
        "transfer_GBps": bytes_sent / max(transfer_ms, 1e-6) / 1e6,
    }


def raw_transfer_row(
    transport: str,
    nbytes: int,
    seconds: list[float],
    memcpy_gbps: float,
    ceiling_gbps: float | None = None,
) -> dict:
    """A transport's timed pushes of `nbytes` (`seconds`, after warm-up) as median [min-max]
    ms, and the median's GB/s against a plain memcpy's and against a bare gRPC stream's
    (the ceiling, when measured)."""
    st = run_stats(seconds)
    gbps = nbytes / st.median_ms / 1e6
    row = {
        "transport": transport,
        "bytes": nbytes,
        **st.fields("ms"),
        "GBps": gbps,
        "memcpy_GBps": memcpy_gbps,
        "ratio": gbps / memcpy_gbps,
    }
    if ceiling_gbps:
        row["ceiling_GBps"] = ceiling_gbps
        row["of_ceiling"] = gbps / ceiling_gbps
    return row


# -- streams: TTFT, inter-token latency, steady-state throughput -----------------------------


def split_gaps(arrivals: list[tuple[float, int]]) -> list[float]:
    """Inter-token latency samples from a stream's messages, (arrival time, tokens carried),
    messages without tokens left out: each message after the first contributes its gap since
    the previous message, split evenly over the tokens it carries."""
    gaps: list[float] = []
    for (prev, _), (now, n) in zip(arrivals, arrivals[1:]):
        gaps.extend([(now - prev) / n] * n)
    return gaps


def stream_result(prompt_len: int, t0: float, arrivals: list[tuple[float, int]]) -> dict:
    """One streamed request sent at t0 whose token-carrying messages arrived as `arrivals`."""
    gaps = split_gaps(arrivals)
    return {
        "prompt": prompt_len,
        "tokens": sum(n for _, n in arrivals),
        "ttft": arrivals[0][0] - t0,
        "gaps": gaps,
        "itl_mean": float(np.mean(gaps)) if gaps else 0.0,
        "total": arrivals[-1][0] - t0,
    }


def steady_decode_tps(stamps: list[tuple[float, list[float]]]) -> float | None:
    """Tokens/s over the window where every stream is past its first token and none has
    ended: from the last first token to the first last token (tokens strictly after the
    window's start counted). `stamps`: per stream (start, token arrival times). None when the
    window is empty."""
    start = max(ts[0] for _, ts in stamps)
    end = min(ts[-1] for _, ts in stamps)
    n = sum(sum(1 for x in ts if start < x <= end) for _, ts in stamps)
    if end > start:
        return n / (end - start)
    return None


def server_row(
    results: list[tuple[list[tuple[float, list[float]]], float]],
    concurrency: int,
    prompt_len: int,
    new_tokens: int,
) -> dict:
    """Waves of streams, each (per-stream (start, token times), wave wall seconds): total
    and steady-state decode throughput, ITL and TTFT percentiles."""
    itl, ttft, decode_tps = [], [], []
    for stamps, _ in results:
        tps = steady_decode_tps(stamps)
        if tps is not None:
            decode_tps.append(tps)
        for t0, ts in stamps:
            ttft.append(ts[0] - t0)
            itl.extend(np.diff(ts).tolist())
    total = sum(len(ts) for stamps, _ in results for _, ts in stamps)
    wall = sum(w for _, w in results)
    return {
        "concurrency": concurrency,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "output_tokens_per_s": total / wall,
        "decode_tokens_per_s": float(np.median(decode_tps)) if decode_tps else 0.0,
        "itl_p50_ms": 1000 * float(np.percentile(itl, 50)),
        "itl_p99_ms": 1000 * float(np.percentile(itl, 99)),
        "ttft_p50_ms": 1000 * float(np.percentile(ttft, 50)),
    }


def admission_gaps(
    stamps: list[tuple[float, list[float]]], t_admit: float, t_first: float
) -> tuple[list[float], list[float]]:
    """(every inter-token gap of the running streams, the gaps overlapping a newcomer's
    prefill: from its arrival t_admit to its first token t_first)."""
    gaps, during = [], []
    for _, ts in stamps:
        d = np.diff(ts)
        gaps.extend(d.tolist())
        during.extend(g for g, a, b in zip(d, ts[:-1], ts[1:]) if b > t_admit and a < t_first)
    return gaps, during


# -- a whole run: goodput --------------------------------------------------------------------


def serve_summary(results: list[dict], wall: float, slo_ttft_ms: float, slo_itl_ms: float) -> dict:
    """Closed-loop results (stream_result dicts, or {"error", "prompt"}) over `wall` seconds:
    latency percentiles, throughput and goodput (requests/s meeting both SLOs: TTFT, and the
    request's mean inter-token latency)."""
    ok = [r for r in results if "error" not in r]
    ttft = [1000 * r["ttft"] for r in ok]
    gaps = [1000 * g for r in ok for g in r["gaps"]]
    met = [r for r in ok if 1000 * r["ttft"] <= slo_ttft_ms and 1000 * r["itl_mean"] <= slo_itl_ms]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_messages": sorted({r["error"] for r in results if "error" in r})[:5],
        "wall_s": wall,
        "prompt_tokens_mean": float(np.mean([r["prompt"] for r in results])),
        "output_tokens": sum(r["tokens"] for r in ok),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "itl_p50_ms": percentile(gaps, 50),
        "itl_p99_ms": percentile(gaps, 99),
        "output_tok_s": sum(r["tokens"] for r in ok) / wall,
        "req_s": len(ok) / wall,
        "goodput_req_s": len(met) / wall,
        "slo_met_fraction": len(met) / max(len(results), 1),
    }


# -- the router benchmark ------------------------------------------------------------------


def drive_summary(results: list[dict], wall: float) -> dict:
    """Requests through the routers ({"ttft", "tokens", "usage"} each, seconds) over `wall`
    seconds: prefix-cache hit rate, TTFT mean and percentiles, output tokens/s."""
    prompt_toks = sum(r["usage"].prompt_tokens for r in results)
    cached = sum(r["usage"].cached_tokens for r in results)
    ttft = [1000 * r["ttft"] for r in results]
    return {
        "requests": len(results),
        "hit_rate": cached / max(prompt_toks, 1),
        "ttft_mean_ms": float(np.mean(ttft)),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
        "wall_s": wall,
    }


def router_overhead(direct_ms: list[float], via_ms: list[float]) -> dict:
    """Latency through the router against the decode worker directly: p50/p99 of each and
    the difference of the percentiles."""
    out = {"direct_p50_ms": percentile(direct_ms, 50), "direct_p99_ms": percentile(direct_ms, 99)}
    out["router_p50_ms"], out["router_p99_ms"] = percentile(via_ms, 50), percentile(via_ms, 99)
    out["added_p50_ms"] = out["router_p50_ms"] - out["direct_p50_ms"]
    out["added_p99_ms"] = out["router_p99_ms"] - out["direct_p99_ms"]
    return out


def max_over_fair(per_worker: list[int], requests: int) -> float:
    """The busiest worker's requests over an even split of `requests`."""
    return max(per_worker) / (requests / len(per_worker))
