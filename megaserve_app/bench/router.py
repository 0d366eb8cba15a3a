"""`megaserve bench router`: placement policies on a shared-prefix workload (prefix-cache hit
rate, time to first token, per-worker share), one vs two routers, and throughput through one
and two routers (the router's added latency: router_overhead.py). Every process is real:
Redis, workers, routers."""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.bench import summary
from megaserve_app.launch import Cluster, RedisProcess, worker_stats


@dataclass(frozen=True)
class Workload:
    """n_systems long system prompts, each shared by users_per_system users (random ids)."""

    n_systems: int = 8
    users_per_system: int = 8
    system_tokens: int = 192
    user_tokens: int = 24
    max_tokens: int = 8
    concurrency: int = 8
    seed: int = 0

    def prompts(self, vocab: int) -> list[tuple[str, list[int]]]:
        """(user id, prompt ids), users of every system interleaved as they would arrive."""
        rng = np.random.default_rng(self.seed)
        lo = min(100, vocab // 4)  # keep clear of special ids at the bottom of the vocabulary
        systems = [
            rng.integers(lo, vocab, self.system_tokens).tolist() for _ in range(self.n_systems)
        ]
        out = []
        for u in range(self.users_per_system):
            for s in range(self.n_systems):
                out.append(
                    (f"s{s}u{u}", systems[s] + rng.integers(lo, vocab, self.user_tokens).tolist())
                )
        order = rng.permutation(len(out))
        return [out[i] for i in order]


async def _one(stub, prompt, max_tokens, rid, session=""):
    t0 = time.perf_counter()
    first = None
    usage = None
    n = 0
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        session_id=session,
    )
    async for r in stub.Generate(req, timeout=600):
        if first is None and r.token_ids:
            first = time.perf_counter()
        n += len(r.token_ids)
        usage = r.usage
    t1 = time.perf_counter()
    return {"ttft": first - t0, "total": t1 - t0, "tokens": n, "usage": usage}


async def drive(addresses: list[str], prompts, wl: Workload, tag: str, sessions=False) -> dict:
    """Sends every prompt through the routers (round robin over them) at wl.concurrency."""
    chans = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [pbg.GenerationStub(c) for c in chans]
    sem = asyncio.Semaphore(wl.concurrency)
    results = []

    async def run(i, user, prompt):
        async with sem:
            r = await _one(
                stubs[i % len(stubs)], prompt, wl.max_tokens, f"{tag}-{i}", user if sessions else ""
            )
            results.append(r)

    t0 = time.perf_counter()
    await asyncio.gather(*(run(i, u, p) for i, (u, p) in enumerate(prompts)))
    wall = time.perf_counter() - t0
    for c in chans:
        await c.close()
    return summary.drive_summary(results, wall)


def _warm(
    addr: str, vocab: int, lengths: list[int], max_tokens: int, suffix: int = 0, concurrency=1
) -> None:
    """Compiles the shapes the run will use (a cold prompt, then the same prompt with a new
    `suffix`-token tail: the prefix-hit shape) with prompts that share nothing with the run."""
    rng = np.random.default_rng(12345)
    with grpc.insecure_channel(addr) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        for i, n in enumerate(lengths):
            p = rng.integers(0, vocab, n).tolist()
            variants = [p] + (
                [p[: n - suffix] + rng.integers(0, vocab, suffix).tolist()] if suffix else []
            )
            for j, ids in enumerate(variants):
                req = decode_pb2.GenerateRequest(
                    request_id=f"warm-{i}.{j}-{time.time_ns()}",
                    prompt_token_ids=ids,
                    stopping=decode_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
                )
                for _ in stub.Generate(req, timeout=600):
                    pass
    if concurrency > 1:  # the decode step compiles per batch bucket: run every size once
        import concurrent.futures as cf

        # Drawn here: a numpy Generator must not be shared by the worker threads.
        burst = [rng.integers(0, vocab, lengths[0]).tolist() for _ in range(concurrency)]

        def one(j):
            with grpc.insecure_channel(addr) as ch:
                req = decode_pb2.GenerateRequest(
                    request_id=f"warmb-{j}-{time.time_ns()}",
                    prompt_token_ids=burst[j],
                    stopping=decode_pb2.StoppingParams(max_tokens=max_tokens * 4, ignore_eos=True),
                )
                for _ in decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=600):
                    pass

        with cf.ThreadPoolExecutor(concurrency) as ex:
            list(ex.map(one, range(concurrency)))


