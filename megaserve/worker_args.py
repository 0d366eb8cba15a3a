"""Command-line arguments every worker process takes (decode and prefill)."""

from __future__ import annotations


def add_common_arguments(p, max_context: int) -> None:
    p.add_argument("--checkpoint", default="smollm2")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free port)")
    p.add_argument("--worker-id")
    p.add_argument("--redis-url", help="register and heartbeat here (redis://host:port/db)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics on this port")
    p.add_argument("--kv-budget-mb", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-context", type=int, default=max_context)
