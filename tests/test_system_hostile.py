"""System test with real processes, a real Redis and real gRPC: a corpus of hostile public-API
requests (malformed messages, out-of-range values, 1 ms deadlines, cancellation floods,
duplicate request ids) gets clear status codes and leaves every process serving."""

from __future__ import annotations

import random

import grpc
import pytest

from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from tests.system_stack import IDS, MODEL, generate, system_stack, wait_pools_idle


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with system_stack(tmp_path_factory.mktemp("system-hostile")) as s:
        yield s


def _raw(addr, method: str, payload: bytes, timeout=30.0):
    """Sends raw bytes as a request: malformed messages no generated client would send."""
    with grpc.insecure_channel(addr) as ch:
        if method == "Generate":
            call = ch.unary_stream("/megaserve.v1.Generation/Generate")
            return list(call(payload, timeout=timeout))
        return ch.unary_unary(f"/megaserve.v1.Generation/{method}")(payload, timeout=timeout)


OK_STOP = pb.StoppingParams(max_tokens=4)


def _req(**kw):
    kw.setdefault("model", MODEL)
    return pb.GenerateRequest(**kw)


INVALID = grpc.StatusCode.INVALID_ARGUMENT
CORPUS: list[tuple[str, object, grpc.StatusCode]] = [
    # (name, request: a GenerateRequest or raw bytes for Generate, the status code)
    ("no input", _req(), INVALID),
    ("empty prompt", _req(prompt=""), INVALID),
    ("unknown model", _req(model="nope", prompt="hi"), grpc.StatusCode.NOT_FOUND),
    ("model name with NUL", _req(model="tiny\x00chat", prompt="hi"), grpc.StatusCode.NOT_FOUND),
    ("empty chat", _req(chat=pb.Chat()), INVALID),
    ("bad role", _req(chat=pb.Chat(messages=[pb.ChatMessage(role="root", content="x")])), INVALID),
    ("empty role", _req(chat=pb.Chat(messages=[pb.ChatMessage(content="x")])), INVALID),
    ("empty id list", _req(prompt_token_ids=pb.TokenIds()), INVALID),
    ("id = vocab", _req(prompt_token_ids=pb.TokenIds(ids=[384])), INVALID),
    ("id = int32 max", _req(prompt_token_ids=pb.TokenIds(ids=[2**31 - 1])), INVALID),
    ("id = int32 min", _req(prompt_token_ids=pb.TokenIds(ids=[-(2**31)])), INVALID),
    ("100k ids", _req(prompt_token_ids=pb.TokenIds(ids=[5] * 100_000)), INVALID),
    ("1 MB prompt text", _req(prompt="word " * 200_000), INVALID),
    (
        "5 MB prompt (over the message limit)",
        _req(prompt="x" * 5_000_000),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),  # fmt: skip
    (
        "huge chat",
        _req(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="y " * 300_000)])),
        INVALID,
    ),  # fmt: skip
    (
        "max_tokens int32 max",
        _req(
            prompt_token_ids=pb.TokenIds(ids=IDS), stopping=pb.StoppingParams(max_tokens=2**31 - 1)
        ),
        INVALID,
    ),  # fmt: skip
    (
        "negative max_tokens",
        _req(prompt_token_ids=pb.TokenIds(ids=IDS), stopping=pb.StoppingParams(max_tokens=-5)),
        INVALID,
    ),  # fmt: skip
    (
        "temperature inf",
        _req(prompt="hi", sampling=pb.SamplingParams(temperature=float("inf"))),
        INVALID,
    ),  # fmt: skip
    ("temperature -1", _req(prompt="hi", sampling=pb.SamplingParams(temperature=-1)), INVALID),
    ("top_p nan", _req(prompt="hi", sampling=pb.SamplingParams(top_p=float("nan"))), INVALID),
    ("top_p 2", _req(prompt="hi", sampling=pb.SamplingParams(top_p=2)), INVALID),
    ("top_k -1", _req(prompt="hi", sampling=pb.SamplingParams(top_k=-1)), INVALID),
    ("min_p -0.1", _req(prompt="hi", sampling=pb.SamplingParams(min_p=-0.1)), INVALID),
    ("presence 5", _req(prompt="hi", sampling=pb.SamplingParams(presence_penalty=5)), INVALID),
    ("frequency -3", _req(prompt="hi", sampling=pb.SamplingParams(frequency_penalty=-3)), INVALID),
    (
        "repetition 11",
        _req(prompt="hi", sampling=pb.SamplingParams(repetition_penalty=11)),
        INVALID,
    ),
    ("seed 2**64-1", _req(prompt="hi", sampling=pb.SamplingParams(seed=2**64 - 1)), INVALID),
    ("17 stop strings", _req(prompt="hi", stopping=pb.StoppingParams(stop=["a"] * 17)), INVALID),
    ("empty stop string", _req(prompt="hi", stopping=pb.StoppingParams(stop=[""])), INVALID),
    (
        "1k-char stop string",
        _req(prompt="hi", stopping=pb.StoppingParams(stop=["z" * 1000])),
        INVALID,
    ),
    ("stop token -1", _req(prompt="hi", stopping=pb.StoppingParams(stop_token_ids=[-1])), INVALID),
    (
        "100 stop tokens",
        _req(prompt="hi", stopping=pb.StoppingParams(stop_token_ids=[1] * 100)),
        INVALID,
    ),  # fmt: skip
    ("request_id 10k chars", _req(request_id="r" * 10_000, prompt="hi"), INVALID),
    # Raw bytes: invalid UTF-8, wrong wire types, truncation, garbage.
    ("invalid UTF-8 in prompt", b"\x12\x03\xff\xfe\xfd", INVALID),  # field 3 = prompt
    ("invalid UTF-8 in stop string", b"\x1a\x02hi\x3a\x04\x12\x02\xc3\x28", INVALID),
    ("invalid UTF-8 in model", b"\x12\x02\xff\xff\x1a\x02hi", INVALID),
    (
        "invalid UTF-8 in chat content",
        b"\x2a\x0b\x0a\x09\x0a\x04user\x12\x01\x80",
        INVALID,
    ),  # fmt: skip
    ("wrong wire type for prompt", b"\x18\x05", INVALID),  # field 3 as varint
    ("truncated message", b"\x1a\x10hi", INVALID),
    ("random garbage", bytes(random.Random(1).getrandbits(8) for _ in range(64)), INVALID),
    ("length overflow", b"\x1a\xff\xff\xff\xff\x0f", INVALID),
]


