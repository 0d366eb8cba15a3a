"""TLS on the public endpoint, mTLS between tiers and the bearer token, on real processes:
router -> prefill -> decode all over (m)TLS, certificates made here with the openssl CLI."""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from megaserve.checkpoint import load_tokenizer
from megaserve.model import LoadedModel
from megaserve.offline import OfflineGenerator
from megaserve.rpc import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from megaserve.sampling_params import SamplingParams
from megaserve.security import (
    BearerTokenInterceptor,
    TLSConfig,
    TLSConfigError,
    add_port,
    aio_channel,
    load_token,
)
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from tests.redis_server import RedisServer
from tests.stack import Stack, make_chat_checkpoint, tokens_equal_report

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

MODEL = "tiny-chat"
TOKEN = "s3cret-token-for-tests"
PROMPT = "Serving systems batch requests continuously over a paged KV cache. " * 3
SAN = "IP:127.0.0.1,DNS:localhost"


# --- a throwaway PKI ----------------------------------------------------------------------


def _openssl(d: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)


def make_ca(d: Path, name: str) -> Path:
    _openssl(
        d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return d / f"{name}.crt"


def make_cert(d: Path, ca: str, name: str, san: str = SAN) -> tuple[Path, Path]:
    """A leaf certificate for server and client use, signed by CA `ca`."""
    (d / f"{name}.ext").write_text(
        f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n"
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    )
    _openssl(
        d, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
    )  # fmt: skip
    _openssl(
        d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-set_serial", str(random.getrandbits(63)), "-days", "2", "-out", f"{name}.crt",
        "-extfile", f"{name}.ext",
    )  # fmt: skip
    return d / f"{name}.crt", d / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_cert(d, "ca", "node")  # every process's own certificate
    make_ca(d, "rogue")
    make_cert(d, "rogue", "intruder")  # a well-formed certificate from the wrong CA
    make_cert(d, "ca", "named", san="DNS:megaserve.internal")  # no IP SAN
    return d


def tls_args(d: Path) -> tuple[str, ...]:
    return ("--tls-cert", str(d / "node.crt"), "--tls-key", str(d / "node.key"),
            "--tls-ca", str(d / "ca.crt"))  # fmt: skip


def _read(p: Path) -> bytes:
    return p.read_bytes()


def public_channel(addr: str, pki: Path, ca: str = "ca.crt") -> grpc.Channel:
    return grpc.secure_channel(addr, grpc.ssl_channel_credentials(_read(pki / ca)))


def worker_channel(addr: str, pki: Path, client: str | None, ca: str = "ca.crt") -> grpc.Channel:
    """TLS verifying the worker with `ca`; `client` (node/intruder) is the client cert."""
    key = cert = None
    if client:
        key, cert = _read(pki / f"{client}.key"), _read(pki / f"{client}.crt")
    return grpc.secure_channel(addr, grpc.ssl_channel_credentials(_read(pki / ca), key, cert))


def auth(token: str = TOKEN, scheme: str = "Bearer"):
    return [("authorization", f"{scheme} {token}")]


# --- the stack: everything over TLS, the router with a token --------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory, pki):
    tmp = tmp_path_factory.mktemp("tls")
    ck = make_chat_checkpoint(tmp / "ck")
    rs = RedisServer(tmp).start()
    (tmp / "lb.yaml").write_text("disagg_min_uncached_tokens: 16\n")  # prompts take prefill
    (tmp / "token").write_text(TOKEN + "\n")
    st = Stack(rs.url, ck)
    try:
        procs = [
            st.worker("decode", "d1", *tls_args(pki)),
            st.worker("prefill", "p1", *tls_args(pki)),
            st.router(
                "r1", "--config", str(tmp / "lb.yaml"), "--api-token-file", str(tmp / "token"),
                *tls_args(pki),
            ),
        ]  # fmt: skip
        for p in procs:
            p.wait_ready()
        st.wait_registered(["d1", "p1"])
        d1, p1, router = (p.address for p in procs)
        with public_channel(router, pki) as ch:
            stub = pbg.GenerationStub(ch)
            for _ in range(100):  # the router's view refreshes every 200 ms
                m = stub.ListModels(pb.ListModelsRequest(), metadata=auth(), timeout=10).models
                if m and m[0].decode_workers == 1 and m[0].prefill_workers == 1:
                    break
                time.sleep(0.1)
        yield {"router": router, "decode": d1, "prefill": p1, "ck": ck}
    finally:
        st.stop()
        rs.kill()


def _generate(ch: grpc.Channel, metadata=None, **kw):
    out = list(
        pbg.GenerationStub(ch).Generate(
            pb.GenerateRequest(model=MODEL, **kw), metadata=metadata, timeout=120
        )
    )
    return [t for o in out for t in o.token_ids]


def test_tls_stack_serves_with_token_and_tokens_equal_plain_run(stack, pki):
    sp = SamplingParams(temperature=0.9, top_k=40, seed=5)
    with public_channel(stack["router"], pki) as ch:
        ids = _generate(
            ch,
            auth(),
            prompt=PROMPT,
            sampling=pb.SamplingParams(temperature=sp.temperature, top_k=sp.top_k, seed=sp.seed),
            stopping=pb.StoppingParams(max_tokens=16, ignore_eos=True),
        )
    ck = str(stack["ck"])
    prompt = load_tokenizer(ck).tokenizer.encode(PROMPT)
    gen = OfflineGenerator(LoadedModel.load(ck, progress=False), page_size=16, max_context=512)
    want = gen.generate(prompt, 16, sp, ignore_eos=True).token_ids
    assert ids == want, tokens_equal_report(ids, want)
    # The prompt went router -> prefill -> (KV push over mTLS) -> decode.
    with worker_channel(stack["decode"], pki, "node") as ch:
        stats = decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.StatsRequest(), timeout=10)
    assert stats.imported_requests >= 1


