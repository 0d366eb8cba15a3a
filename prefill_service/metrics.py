"""Prometheus metrics of a prefill worker, one registry per worker."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server


class PrefillMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = {"model_name": model_name}
        self.bytes = Counter(
            "megaserve:kv_transfer_sent_bytes",
            "KV payload bytes sent.",
            labelnames=list(lab),
            registry=r,
        ).labels(**lab)
        self.failures = Counter(
            "megaserve:kv_transfer_failures",
            "Pushes the decode worker refused or that broke off.",
            labelnames=list(lab),
            registry=r,
        ).labels(**lab)
        self.compute = Histogram(
            "megaserve:prefill_compute_seconds",
            "Prefill compute.",
            labelnames=list(lab),
            registry=r,
        ).labels(**lab)
        self.transfer = Histogram(
            "megaserve:kv_transfer_seconds",
            "First chunk sent to commit.",
            labelnames=list(lab),
            registry=r,
        ).labels(**lab)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Starts the /metrics HTTP endpoint; returns the bound port."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_address[1]
