"""Command-line arguments every worker process takes (decode and prefill)."""

from __future__ import annotations

import contextlib
from pathlib import Path


def add_common_arguments(p, max_context: int) -> None:
    p.add_argument("--checkpoint", default="smollm2")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free port)")
    p.add_argument("--worker-id")
    from megaserve.redis_conn import SENTINEL_FORM, url_argument

    p.add_argument(
        "--redis-url",
        type=url_argument,
        help=f"register and heartbeat here: redis://host:port/db, or through Sentinel "
        f"{SENTINEL_FORM} (follows failovers)",
    )
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics on this port")
    p.add_argument(
        "--kv-budget-mb",
        type=positive_int,
        default=None,
        help="KV pool size; default: what the device has left after weights, a 5%% margin "
        "and the program-temp allowance (on CPU: 256)",
    )
    p.add_argument(
        "--heartbeat-s", type=float, default=0.5, help="how often load and blocks go to Redis"
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-context", type=int, default=max_context)
    add_dtype_argument(p)
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel devices for the model and KV pool (Llama family and Qwen3-MoE, "
        "XLA step; with --backend pallas, the tp megakernel for Llama-family decode); on CPU "
        "forces --tp x --ep host devices. KV hand-off works across different --tp and --ep",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel devices (Qwen3-MoE): the experts split over ep, each ep shard a "
        "--tp split of the rest, the KV pool included (so held ep times); must divide "
        "num_experts",
    )
    p.add_argument(
        "--warm-up",
        choices=("all", "none"),
        default="all",
        help="all: compile (or load from the persistent compilation cache) every program the "
        "worker can run before it reports SERVING; none: compile each shape on first use",
    )
    p.add_argument(
        "--served-model-name", help="the name routers know this model by (default: see model_name)"
    )
    p.add_argument(
        "--advertise-host",
        help="host other processes reach this worker at (default: --host, or the hostname "
        "when binding 0.0.0.0; in Kubernetes the pod IP)",
    )
    p.add_argument(
        "--cpu-nice",
        type=nice_increment,
        default=0,
        help="lower this worker's CPU priority by N (0-19, as nice(1); its session's "
        "autogroup too when it leads one) where it shares cores with other workers, e.g. a "
        "decode worker beside a prefill worker on one CPU host: prefills get the cores "
        "first and decode steps wait (measured trade-off: docs/benchmarks.md, bench serve)",
    )
    p.add_argument(
        "--cpu-turns",
        type=turns_path,
        metavar="PATH",
        help="a lock file shared with the other workers on this host's cores: each decode "
        "iteration or prefill call takes a turn, handed over in turn, instead of computing "
        "beside the others (shorter first tokens, longer gaps between tokens; "
        "megaserve/cpu_turns.py; docs/benchmarks.md, bench serve --cpu-turns)",
    )
    from megaserve.watchdog import StallConfig

    p.add_argument(
        "--stall-s",
        type=grace_seconds,
        default=StallConfig.stall_s,
        help="an engine step (a decode iteration, a prefill call) running this long takes "
        "the worker out of service until it ends: its Redis record is withdrawn, so routers "
        "move its requests, and its gRPC health says NOT_SERVING (0: never)",
    )
    p.add_argument(
        "--stall-exit-s",
        type=grace_seconds,
        default=StallConfig.exit_s,
        help="an engine step running this long ends the process with status 1, for its "
        "supervisor to restart (0: never; otherwise at least --stall-s)",
    )
    from megaserve.security import add_tls_arguments

    add_tls_arguments(p)


def stall_from_args(a):
    """--stall-s / --stall-exit-s as a StallConfig (StallConfigError names a bad pair)."""
    from megaserve.watchdog import StallConfig

    return StallConfig(a.stall_s, a.stall_exit_s)


def positive_int(text: str) -> int:
    import argparse

    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


def grace_seconds(text: str) -> float:
    """--shutdown-grace S: seconds calls in flight get after SIGTERM (0 or more)."""
    import argparse
    import math

    try:
        s = float(text)
    except ValueError:
        s = -1.0
    if not (s >= 0 and math.isfinite(s)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return s


def turns_path(text: str) -> str:
    """--cpu-turns PATH: its directory must exist (the lock files are made in it)."""
    import argparse

    parent = Path(text).parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(parent)!r} does not exist")
    return text


def nice_increment(text: str) -> int:
    import argparse

    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 19:
        raise argparse.ArgumentTypeError(f"{text!r} is not a nice increment from 0 to 19")
    return n


def apply_cpu_nice(increment: int) -> None:
    """Raises this process's CPU nice value by `increment`: every thread's (threads started
    later inherit it) and, when the process leads its own session, its autogroup's.

    Why both: on Linux a nice value belongs to a thread, and imports may have started some
    already; and with autogroup scheduling (kernel.sched_autogroup_enabled, the default on
    desktop and many server kernels) CPU time is first shared between sessions, each the
    weight of its autogroup's nice, so a thread's nice only ranks it inside its own session.
    Workers that `megaserve serve` and the benches start each lead a session."""
    import os
    import threading

    if not increment:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process-wide call is all there is
        tids = []
    me = threading.get_native_id()
    for tid in (t for t in tids if t != me):
        with contextlib.suppress(ProcessLookupError):  # a thread that has ended since
            now = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, now + increment))
    os.nice(increment)
    if os.getsid(0) == os.getpid():
        with contextlib.suppress(OSError, ValueError):  # no autogroup support: nothing to do
            now = int(Path("/proc/self/autogroup").read_text().split()[-1])
            Path("/proc/self/autogroup").write_text(str(min(19, now + increment)))


