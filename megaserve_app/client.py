"""A public-API client: `megaserve generate --server`, `megaserve chat --server` (streams)."""

from __future__ import annotations

import sys
import uuid

import grpc

from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg


def channel(
    address: str,
    token: str | None = None,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    server_name: str | None = None,
) -> grpc.Channel:
    """Insecure, or TLS verified against `ca` when it is given (with `cert`/`key`: a client
    certificate, for a router run with --public-client-ca; `server_name`: check the server's
    certificate against this name instead of the dialed host). The bearer token is not bound
    to the channel: callers send it per call (stream_request)."""
    if ca is None:
        if cert or key or server_name:
            raise ValueError("a client certificate or server name needs the CA (--tls-ca)")
        return grpc.insecure_channel(address)
    from megaserve.security import TLSConfig, read_ca

    root = read_ca(ca, "--tls-ca")
    if cert or key:
        tls = TLSConfig.load(cert, key, ca, server_name)
        creds, opts = tls.channel_credentials(), tls.channel_options()
    else:
        creds = grpc.ssl_channel_credentials(root)
        opts = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, creds, options=opts)


def stream_request(address: str, req: pb.GenerateRequest, token=None, ca=None, timeout=600):
    """Yields GenerateResponse messages."""
    md = [("authorization", f"Bearer {token}")] if token else None
    with channel(address, token, ca) as ch:
        yield from pbg.GenerationStub(ch).Generate(req, timeout=timeout, metadata=md)


def stream_chat(address, messages, max_tokens=256, session_id="", token=None, ca=None, **sampling):
    req = pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in messages]),
        sampling=pb.SamplingParams(**sampling),
        stopping=pb.StoppingParams(max_tokens=max_tokens),
        session_id=session_id,
    )
    for r in stream_request(address, req, token, ca):
        yield r.text


def generate_remote(a) -> int:
    """`megaserve generate --server ADDR`: the same inputs as in-process generation."""
    sampling = pb.SamplingParams(
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, seed=a.seed
    )
    kw = {}
    if a.prompt_ids is not None:
        kw["prompt_token_ids"] = pb.TokenIds(ids=a.prompt_ids)
    elif a.chat is not None:
        kw["chat"] = pb.Chat(messages=[pb.ChatMessage(role="user", content=a.chat)])
    else:
        kw["prompt"] = a.prompt
    req = pb.GenerateRequest(
        model=a.model or "",
        sampling=sampling,
        stopping=pb.StoppingParams(
            max_tokens=a.max_new_tokens, ignore_eos=a.ignore_eos, stop=a.stop or []
        ),
        **kw,
    )
    ids, text = [], []
    try:
        for r in stream_request(a.server, req, a.token, a.tls_ca):
            ids += r.token_ids
            text.append(r.text)
            if not a.json:
                print(r.text, end="", flush=True)
    except grpc.RpcError as e:
        print(f"megaserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    except ValueError as e:  # an unusable --tls-ca file (TLSConfigError names it)
        print(f"megaserve: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        import json

        print(json.dumps({"token_ids": ids, "text": "".join(text)}, ensure_ascii=False))
    else:
        print()
    return 0


def chat(a) -> int:
    """An interactive chat: history kept client-side, a session id so turns reuse the KV."""
    if a.tls_ca:
        from megaserve.security import TLSConfigError, read_ca

        try:
            read_ca(a.tls_ca, "--tls-ca")
        except TLSConfigError as e:
            print(f"megaserve: error: {e}", file=sys.stderr)
            return 2
    session = f"chat-{uuid.uuid4().hex[:12]}"
    messages = [{"role": "system", "content": a.system}] if a.system else []
    print(f"chatting with {a.server} (Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for t in stream_chat(
                a.server, messages, a.max_new_tokens, session, a.token, a.tls_ca,
                temperature=a.temperature,
            ):  # fmt: skip
                reply.append(t)
                print(t, end="", flush=True)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
