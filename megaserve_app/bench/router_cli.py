"""`megaserve bench router`'s arguments and command: placement policies on a shared-prefix
workload (router.py), then the router's overhead (router_overhead.py) and throughput;
`--overhead-only` runs the overhead alone."""

from __future__ import annotations

import json
from pathlib import Path

from megaserve.worker_args import positive_int
from megaserve_app.bench.view_refresh import add_view_refresh


def add_router(bsub) -> None:
    add_view_refresh(bsub)
    rt = bsub.add_parser(
        "router", help="policies on a shared-prefix workload; router overhead and throughput"
    )
    rt.add_argument("--checkpoint", default="smollm2")
    rt.add_argument(
        "--policies", default="round_robin,least_loaded,power_of_two,kv_aware,session_affinity"
    )
    rt.add_argument("--decode-workers", type=int, default=2)
    rt.add_argument("--prefill-workers", type=int, default=0)
    rt.add_argument("--systems", type=int, default=8, help="distinct long system prompts")
    rt.add_argument("--users", type=int, default=8, help="users per system prompt")
    rt.add_argument("--system-tokens", type=int, default=192)
    rt.add_argument("--user-tokens", type=int, default=24)
    rt.add_argument("--max-tokens", type=int, default=8)
    rt.add_argument("--concurrency", type=int, default=8)
    rt.add_argument(
        "--kv-budget-mb",
        type=int,
        default=256,
        help="each decode worker's KV pool: the default holds the workload's working set "
        "(SmolLM2 f32: 8 system prefixes + 8 running requests ~ 150 MB), so the hit rate "
        "measures placement rather than eviction",
    )
    rt.add_argument("--skip-overhead", action="store_true", help="no overhead or throughput")
    rt.add_argument(
        "--overhead-only",
        action="store_true",
        help="only the router's added TTFT (paired with direct calls) and its CPU per request",
    )
    rt.add_argument(
        "--pairs", type=positive_int, default=200, help="overhead: direct/router request pairs"
    )
    rt.add_argument(
        "--instant-worker",
        action="store_true",
        help="overhead: a stand-in decode worker that answers at once (the router's own cost, "
        "no model competing for the CPU)",
    )
    rt.add_argument(
        "--router-ids",
        action="store_true",
        help="overhead: send no request_id; the router makes one (no Redis claim)",
    )
    rt.add_argument(
        "--per-request-calls",
        action="store_true",
        help="the routers' config says worker_streams: false (a Generate call per request to "
        "the worker, not one GenerateStream per worker)",
    )
    rt.add_argument(
        "--one-router", action="store_true", help="policies: no kv_aware run with two routers"
    )
    rt.add_argument("--json-out")
    rt.set_defaults(func=cmd_bench_router)


def _overhead(a, worker_args) -> dict:
    from megaserve_app.bench.router_overhead import bench_router_overhead

    return bench_router_overhead(
        a.checkpoint,
        a.pairs,
        worker_args=worker_args,
        instant_worker=a.instant_worker,
        client_ids=not a.router_ids,
        worker_streams=not a.per_request_calls,
    )


def cmd_bench_router(a) -> int:
    from megaserve_app.bench.router import Workload, bench_policies, bench_throughput

    worker_args = ("--kv-budget-mb", str(a.kv_budget_mb))
    out = {}
    if not a.overhead_only:
        wl = Workload(
            a.systems, a.users, a.system_tokens, a.user_tokens, a.max_tokens, a.concurrency
        )
        print(
            f"shared-prefix workload: {a.systems} system prompts x {a.users} users, "
            f"{a.system_tokens}+{a.user_tokens} prompt tokens, {a.max_tokens} new tokens, "
            f"concurrency {a.concurrency}, {a.decode_workers} decode workers"
        )
        out["policies"] = bench_policies(
            a.checkpoint,
            a.policies.split(","),
            wl,
            a.decode_workers,
            a.prefill_workers,
            worker_args,
            two_routers=not a.one_router,
            router_config={"worker_streams": "false"} if a.per_request_calls else None,
        )
    if a.overhead_only or not a.skip_overhead:
        out["overhead"] = _overhead(a, worker_args)
    if not (a.overhead_only or a.skip_overhead):
        out["throughput"] = bench_throughput(a.checkpoint, worker_args=worker_args)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=2))
    return 0
