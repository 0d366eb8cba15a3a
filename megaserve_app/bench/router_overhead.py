"""`megaserve bench router --overhead-only`: what the router adds to time to first token
(max_tokens 1; straight to the decode worker and through the router, request by request,
every prompt distinct) and its own CPU per request by component (its SIGUSR1 summary)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.state_keys import WorkerInfo, worker_key, workers_set
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.bench.router import BenchStack, _warm
from megaserve_app.bench.summary import percentile
from megaserve_app.launch import Cluster, Proc, RedisProcess

COSTS_EVENT = "request costs"  # the router's SIGUSR1 log line (router/main.py)
WARMUP_PAIRS = 8
IDLE_S = 2.0  # an idle window first: the router's background CPU (state refresh, gRPC)


def paired_overhead(direct_ms: list[float], via_ms: list[float]) -> dict:
    """Added latency from pairs measured back to back: p50/p99/mean of via[i] - direct[i]
    (machine drift hits both of a pair alike), and each path's own p50/p99."""
    if len(direct_ms) != len(via_ms) or not direct_ms:
        raise ValueError(f"need equal, non-zero pair counts: {len(direct_ms)} vs {len(via_ms)}")
    diffs = [v - d for d, v in zip(direct_ms, via_ms)]
    return {
        "pairs": len(diffs),
        "direct_p50_ms": percentile(direct_ms, 50),
        "direct_p99_ms": percentile(direct_ms, 99),
        "router_p50_ms": percentile(via_ms, 50),
        "router_p99_ms": percentile(via_ms, 99),
        "added_p50_ms": percentile(diffs, 50),
        "added_p99_ms": percentile(diffs, 99),
        "added_mean_ms": sum(diffs) / len(diffs),
    }


def process_cpu_per_request(measured: dict, idle: dict) -> dict:
    """The router process's CPU per request (every thread) from two of its cost summaries:
    the measured window's, raw and less the background rate of an idle window."""
    n = measured["requests"]
    if not n:
        raise ValueError(f"the measured window holds no requests: {measured}")
    rate = idle["process_cpu_ms"] / idle["window_s"] if idle["window_s"] > 0 else 0.0
    raw = measured["process_cpu_ms"] / n
    return {
        "process_cpu_ms_per_request": raw,
        "idle_cpu_ms_per_s": rate,
        "process_cpu_ms_per_request_less_idle": raw - rate * measured["window_s"] / n,
    }


def component_rows(summary: dict) -> list[tuple[str, float, float, float]]:
    """(component, p50, p99, mean) microseconds from a cost summary; total last."""
    cpu = summary["cpu_us"]
    names = [c for c in cpu if c != "total"] + ["total"]
    return [(c, cpu[c]["p50"], cpu[c]["p99"], cpu[c]["mean"]) for c in names]


def costs_summaries(lines: list[str]) -> list[dict]:
    """Every `request costs` record in a router's output (JSON lines), in order."""
    out = []
    for line in lines:
        if COSTS_EVENT not in line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") == COSTS_EVENT:
            out.append(rec)
    return out


def _costs_now(proc, timeout: float = 10.0) -> dict:
    """Signals the router for its cost summary (which also starts the next window)."""
    have = len(costs_summaries(list(proc.lines)))
    os.kill(proc.pid, signal.SIGUSR1)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = costs_summaries(list(proc.lines))
        if len(found) > have:
            return found[have]
        time.sleep(0.01)
    raise TimeoutError(f"router pid {proc.pid} logged no {COSTS_EVENT!r} in {timeout} s")


async def _ttft_direct(stub, prompt: list[int], rid: str) -> float:
    req = decode_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        stopping=decode_pb2.StoppingParams(max_tokens=1, ignore_eos=True),
    )
    t0, first = time.perf_counter(), None
    async for r in stub.Generate(req, timeout=120):
        if first is None and r.token_ids:
            first = time.perf_counter()
    return 1000 * (first - t0)


async def _ttft_router(stub, prompt: list[int], rid: str) -> float:
    req = pb.GenerateRequest(
        request_id=rid,  # "": the router makes one
        prompt_token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingParams(max_tokens=1, ignore_eos=True),
    )
    t0, first = time.perf_counter(), None
    async for r in stub.Generate(req, timeout=120):
        if first is None and r.token_ids:
            first = time.perf_counter()
    return 1000 * (first - t0)


