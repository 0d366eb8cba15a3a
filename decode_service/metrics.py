"""Prometheus metrics of a decode worker, named as vLLM users already scrape them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WorkerMetrics:
    """One registry per worker (several engines may live in one test process)."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name, doc, fn):
            g = Gauge(name, doc, labelnames=list(labels), registry=r)
            g.labels(**labels).set_function(fn)

        gauge(
            "megaserve:num_requests_running",
            "Sequences in the decode batch or prefilling.",
            lambda: engine.stats()["running"],
        )
        gauge(
            "megaserve:num_requests_waiting",
            "Requests queued for admission.",
            lambda: engine.stats()["waiting"],
        )
        gauge(
            "megaserve:kv_cache_usage_perc",
            "Fraction of KV pages referenced (0-1).",
            lambda: engine.alloc.num_used / max(engine.alloc.num_pages - 1, 1),
        )
        gauge(
            "megaserve:num_preemptions_total",
            "Sequences preempted (freed and recomputed).",
            lambda: engine.sched.preemptions,
        )
        gauge(
            "megaserve:num_step_failures_total",
            "Prefill or decode steps that raised (their requests ended INTERNAL).",
            lambda: engine.step_failures,
        )
        self.ttft = Histogram(
            "megaserve:time_to_first_token_seconds",
            "Request arrival to first token.",
            labelnames=list(labels),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.itl = Histogram(
            "megaserve:inter_token_latency_seconds",
            "Time between consecutive output tokens of a request.",
            labelnames=list(labels),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self.prompt_tokens = Counter(
            "megaserve:prompt_tokens",
            "Prompt tokens admitted.",
            labelnames=list(labels),
            registry=r,
        ).labels(**labels)
        self.generation_tokens = Counter(
            "megaserve:generation_tokens", "Tokens generated.", labelnames=list(labels), registry=r
        ).labels(**labels)
        self.requests = Counter(
            "megaserve:request_success",
            "Finished requests by reason.",
            labelnames=[*labels, "finished_reason"],
            registry=r,
        )
        self.kv_bytes = Counter(
            "megaserve:kv_transfer_bytes",
            "KV payload bytes received.",
            labelnames=list(labels),
            registry=r,
        ).labels(**labels)
        self.kv_failures = Counter(
            "megaserve:kv_transfer_failures",
            "KV pushes refused or broken off.",
            labelnames=list(labels),
            registry=r,
        ).labels(**labels)
        self.kv_seconds = Histogram(
            "megaserve:kv_transfer_seconds",
            "First KV message to commit, per request.",
            labelnames=list(labels),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(**labels)
        self._labels = labels

    def finished(self, reason: str) -> None:
        self.requests.labels(**self._labels, finished_reason=reason).inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Starts the /metrics HTTP endpoint; returns the bound port."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_address[1]