class BenchStack:
    """Fresh Redis + workers (+ routers) per measurement, so every run starts with cold caches."""

    def __init__(self, checkpoint, decode_workers, prefill_workers, worker_args, vocab):
        self.checkpoint, self.nd, self.np = checkpoint, decode_workers, prefill_workers
        self.worker_args, self.vocab = tuple(worker_args), vocab

    def __enter__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="megaserve-bench-"))
        self.redis = RedisProcess(self.tmp).start()
        self.cluster = Cluster(self.redis.url, self.checkpoint, worker_args=self.worker_args)
        try:
            self.decoders = [self.cluster.worker("decode", f"d{i}") for i in range(self.nd)]
            prefillers = [self.cluster.worker("prefill", f"p{i}") for i in range(self.np)]
            for w in self.decoders + prefillers:
                # A cold compile cache is slow; under pytest's 900 s, a hung one says where.
                w.wait_ready(timeout=600)
            self.cluster.wait_registered([w.name for w in self.decoders + prefillers])
        except BaseException:
            self.__exit__()  # no Redis or worker outlives a failed start
            raise
        return self

    def routers(self, n: int, config: dict) -> list[str]:
        path = self.tmp / f"lb-{time.time_ns()}.yaml"
        path.write_text("".join(f"{k}: {v}\n" for k, v in config.items()))
        rs = [
            self.cluster.router(f"r{i}-{time.time_ns()}", "--config", str(path)) for i in range(n)
        ]
        addrs = [r.wait_ready() and r.address for r in rs]
        time.sleep(1.0)  # a few state refreshes: every router sees every worker
        return addrs

    def __exit__(self, *exc):
        self.cluster.stop()
        self.redis.kill()


def bench_policies(
    checkpoint: str,
    policies: list[str],
    wl: Workload,
    decode_workers: int = 2,
    prefill_workers: int = 0,
    worker_args=(),
    two_routers: bool = True,
    vocab: int | None = None,
    router_config: dict | None = None,
    log=print,
) -> list[dict]:
    """One row per (policy, routers): hit rate, TTFT, share of the busiest worker."""
    from megaserve.checkpoint import load_tokenizer

    vocab = vocab or load_tokenizer(checkpoint).vocab_size
    prompts = wl.prompts(vocab)
    runs = [(p, 1) for p in policies] + ([("kv_aware", 2)] if two_routers else [])
    rows = []
    for policy, n_routers in runs:
        with BenchStack(checkpoint, decode_workers, prefill_workers, worker_args, vocab) as st:
            for w in st.decoders:
                _warm(
                    w.address,
                    vocab,
                    [len(prompts[0][1])],
                    wl.max_tokens,
                    wl.user_tokens,
                    wl.concurrency,
                )
            before = [worker_stats(w.address).requests for w in st.decoders]
            cfg = {"decode_policy": policy, **(router_config or {})}
            if prefill_workers == 0:
                cfg["disagg_min_uncached_tokens"] = 1 << 30
            addrs = st.routers(n_routers, cfg)
            row = asyncio.run(
                drive(
                    addrs,
                    prompts,
                    wl,
                    f"{policy}{n_routers}",
                    sessions=policy == "session_affinity",
                )
            )
            share = [worker_stats(w.address).requests - b for w, b in zip(st.decoders, before)]
            row |= {
                "policy": policy,
                "routers": n_routers,
                "per_worker_requests": share,
                "max_over_fair": summary.max_over_fair(share, len(prompts)),
            }
            log(
                f"{policy:>16} x{n_routers}: hit {100 * row['hit_rate']:5.1f}%  "
                f"TTFT mean {row['ttft_mean_ms']:7.1f} ms p99 {row['ttft_p99_ms']:7.1f} ms  "
                f"share {share} (max {row['max_over_fair']:.2f}x fair)"
            )
            rows.append(row)
    return rows


def bench_throughput(
    checkpoint: str,
    n: int = 60,
    prompt_len: int = 64,
    max_tokens: int = 16,
    worker_args=(),
    concurrency: int = 32,
    log=print,
) -> dict:
    """Output tokens/s at `concurrency` through one and through two routers in front of the
    same decode worker (the router's added latency: router_overhead.py)."""
    from megaserve.checkpoint import load_tokenizer

    vocab = load_tokenizer(checkpoint).vocab_size
    rng = np.random.default_rng(7)
    prompts = [rng.integers(min(100, vocab // 4), vocab, prompt_len).tolist() for _ in range(n)]
    out = {}
    with BenchStack(checkpoint, 1, 0, worker_args, vocab) as st:
        d = st.decoders[0].address
        _warm(d, vocab, [prompt_len] * 3, max_tokens, concurrency=concurrency)
        addrs = st.routers(2, {"disagg_min_uncached_tokens": 1 << 30})
        wl = Workload(max_tokens=max_tokens, concurrency=concurrency)
        load = [(f"u{i}", p) for i, p in enumerate(prompts * 2)]
        one = asyncio.run(drive(addrs[:1], load, wl, "thr1"))
        two = asyncio.run(drive(addrs, load, wl, "thr2"))
        out["throughput_1_router_tok_s"] = one["output_tok_s"]
        out["throughput_2_routers_tok_s"] = two["output_tok_s"]
    log(
        f"throughput at concurrency {concurrency}: 1 router "
        f"{out['throughput_1_router_tok_s']:.0f} tok/s, 2 routers "
        f"{out['throughput_2_routers_tok_s']:.0f} tok/s"
    )
    return out