def _status(addr, item) -> tuple[grpc.StatusCode, str]:
    try:
        if isinstance(item, bytes):
            _raw(addr, "Generate", item)
        else:
            with grpc.insecure_channel(
                addr, options=[("grpc.max_send_message_length", 16 << 20)]
            ) as ch:
                list(pbg.GenerationStub(ch).Generate(item, timeout=60))
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_hostile_corpus(stack):
    st, addr, _ = stack
    assert len(CORPUS) >= 40
    results = {}
    for name, item, _ in CORPUS:
        results[name] = _status(addr, item)
    wrong = {n: r for (n, _, w), r in zip(CORPUS, results.values()) if r[0] != w}
    assert not wrong, wrong
    # Messages name the value (spot checks), and nothing crashed.
    assert "2147483647" in results["id = int32 max"][1]
    assert "'nope'" in results["unknown model"][1]
    assert "UTF-8" in results["invalid UTF-8 in stop string"][1]
    # Deadlines of 1 ms, duplicates and cancellation floods.
    got = _status_deadline(addr, 0.001)
    assert got in (grpc.StatusCode.DEADLINE_EXCEEDED,)
    cancel_flood(addr, 40)
    duplicate_ids(addr)
    assert all(p.alive for p in st.procs.values()), {n: p.alive for n, p in st.procs.items()}
    wait_pools_idle(st)
    assert generate(addr, IDS, 8) == generate(addr, IDS, 8)  # still serving, deterministically


def _status_deadline(addr, timeout):
    with grpc.insecure_channel(addr) as ch:
        try:
            req = _req(
                prompt_token_ids=pb.TokenIds(ids=IDS * 20),
                stopping=pb.StoppingParams(max_tokens=64),
            )
            list(pbg.GenerationStub(ch).Generate(req, timeout=timeout))
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def cancel_flood(addr, n):
    """n streams cancelled at random points (before, at and after the first token)."""
    rng = random.Random(5)
    with grpc.insecure_channel(addr) as ch:
        stub = pbg.GenerationStub(ch)
        calls = []
        for i in range(n):
            ids = [(i * 7 + j) % 300 + 3 for j in range(30 + i)]
            req = _req(prompt_token_ids=pb.TokenIds(ids=ids),
                       stopping=pb.StoppingParams(max_tokens=200, ignore_eos=True))  # fmt: skip
            calls.append(stub.Generate(req, timeout=60))
        for c in calls:
            k = rng.choice([0, 1, 3])
            try:
                for _ in range(k):
                    next(c)
            except (StopIteration, grpc.RpcError):
                pass
            c.cancel()


def duplicate_ids(addr):
    with grpc.insecure_channel(addr) as ch:
        stub = pbg.GenerationStub(ch)
        req = _req(request_id="same", prompt_token_ids=pb.TokenIds(ids=IDS * 5),
                   stopping=pb.StoppingParams(max_tokens=100, ignore_eos=True))  # fmt: skip
        first = stub.Generate(req, timeout=60)
        next(first)
        codes = []
        for _ in range(5):
            try:
                list(stub.Generate(req, timeout=60))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        assert codes == [grpc.StatusCode.ALREADY_EXISTS] * 5
        assert len([t for r in first for t in r.token_ids]) == 99
