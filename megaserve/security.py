"""TLS, mutual TLS between tiers, and the public API's bearer token.

One set of files per process: `--tls-cert`/`--tls-key` is the process's own certificate (its
server certificate, and its client certificate when it calls another tier); `--tls-ca` is the
CA that signs its peers. A server given `--tls-ca` requires clients to present a certificate
signed by it (mTLS); a client verifies the servers it dials against it (the system roots when
it is absent). Peers dial each other by the IP:port in Redis, so certificates need an IP SAN
for it — or `--tls-server-name NAME` checks every peer's certificate against NAME instead
(`grpc.ssl_target_name_override`; one shared DNS SAN for all pods in Kubernetes).
"""

from __future__ import annotations

import hmac
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

TOKEN_ENV = "MEGASERVE_API_TOKEN"
# Calls that never need the bearer token: load balancers and probes check health unauthenticated.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


class TLSConfigError(ValueError):
    """A TLS or token setting that cannot be used; the message names the flag and file."""


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise TLSConfigError(f"{flag} {path}: no such file") from None
    except OSError as e:
        raise TLSConfigError(f"{flag} {path}: cannot read ({e.strerror or e})") from None


def _check_certs(path: str, flag: str) -> None:
    """The file parses as one or more PEM certificates."""
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, ValueError) as e:
        raise TLSConfigError(f"{flag} {path}: not a PEM certificate ({e})") from None


def add_tls_arguments(p, server_role: str = "gRPC server") -> None:
    """--tls-cert, --tls-key, --tls-ca, --tls-server-name (every process takes them)."""
    p.add_argument(
        "--tls-cert",
        help=f"PEM certificate (chain) of this process: serves TLS on its {server_role} and is its "
        "client certificate towards other tiers",
    )
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-ca",
        help="PEM CA that signs the other tiers: workers require client certificates signed by "
        "it (mTLS); every process verifies the tiers it calls with it (default: system roots)",
    )
    p.add_argument(
        "--tls-server-name",
        help="check peers' certificates against this name instead of the dialed host "
        "(grpc.ssl_target_name_override; for pod IPs in Kubernetes)",
    )


@dataclass(frozen=True)
class TLSConfig:
    """One process's certificate, key and peer CA, loaded and checked."""

    cert: bytes
    key: bytes
    ca: bytes | None = None
    server_name: str | None = None

    @classmethod
    def load(
        cls,
        cert: str | None,
        key: str | None,
        ca: str | None = None,
        server_name: str | None = None,
    ) -> TLSConfig | None:
        """None when no file is given (plaintext); TLSConfigError naming a bad file."""
        if not (cert or key or ca or server_name):
            return None
        if bool(cert) != bool(key):
            have, missing = ("--tls-cert", "--tls-key") if cert else ("--tls-key", "--tls-cert")
            raise TLSConfigError(f"{have} {cert or key} given without {missing}")
        if not cert:
            flag = "--tls-ca" if ca else "--tls-server-name"
            raise TLSConfigError(f"{flag} needs --tls-cert and --tls-key")
        cert_pem, key_pem = _read(cert, "--tls-cert"), _read(key, "--tls-key")
        _check_certs(cert, "--tls-cert")
        ca_pem = read_ca(ca, "--tls-ca") if ca else None
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key)
        except ssl.SSLError as e:
            # OpenSSL's reason code, not its message text.
            mismatch = e.reason == "KEY_VALUES_MISMATCH"
            why = "does not match the certificate" if mismatch else "unusable"
            raise TLSConfigError(
                f"--tls-key {key}: {why} (--tls-cert {cert}; {e.reason or e})"
            ) from None
        return cls(cert_pem, key_pem, ca_pem, server_name or None)

    @classmethod
    def from_args(cls, a) -> TLSConfig | None:
        return cls.load(
            getattr(a, "tls_cert", None),
            getattr(a, "tls_key", None),
            getattr(a, "tls_ca", None),
            getattr(a, "tls_server_name", None),
        )

    def server_credentials(self, client_ca: bytes | None | bool = True) -> grpc.ServerCredentials:
        """TLS with this certificate. client_ca=True: require client certificates signed by
        --tls-ca when it is set (mTLS); None/False: no client certificates; bytes: require
        client certificates signed by that CA."""
        roots = self.ca if client_ca is True else (client_ca or None)
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=roots, require_client_auth=roots is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verifies the server against --tls-ca (or the system roots); presents this cert."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def read_ca(path: str, flag: str) -> bytes:
    """A CA bundle file's bytes, checked; TLSConfigError naming flag and file."""
    pem = _read(path, flag)
    _check_certs(path, flag)
    return pem


def add_port(server, address: str, tls: TLSConfig | None, client_ca: bytes | None | bool = True):
    """Binds address (TLS when tls is set); OSError when it cannot be bound."""
    port = (
        server.add_secure_port(address, tls.server_credentials(client_ca))
        if tls
        else server.add_insecure_port(address)
    )
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return port


def aio_channel(address: str, tls: TLSConfig | None, options=()) -> grpc.aio.Channel:
    """A grpc.aio channel to another tier: mTLS with this process's files, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )


def channel_factory(tls: TLSConfig | None, options=()):
    """address -> grpc.aio channel (for the router's Dispatcher)."""
    return lambda address: aio_channel(address, tls, options)


# --- the bearer token ---------------------------------------------------------------------


def load_token(path: str | None = None, env: dict | None = None) -> str | None:
    """The API token from --api-token-file (first line, stripped), else $MEGASERVE_API_TOKEN;
    None (no authentication) when neither is set or the value is empty."""
    if path:
        token = _read(path, "--api-token-file").decode("utf-8", "replace").strip()
        if not token:
            raise TLSConfigError(f"--api-token-file {path}: empty")
        return token
    token = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
    return token or None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` with UNAUTHENTICATED.

    Health checks (EXEMPT_PREFIXES) pass without it. The comparison is constant-time.
    """

    def __init__(self, token: str, exempt: tuple[str, ...] = EXEMPT_PREFIXES):
        if not token:
            raise ValueError("empty token")
        self._token = token.encode()
        self._exempt = exempt

    def allows(self, metadata) -> bool:
        value = next((v for k, v in metadata or () if k == "authorization"), "")
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, presented = value.partition(" ")
        ok = hmac.compare_digest(presented.strip().encode(), self._token)
        return ok and scheme.lower() == "bearer"

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._exempt):
            return handler
        if self.allows(details.invocation_metadata):
            return handler
        return _deny_like(handler)


def _deny_like(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def deny(request_or_iterator, context):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token (authorization)"
        )

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(deny, **kw)