def test_token_required_but_not_for_health(stack, pki):
    with public_channel(stack["router"], pki) as ch:
        stub = pbg.GenerationStub(ch)
        for md in (None, auth("wrong-token"), auth(TOKEN + "x"), auth(TOKEN, "Basic")):
            with pytest.raises(grpc.RpcError) as e:
                stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
            with pytest.raises(grpc.RpcError) as e:  # a server-streaming call
                _generate(ch, md, prompt="hello", stopping=pb.StoppingParams(max_tokens=2))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
        assert stub.ListModels(pb.ListModelsRequest(), metadata=auth(), timeout=10).models
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert h.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_and_untrusted_clients_fail_on_public_endpoint(stack, pki):
    req = health_pb2.HealthCheckRequest()
    with grpc.insecure_channel(stack["router"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(req, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # A client that does not trust the router's CA refuses it.
    with public_channel(stack["router"], pki, ca="rogue.crt") as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(req, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # The public endpoint asks no client certificate (no --public-client-ca).
    with public_channel(stack["router"], pki) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status == 1


@pytest.mark.parametrize("client", ["plaintext", "no-cert", "other-ca"])
def test_workers_refuse_clients_without_a_valid_certificate(stack, pki, client):
    def chan(addr):
        if client == "plaintext":
            return grpc.insecure_channel(addr)
        return worker_channel(addr, pki, None if client == "no-cert" else "intruder")

    with chan(stack["decode"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.StatsRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        push = kv_transfer_pb2_grpc.KVTransferStub(ch).Push
        with pytest.raises(grpc.RpcError) as e:
            push(iter([kv_transfer_pb2.KVPush()]), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with chan(stack["prefill"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


# --- configuration errors -------------------------------------------------------------------


def test_bad_files_give_errors_naming_them(pki, tmp_path):
    cert, key, ca = (str(pki / n) for n in ("node.crt", "node.key", "ca.crt"))
    missing = str(tmp_path / "nope.crt")
    with pytest.raises(TLSConfigError, match=f"--tls-cert {missing}: no such file"):
        TLSConfig.load(missing, key, ca)
    with pytest.raises(TLSConfigError, match=f"--tls-ca {missing}: no such file"):
        TLSConfig.load(cert, key, missing)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TLSConfigError, match=f"--tls-cert {garbage}: not a PEM certificate"):
        TLSConfig.load(str(garbage), key, ca)
    with pytest.raises(TLSConfigError, match=f"--tls-ca {garbage}: not a PEM certificate"):
        TLSConfig.load(cert, key, str(garbage))
    with pytest.raises(TLSConfigError, match=f"--tls-key {pki / 'intruder.key'}: does not match"):
        TLSConfig.load(cert, str(pki / "intruder.key"), ca)
    with pytest.raises(TLSConfigError, match="--tls-cert .* given without --tls-key"):
        TLSConfig.load(cert, None, ca)
    with pytest.raises(TLSConfigError, match="--tls-ca needs --tls-cert and --tls-key"):
        TLSConfig.load(None, None, ca)
    assert TLSConfig.load(None, None) is None
    with pytest.raises(TLSConfigError, match=f"--api-token-file {missing}: no such file"):
        load_token(missing)
    assert load_token(None, {"MEGASERVE_API_TOKEN": " t0k \n"}) == "t0k"
    assert load_token(None, {}) is None
    # The worker process exits with status 2 and the message before loading a model.
    r = subprocess.run(
        [sys.executable, "-m", "megaserve_app.cli", "decode-worker", "--tls-cert", missing,
         "--tls-key", key, "--tls-ca", ca],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert f"--tls-cert {missing}: no such file" in r.stderr


def test_server_name_override_and_token_interceptor_in_process(pki):
    """A certificate without the dialed IP passes with --tls-server-name; the interceptor
    guards a stream-stream method too."""

    async def main():
        server = grpc.aio.server(interceptors=[BearerTokenInterceptor(TOKEN)])
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)

        class KV(kv_transfer_pb2_grpc.KVTransferServicer):
            async def Push(self, request_iterator, context):  # noqa: N802
                async for _ in request_iterator:
                    pass
                return kv_transfer_pb2.KVPushResponse()

        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(KV(), server)
        named = TLSConfig.load(str(pki / "named.crt"), str(pki / "named.key"), str(pki / "ca.crt"))
        port = add_port(server, "127.0.0.1:0", named)
        await server.start()
        addr = f"127.0.0.1:{port}"
        node = TLSConfig.load(*(str(pki / n) for n in ("node.crt", "node.key", "ca.crt")))
        req = health_pb2.HealthCheckRequest()
        try:
            async with aio_channel(addr, node) as ch:  # checks the cert against 127.0.0.1
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await health_pb2_grpc.HealthStub(ch).Check(req, timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            override = TLSConfig(node.cert, node.key, node.ca, "megaserve.internal")
            async with aio_channel(addr, override) as ch:
                assert (await health_pb2_grpc.HealthStub(ch).Check(req, timeout=5)).status == 1
                push = kv_transfer_pb2_grpc.KVTransferStub(ch).Push
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await push(iter([kv_transfer_pb2.KVPush()]), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                await push(iter([kv_transfer_pb2.KVPush()]), metadata=auth(), timeout=5)
        finally:
            await server.stop(None)

    asyncio.run(main())
