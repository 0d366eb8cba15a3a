"""`megaserve bench serve`: the whole service under closed-loop load, disaggregated (prefill
tier + decode tier) against colocated (one decode worker), through the router's public API.

Every process is real (a private Redis per layout, workers, a router). C closed-loop clients
each send their next request when the previous one finishes; prompt and output lengths are
drawn from a stated mix with a fixed seed, so both layouts see the same requests at a level.
Reported per (layout, concurrency): TTFT p50/p99, inter-token latency p50/p99, output tok/s,
requests/s, goodput (requests/s meeting both SLOs) and errors."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np

from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.bench import summary
from megaserve_app.bench.serve_report import markdown_table, plot  # noqa: F401 (re-exported)
from megaserve_app.launch import Cluster, RedisProcess, worker_stats

DEFAULT_MIX = "short:32-128:0.6,medium:256-512:0.3,long:1024-1536:0.1"
DEFAULT_OUTPUT = "16-128"
LAYOUTS = ("disaggregated", "colocated")
# Router configs. Disaggregated: no uncached-token threshold, so every prompt goes through the
# prefill tier unless the prefill worker is busy (the default 16 prompts in flight; then the
# router co-locates, counted per row as via_prefill_tier < requests). The decode worker's
# reservation is taken before the prompt queues on the prefill worker, so its lease must
# outlast that queue: at the default 60 s, deep prefill queues on this CPU let leases lapse,
# the KV hand-offs are refused and the decode worker's circuit breaker opens.
ROUTER_CONFIG = {
    "disaggregated": {"disagg_min_uncached_tokens": 0, "reservation_lease_ms": 600_000},
    "colocated": {"disagg_min_uncached_tokens": 1 << 30},
}
_COMPILED = re.compile(r"Finished XLA compilation of .* in ([0-9.]+) sec")


def _range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise ValueError(f"bad length range {s!r} (want LO-HI, 1 <= LO <= HI)")
    return lo, hi


@dataclass(frozen=True)
class Mix:
    """Prompt lengths: a weighted choice of bins, log-uniform inside the chosen bin (so the
    whole distribution is right-skewed, lognormal-ish); output lengths log-uniform too."""

    bins: tuple[tuple[str, int, int, float], ...]  # (name, lo, hi, weight)
    output: tuple[int, int]
    seed: int = 0

    @classmethod
    def parse(cls, spec: str, output: str = DEFAULT_OUTPUT, seed: int = 0) -> Mix:
        """`name:LO-HI:WEIGHT,...` (name optional: `LO-HI:WEIGHT`)."""
        bins = []
        for i, part in enumerate(p for p in spec.split(",") if p.strip()):
            fields = part.strip().split(":")
            if len(fields) == 2:
                fields = [f"bin{i}", *fields]
            if len(fields) != 3:
                raise ValueError(f"bad prompt-mix entry {part!r} (want name:LO-HI:WEIGHT)")
            lo, hi = _range(fields[1])
            w = float(fields[2])
            if not w > 0:
                raise ValueError(f"weight {w} of {part!r} must be > 0")
            bins.append((fields[0], lo, hi, w))
        if not bins:
            raise ValueError("empty prompt mix")
        return cls(tuple(bins), _range(output), seed)

    @property
    def max_prompt(self) -> int:
        return max(b[2] for b in self.bins)

    def describe(self) -> str:
        total = sum(b[3] for b in self.bins)
        parts = [f"{n} {lo}-{hi} ({100 * w / total:.0f}%)" for n, lo, hi, w in self.bins]
        lo, hi = self.output
        return (
            f"prompt tokens: {', '.join(parts)}, log-uniform within a bin; output tokens "
            f"{lo}-{hi} log-uniform (ignore_eos); random token ids, seed {self.seed}"
        )

    def draw(self, n: int, vocab: int, stream: int) -> list[tuple[list[int], int]]:
        """n (prompt ids, max_tokens); `stream` picks an independent, reproducible sequence."""
        rng = np.random.default_rng([self.seed, stream])
        w = np.array([b[3] for b in self.bins])
        lo_id = min(100, vocab // 4)  # clear of special ids at the bottom of the vocabulary
        out = []
        for _ in range(n):
            _, lo, hi, _ = self.bins[rng.choice(len(self.bins), p=w / w.sum())]
            length = _log_uniform(rng, lo, hi)
            out.append(
                (rng.integers(lo_id, vocab, length).tolist(), _log_uniform(rng, *self.output))
            )
        return out


def _log_uniform(rng, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


@dataclass
class Settings:
    checkpoint: str = "smollm2"
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    requests_per_level: int | None = None  # None: max(16, 2c), at most max_requests
    max_requests: int = 64
    mix: Mix = field(default_factory=lambda: Mix.parse(DEFAULT_MIX))
    slo_ttft_ms: float = 2000.0
    slo_itl_ms: float = 200.0
    layouts: tuple[str, ...] = LAYOUTS
    max_context: int = 2048
    kv_budget_mb: int = 1536
    worker_args: tuple[str, ...] = ()  # extra arguments for every worker
    decode_cpu_nice: int = 0  # the disaggregated decode worker's --cpu-nice (see Layout.start)
    cpu_turns: bool = False  # the disaggregated workers take turns on the cores (--cpu-turns)
    prefill_chunk: int | None = None  # the prefill worker's --prefill-chunk (None: its default)
    warm: bool = True

    def requests_at(self, c: int) -> int:
        """Default max(16, 2c) capped at max_requests (64: never fewer requests than clients,
        and the SmolLM2 sweep stays near 15 minutes on a 2-core CPU)."""
        return self.requests_per_level or min(max(16, 2 * c), self.max_requests)


async def _request(stub, prompt: list[int], max_tokens: int, rid: str) -> dict:
    """One streamed Generate. ITL samples: each message after the first contributes its gap
    since the previous message, split evenly over the tokens it carries."""
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    t0 = time.perf_counter()
    arrivals = []  # (time, tokens) of each message that carried tokens
    try:
        async for r in stub.Generate(req, timeout=900):
            n = len(r.token_ids)
            if not n:
                continue
            arrivals.append((time.perf_counter(), n))
    except grpc.aio.AioRpcError as e:
        return {"error": f"{e.code().name}: {e.details()}", "prompt": len(prompt)}
    if not arrivals:
        return {"error": "no tokens streamed", "prompt": len(prompt)}
    return summary.stream_result(len(prompt), t0, arrivals)


async def closed_loop(address: str, requests, concurrency: int, tag: str) -> tuple[list, float]:
    """`concurrency` clients; each takes the next request when its previous one finished."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pbg.GenerationStub(ch)
        it = iter(enumerate(requests))
        results = []

        async def client():
            for i, (prompt, max_tokens) in it:  # the shared iterator hands out each once
                results.append(await _request(stub, prompt, max_tokens, f"{tag}-{i}"))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def summarize(results: list[dict], wall: float, s: Settings) -> dict:
    return summary.serve_summary(results, wall, s.slo_ttft_ms, s.slo_itl_ms)


