"""The router process: tokenizers, Redis-backed cluster view, public gRPC server, SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import signal

import structlog

from megaserve.checkpoint import load_tokenizer
from megaserve.grpc_server import serve_until_signal
from megaserve.logs import announce
from megaserve.redis_conn import SENTINEL_FORM, redact, url_argument
from megaserve.security import (
    TOKEN_ENV,
    BearerTokenInterceptor,
    TLSConfig,
    TLSConfigError,
    add_tls_arguments,
    channel_factory,
    load_token,
    read_ca,
)
from router.config import RouterConfig
from router.server import create_server
from router.state import ClusterState
from router.workers import WORKER_CHANNEL_OPTIONS

log = structlog.get_logger("megaserve.router")


def add_arguments(p) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="public gRPC port (0 = any free)")
    p.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        type=url_argument,
        help=f"shared state: redis://host:port/db, or through Sentinel {SENTINEL_FORM} "
        "(follows failovers)",
    )
    p.add_argument("--config", help="load-balancing YAML (default: router/loadbalancer.yaml)")
    p.add_argument(
        "--checkpoint",
        action="append",
        help="a model to serve (its tokenizer is loaded here; workers run the weights); "
        "NAME=SPEC names it. Repeatable. Default: smollm2",
    )
    # TLS: --tls-cert/--tls-key serve the public endpoint over TLS and are the router's client
    # certificate towards the workers; --tls-ca verifies the workers (mTLS between tiers).
    add_tls_arguments(p, server_role="public gRPC endpoint")
    p.add_argument(
        "--public-client-ca",
        help="PEM CA: the public endpoint also requires client certificates signed by it "
        "(default: TLS without client certificates)",
    )
    p.add_argument(
        "--api-token-file",
        help=f"bearer token clients must send (authorization: Bearer ...); default: "
        f"${TOKEN_ENV} when set, else no token (health checks never need it)",
    )


def load_models(specs: list[str] | None) -> dict:
    out = {}
    for spec in specs or ["smollm2"]:
        name, _, path = spec.rpartition("=") if "=" in spec else (None, "", spec)
        info = load_tokenizer(path, name or None)
        out[info.name] = info
    return out


def security_from_args(a):
    """(tier TLS config, public server credentials, interceptors); TLSConfigError if bad."""
    tls = TLSConfig.from_args(a)
    if a.public_client_ca and tls is None:
        raise TLSConfigError("--public-client-ca needs --tls-cert and --tls-key")
    client_ca = read_ca(a.public_client_ca, "--public-client-ca") if a.public_client_ca else None
    creds = tls.server_credentials(client_ca) if tls else None
    token = load_token(a.api_token_file)
    if token and tls is None:
        log.warning("the API token travels in plaintext: serve TLS (--tls-cert/--tls-key)")
    return tls, creds, [BearerTokenInterceptor(token)] if token else []


async def serve(a) -> None:
    tls, creds, interceptors = security_from_args(a)
    cfg = RouterConfig.from_yaml(a.config) if a.config else RouterConfig()
    models = load_models(a.checkpoint)
    state = ClusterState(
        a.redis_url,
        cfg.state_refresh_ms / 1000,
        cfg.session_ttl_s,
        share_placements=cfg.share_placements,
    )
    server, port, health, servicer = await create_server(
        models,
        state,
        cfg,
        f"{a.host}:{a.port}",
        creds,
        interceptors,
        channel_factory(tls, WORKER_CHANNEL_OPTIONS) if tls else None,  # mTLS to the workers
    )
    # What startup made (tokenizers, imported modules: ~150k objects) is never garbage; a full
    # collection that scanned it took 42 ms, a stall for every request in flight.
    gc.collect()
    gc.freeze()
    # SIGUSR1: one log line of the CPU per request by component since the last such line.
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGUSR1, lambda: log.info("request costs", **servicer.costs.summary())
    )
    announce(f"READY router {servicer.router_id} grpc={a.host}:{port}")
    log.info(
        "serving",
        port=port,
        models=sorted(models),
        redis=redact(a.redis_url),
        tls=tls is not None,
        mtls_to_workers=bool(tls and tls.ca),
        token=bool(interceptors),
    )

    async def stop() -> None:
        await server.stop(5.0)
        await servicer.dispatcher.close()
        await state.stop()

    await serve_until_signal(health, stop)


def main(a) -> int:
    from megaserve.logs import configure

    configure(background=True)  # JSON rendering and writes off the request path
    try:
        asyncio.run(serve(a))
    except ValueError as e:  # a bad config file or checkpoint
        print(f"megaserve router: error: {e}", flush=True)
        return 2
    return 0