async def _pairs(worker: str, router: str, prompts, tag: str, client_ids: bool = True):
    """TTFT of prompts[2i] direct and prompts[2i+1] via the router, the order alternating;
    with client_ids the router's requests carry a request_id (claimed in Redis)."""
    direct, via = [], []
    async with (
        grpc.aio.insecure_channel(worker) as dch,
        grpc.aio.insecure_channel(router) as rch,
    ):
        dstub, rstub = decode_pb2_grpc.DecodeStub(dch), pbg.GenerationStub(rch)
        for i in range(len(prompts) // 2):
            a, b = prompts[2 * i], prompts[2 * i + 1]
            rid = f"{tag}-r{i}" if client_ids else ""
            if i % 2:
                via.append(await _ttft_router(rstub, b, rid))
                direct.append(await _ttft_direct(dstub, a, f"{tag}-d{i}"))
            else:
                direct.append(await _ttft_direct(dstub, a, f"{tag}-d{i}"))
                via.append(await _ttft_router(rstub, b, rid))
    return direct, via


def _router(cluster: Cluster, tmp: Path, worker_streams: bool) -> Proc:
    """The router under test: co-located prefill (one decode worker, no prefill tier)."""
    cfg = tmp / "lb-overhead.yaml"
    streams = "true" if worker_streams else "false"
    cfg.write_text(f"disagg_min_uncached_tokens: {1 << 30}\nworker_streams: {streams}\n")
    router = cluster.router("overhead", "--config", str(cfg))
    router.wait_ready()
    return router


@contextlib.contextmanager
def _real_stack(checkpoint, worker_args, vocab, prompt_len, worker_streams):
    """(decode worker address, router) over a fresh Redis: the model's real worker."""
    with BenchStack(checkpoint, 1, 0, worker_args, vocab) as st:
        worker = st.decoders[0].address
        _warm(worker, vocab, [prompt_len], 1)
        yield worker, _router(st.cluster, st.tmp, worker_streams)


@contextlib.contextmanager
def _instant_stack(checkpoint, vocab, worker_streams):
    """(stand-in worker address, router) over a fresh Redis; the worker answers at once."""
    import redis

    tmp = Path(tempfile.mkdtemp(prefix="megaserve-bench-"))
    redis_proc = RedisProcess(tmp).start()
    cluster = Cluster(redis_proc.url, checkpoint)
    worker = Proc([sys.executable, "-m", "megaserve_app.bench.instant_worker"], "instant")
    try:
        worker.wait_ready()
        info = WorkerInfo(
            "instant", "decode", worker.address, cluster.model_name, 4096, 4096, 0, 0, 16, 4096
        )
        r = redis.Redis.from_url(redis_proc.url)
        r.hset(worker_key(info.worker_id), mapping=info.to_hash())  # no TTL: it never beats
        r.sadd(workers_set("decode"), info.worker_id)
        yield worker.address, _router(cluster, tmp, worker_streams)
    finally:
        cluster.stop()
        worker.stop()
        redis_proc.kill()


def bench_router_overhead(
    checkpoint: str,
    pairs: int = 200,
    prompt_len: int = 32,
    worker_args=(),
    instant_worker: bool = False,
    client_ids: bool = True,
    worker_streams: bool = True,
    log=print,
) -> dict:
    """One decode worker (or the instant stand-in), one router, a fresh Redis; see the
    module doc."""
    from megaserve.checkpoint import load_tokenizer

    vocab = load_tokenizer(checkpoint).vocab_size
    rng = np.random.default_rng(11)
    lo = min(100, vocab // 4)  # clear of special ids
    n = 2 * (pairs + WARMUP_PAIRS)
    # Random ids: no two prompts share a block, so no request hits the prefix cache.
    prompts = [rng.integers(lo, vocab, prompt_len).tolist() for _ in range(n)]
    warm, timed = prompts[: 2 * WARMUP_PAIRS], prompts[2 * WARMUP_PAIRS :]
    stack = (
        _instant_stack(checkpoint, vocab, worker_streams)
        if instant_worker
        else _real_stack(checkpoint, worker_args, vocab, prompt_len, worker_streams)
    )
    with stack as (worker, router):
        asyncio.run(_pairs(worker, router.address, warm, "warm"))  # waits for the view too
        _costs_now(router)  # drop the warm-up's costs
        time.sleep(IDLE_S)
        idle = _costs_now(router)
        direct, via = asyncio.run(_pairs(worker, router.address, timed, "ovh", client_ids))
        measured = _costs_now(router)
    out = paired_overhead(direct, via)
    out |= process_cpu_per_request(measured, idle)
    out |= {
        "worker": "instant stand-in" if instant_worker else "decode worker",
        "request_ids": "client's" if client_ids else "router-made",
        "worker_calls": "one stream per worker" if worker_streams else "one call per request",
        "prompt_tokens": prompt_len,
        "router_costs": measured,
        "router_idle": idle,
    }
    log(format_report(out))
    return out


def format_report(out: dict) -> str:
    rows = [
        f"router overhead ({out['worker']}, {out['request_ids']} request ids, "
        f"{out.get('worker_calls', 'one call per request')} to the worker): "
        f"{out['pairs']} pairs, TTFT with max_tokens 1, "
        f"{out['prompt_tokens']}-token prompts (all distinct), direct and via the router "
        "alternating",
        f"  direct     p50 {out['direct_p50_ms']:8.2f} ms  p99 {out['direct_p99_ms']:8.2f} ms",
        f"  via router p50 {out['router_p50_ms']:8.2f} ms  p99 {out['router_p99_ms']:8.2f} ms",
        f"  added (paired differences) p50 {out['added_p50_ms']:+.2f} ms  "
        f"p99 {out['added_p99_ms']:+.2f} ms  mean {out['added_mean_ms']:+.2f} ms",
        "router CPU per request, event-loop thread (+ the validation thread), us:",
        f"  {'component':<10}{'p50':>9}{'p99':>9}{'mean':>9}",
    ]
    rows += [
        f"  {c:<10}{p50:>9.1f}{p99:>9.1f}{mean:>9.1f}"
        for c, p50, p99, mean in component_rows(out["router_costs"])
    ]
    less_idle = out["process_cpu_ms_per_request_less_idle"]
    c, n = out["router_costs"], out["router_costs"]["requests"]
    rows.append(
        f"router event loop per request: {c['loop_cpu_ms'] / n:.3f} ms, less its background "
        f"work (view refresh): {(c['loop_cpu_ms'] - c['background_cpu_ms']) / n:.3f} ms; "
        f"log writer thread: {c['log_writer_cpu_ms'] / n:.3f} ms"
    )
    rows.append(
        f"router process CPU per request (all threads): "
        f"{out['process_cpu_ms_per_request']:.3f} ms; less the idle background "
        f"({out['idle_cpu_ms_per_s']:.2f} ms/s): {less_idle:.3f} ms"
    )
    return "\n".join(rows)