class CompileCounter:
    """Counts the XLA compilations a worker logs (JAX_LOG_COMPILES): warm-up must leave none
    (or only persistent-cache loads) for the measured levels."""

    def __init__(self):
        self.n, self.seconds, self.last = 0, 0.0, []

    def __call__(self, name: str, line: str) -> None:
        m = _COMPILED.search(line)
        if m:
            self.n += 1
            self.seconds += float(m.group(1))
            self.last = [*self.last[-19:], f"{name}: {line.strip()[:300]}"]


class Layout:
    """One layout's processes: a private Redis, 1 decode (+ 1 prefill) worker, one router.
    start() only launches (both layouts start in parallel), wait() blocks until the router
    sees every worker."""

    def __init__(self, name: str, s: Settings, vocab: int):
        if name not in ROUTER_CONFIG:
            raise ValueError(f"unknown layout {name!r} (choose from {', '.join(LAYOUTS)})")
        self.name, self.s, self.vocab = name, s, vocab
        self.n_prefill = int(name == "disaggregated")
        self.compiles = CompileCounter()
        self.redis = self.cluster = None

    def start(self) -> Layout:
        s, self.tmp = self.s, Path(tempfile.mkdtemp(prefix=f"megaserve-serve-{self.name}-"))
        self.redis = RedisProcess(self.tmp).start()
        args = ("--max-context", str(s.max_context), "--kv-budget-mb", str(s.kv_budget_mb))
        self.cluster = Cluster(
            self.redis.url, s.checkpoint, worker_args=args + tuple(s.worker_args),
            echo=self.compiles,
        )  # fmt: skip
        # Disaggregated, the decode worker shares the cores with the prefill worker: a nice
        # value gives prefills the CPU first (a CPU-weight split between tiers), or with
        # --cpu-turns the two alternate, a decode step between any two prefill calls, as a
        # colocated worker's iterations do (separate slices on TPU: neither applies).
        nice = ("--cpu-nice", str(s.decode_cpu_nice)) if self.n_prefill else ()
        turns = (
            ("--cpu-turns", str(self.tmp / "cpu-turns")) if self.n_prefill and s.cpu_turns else ()
        )
        chunk = ("--prefill-chunk", str(s.prefill_chunk)) if s.prefill_chunk else ()
        self.workers = [self.cluster.worker("decode", f"{self.name}-d0", *nice, *turns)] + [
            self.cluster.worker("prefill", f"{self.name}-p{i}", *turns, *chunk)
            for i in range(self.n_prefill)
        ]
        cfg = self.tmp / "loadbalancer.yaml"
        cfg.write_text("".join(f"{k}: {v}\n" for k, v in ROUTER_CONFIG[self.name].items()))
        self.router = self.cluster.router(f"{self.name}-router", "--config", str(cfg))
        return self

    # 30 min: with a cold compilation cache (a fresh machine) the layouts' three workers each
    # compile their whole program set at once on the same cores; 300 s was not enough on 2
    # cores. A worker that exits fails the wait at once, so the limit only bounds a hang.
    def wait(self, timeout: float = 1800.0) -> Layout:
        for p in [*self.workers, self.router]:
            p.wait_ready(timeout)
        self.cluster.wait_registered([w.name for w in self.workers])
        self.address, self.decode = self.router.address, self.workers[0].address
        with grpc.insecure_channel(self.address) as ch:
            stub = pbg.GenerationStub(ch)
            end = time.monotonic() + 30
            while time.monotonic() < end:  # the router reads Redis every state_refresh_ms
                m = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
                if m and m[0].decode_workers == 1 and m[0].prefill_workers == self.n_prefill:
                    return self
                time.sleep(0.1)
        raise TimeoutError(f"{self.name}: the router does not see its workers")

    def stop(self) -> None:
        if self.cluster:
            self.cluster.stop()
        if self.redis:
            self.redis.kill()

    def warm(self, levels: list[int], log) -> None:
        """Compiles what the run will use, with prompts that share nothing with it: every
        bin's shortest, middle and longest prompt one at a time (the longest of each decodes
        to the longest output), then a burst of prompts at each concurrency."""
        t0 = time.perf_counter()
        mix, out_hi = self.s.mix, self.s.mix.output[1]
        lo_id = min(100, self.vocab // 4)
        rng = np.random.default_rng(12345)
        seq = []
        for _, lo, hi, _ in mix.bins:
            for n in sorted({lo, (lo + hi) // 2, hi}):
                seq.append((rng.integers(lo_id, self.vocab, n).tolist(), out_hi if n == hi else 4))
        res, _ = asyncio.run(closed_loop(self.address, seq, 1, f"warm-{self.name}-seq"))
        errors = [r["error"] for r in res if "error" in r]
        # Bursts: batch shapes (decode batches, batched prefill) at every concurrency; mostly
        # short prompts (cheap), with every other bin's longest among them for the wide pages.
        shortest = min(mix.bins, key=lambda b: b[2])
        short = Mix((shortest,), mix.output, mix.seed)
        longs = [hi for _, _, hi, _ in mix.bins if hi != shortest[2]]
        for c in (c for c in levels if c > 1):
            burst = [(p, 8) for p, _ in short.draw(c, self.vocab, 10_000 + c)]
            for j, n in enumerate(longs[: c - 1]):
                burst[1 + j] = (rng.integers(lo_id, self.vocab, n).tolist(), 8)
            res, _ = asyncio.run(closed_loop(self.address, burst, c, f"warm-{self.name}-{c}"))
            errors += [r["error"] for r in res if "error" in r]
        if errors:  # not fatal: the measured rows count their own errors
            log(f"  {self.name}: {len(errors)} warm-up requests failed: {sorted(set(errors))[:3]}")
        log(
            f"  {self.name}: warmed in {time.perf_counter() - t0:.0f} s "
            f"({self.compiles.n} programs compiled or loaded from the cache)"
        )


def bench_serve(s: Settings, log=print, on_row=None) -> dict:
    """Both layouts up at once (each with its own Redis); levels interleaved layout by layout
    so drift on a shared machine hits both alike. Returns {"settings", "rows", "runtime_s"};
    on_row(partial result) after every row (a long run interrupted keeps what it measured)."""
    import os

    from megaserve.checkpoint import load_tokenizer

    os.environ.setdefault("JAX_LOG_COMPILES", "1")  # workers inherit it: CompileCounter
    t_start = time.perf_counter()
    vocab = load_tokenizer(s.checkpoint).vocab_size
    levels = list(s.concurrency)
    if s.mix.max_prompt + s.mix.output[1] > s.max_context:
        raise ValueError(
            f"longest prompt + output ({s.mix.max_prompt}+{s.mix.output[1]}) exceeds "
            f"--max-context {s.max_context}"
        )
    rows = []
    with contextlib.ExitStack() as es:
        if threading.current_thread() is threading.main_thread():  # SIGTERM stops the stacks
            prev = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
            es.callback(signal.signal, signal.SIGTERM, prev)
        log(f"starting {', '.join(s.layouts)} ({s.checkpoint})")
        layouts = [Layout(n, s, vocab) for n in s.layouts]
        for lay in layouts:
            es.callback(lay.stop)
            lay.start()
        for lay in layouts:
            lay.wait()
        log(f"  up in {time.perf_counter() - t_start:.0f} s")
        if s.warm:
            for lay in layouts:
                lay.warm(levels, log)
        for c in levels:
            n = s.requests_at(c)
            reqs = s.mix.draw(n, vocab, c)  # the same requests for every layout at this level
            for lay in layouts:
                before = worker_stats(lay.decode)
                c0, cs0 = lay.compiles.n, lay.compiles.seconds
                results, wall = asyncio.run(closed_loop(lay.address, reqs, c, f"{lay.name}-{c}"))
                after = worker_stats(lay.decode)
                row = {"layout": lay.name, "concurrency": c, **summarize(results, wall, s)}
                row |= {
                    "via_prefill_tier": after.imported_requests - before.imported_requests,
                    "preemptions": after.preemptions - before.preemptions,
                    "decode_turn_wait_s": after.cpu_turn_wait_s - before.cpu_turn_wait_s,
                    "compiles": lay.compiles.n - c0,
                    "compile_s": lay.compiles.seconds - cs0,
                }
                rows.append(row)
                if on_row:
                    on_row(_result(s, rows, t_start, partial=True))
                log(
                    f"  {lay.name:>13} c={c:<3} n={n:<3} TTFT p50 {row['ttft_p50_ms']:7.0f} ms "
                    f"p99 {row['ttft_p99_ms']:7.0f}  ITL p50 {row['itl_p50_ms']:6.1f} p99 "
                    f"{row['itl_p99_ms']:6.1f}  {row['output_tok_s']:6.1f} tok/s  goodput "
                    f"{row['goodput_req_s']:.2f}/{row['req_s']:.2f} req/s  errors {row['errors']}"
                    f"  compiles {row['compiles']} ({wall:.0f} s)"
                )
    return _result(s, rows, t_start)


def _result(s: Settings, rows: list[dict], t_start: float, partial: bool = False) -> dict:
    settings = asdict(s) | {"mix": s.mix.describe(), "mix_spec": asdict(s.mix)}
    out = {"settings": settings, "rows": list(rows), "runtime_s": time.perf_counter() - t_start}
    return out | ({"partial": True} if partial else {})