def add_dtype_argument(p) -> None:
    from megaserve.choices import DTYPE_CHOICES

    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="weights and KV pool dtype (auto: bf16 on TPU, f32 elsewhere)",
    )


def add_backend_argument(p) -> None:
    from megaserve.choices import BACKEND_CHOICES

    p.add_argument(
        "--backend",
        choices=BACKEND_CHOICES,
        default="auto",
        help="decode step: pallas (the megakernel), xla, or auto (the megakernel on TPU when "
        "it supports the model, else xla; one log line says which and why)",
    )


def advertised_address(a, port: int) -> str:
    """host:port written to Redis for routers and peers to dial."""
    import socket

    host = a.advertise_host or (socket.gethostname() if a.host in ("0.0.0.0", "::") else a.host)
    return f"{host}:{port}"


def served_model_name(a) -> str:
    from megaserve.checkpoint import model_name

    return a.served_model_name or model_name(a.checkpoint)


def parallel_from_args(a, group=None):
    """--tp and --ep as a ParallelConfig, checked against the checkpoint's config (MeshError
    naming the numbers, before any weights load), this process's host devices forced to
    match on CPU: call before anything starts JAX's backend. With a multi-host `group`
    (megaserve.parallel.distributed.GroupConfig) the mesh of tp x ep devices spans every
    process's devices: this process forces its share, then joins the group."""
    from megaserve.parallel.distributed import join
    from megaserve.parallel.mesh import ParallelConfig, ensure_host_devices

    parallel = ParallelConfig(tp=a.tp, ep=a.ep)
    if parallel.devices > 1:
        check_checkpoint_fits(a.checkpoint, parallel)
    if group is None or not group.multi:
        ensure_host_devices(parallel.devices)
        return parallel
    ensure_host_devices(group.local_devices(parallel.devices))
    join(group)
    return parallel


def check_checkpoint_fits(spec: str, parallel) -> None:
    """MeshError naming the numbers when `parallel` cannot split the model of `spec` (ep on
    a model without experts, an ep not dividing num_experts, a tp not dividing the heads),
    from its config alone. A config that cannot be read is left to the loader to report."""
    from kernels.registry import family_for
    from megaserve.checkpoint import load_config
    from megaserve.errors import CheckpointError

    try:
        config = load_config(spec)
        _, config_cls = family_for(config.get("model_type"))
        cfg = config_cls.from_hf(config)
    except (CheckpointError, ValueError, KeyError):
        return
    parallel.check_model(cfg)
