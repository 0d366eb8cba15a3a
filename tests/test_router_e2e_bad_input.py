"""Router end to end, bad input: every invalid request gets a clear status that names the
value, a flood of them leaves a good request's tokens alone, expired deadlines, and a duplicate
in-flight request id is refused while the first request runs to completion."""

from __future__ import annotations

import grpc
import pytest

from megaserve.sampling_params import SamplingParams
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from tests.router_stack import (
    IDS,
    MODEL,
    generate,
    offline_reference,
    pools_idle,
    router_stack,
    status_of,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with router_stack(tmp_path_factory.mktemp("router-bad-input")) as s:
        yield s


@pytest.fixture(scope="module")
def reference(stack):
    return offline_reference(stack[2])


BAD = {
    "no input": ({"model": MODEL}, grpc.StatusCode.INVALID_ARGUMENT, "no input"),
    "empty prompt": ({"model": MODEL, "prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "unknown model": ({"model": "gpt-9", **IDS}, grpc.StatusCode.NOT_FOUND, "'gpt-9'"),
    "empty chat": ({"model": MODEL, "chat": pb.Chat()}, grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "invalid role": (
        {"model": MODEL, "chat": pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")])},
        grpc.StatusCode.INVALID_ARGUMENT,
        "'wizard'",
    ),
    "ids out of range": (
        {"model": MODEL, "prompt_token_ids": pb.TokenIds(ids=[1, 99999])},
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_token_ids[1]=99999",
    ),
    "negative id": (
        {"model": MODEL, "prompt_token_ids": pb.TokenIds(ids=[-3])},
        grpc.StatusCode.INVALID_ARGUMENT,
        "=-3",
    ),
    "prompt over context": (
        {"model": MODEL, "prompt_token_ids": pb.TokenIds(ids=[5] * 600)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "600 tokens",
    ),
    "prompt + max_tokens over context": (
        {"model": MODEL, **IDS, "stopping": pb.StoppingParams(max_tokens=10_000)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "10000",
    ),
    "negative logprobs.top_n": (
        {"model": MODEL, **IDS, "logprobs": pb.LogprobsParams(enabled=True, top_n=-1)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "logprobs.top_n=-1",
    ),
    "logprobs.top_n above the limit": (
        {"model": MODEL, **IDS, "logprobs": pb.LogprobsParams(top_n=21)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "logprobs.top_n=21 must be in [0, 20]",
    ),
    "negative logprobs.prompt_top_n": (
        {"model": MODEL, **IDS, "logprobs": pb.LogprobsParams(prompt=True, prompt_top_n=-2)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "logprobs.prompt_top_n=-2",
    ),
    "logprobs.prompt_top_n above the limit": (
        {"model": MODEL, **IDS, "logprobs": pb.LogprobsParams(prompt_top_n=21)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "logprobs.prompt_top_n=21 must be in [0, 20]",
    ),
    "prompt logprobs of a one-token prompt": (
        {
            "model": MODEL,
            "prompt_token_ids": pb.TokenIds(ids=[5]),
            "logprobs": pb.LogprobsParams(prompt=True),
        },
        grpc.StatusCode.INVALID_ARGUMENT,
        "the prompt has 1 token",
    ),
    "negative max_tokens": (
        {"model": MODEL, **IDS, "stopping": pb.StoppingParams(max_tokens=-1)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens=-1",
    ),
    "negative temperature": (
        {"model": MODEL, **IDS, "sampling": pb.SamplingParams(temperature=-0.5)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature=-0.5",
    ),
    "nan temperature": (
        {"model": MODEL, **IDS, "sampling": pb.SamplingParams(temperature=float("nan"))},
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature=nan",
    ),
    "top_p > 1": (
        {"model": MODEL, **IDS, "sampling": pb.SamplingParams(top_p=1.5)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_p=1.5",
    ),
    "negative top_k": (
        {"model": MODEL, **IDS, "sampling": pb.SamplingParams(top_k=-2)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_k=-2",
    ),
    "min_p > 1": (
        {"model": MODEL, **IDS, "sampling": pb.SamplingParams(min_p=2.0)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "min_p=2.0",
    ),
    "repetition penalty": (
        {"model": MODEL, **IDS, "sampling": pb.SamplingParams(repetition_penalty=-1)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "repetition_penalty=-1",
    ),
    "seed too large": (
        {"model": MODEL, **IDS, "sampling": pb.SamplingParams(seed=2**40)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "seed=",
    ),
    "empty stop string": (
        {"model": MODEL, **IDS, "stopping": pb.StoppingParams(stop=[""])},
        grpc.StatusCode.INVALID_ARGUMENT,
        "empty",
    ),
    "session_id over 256 characters": (
        {"model": MODEL, **IDS, "session_id": "s" * 300},
        grpc.StatusCode.INVALID_ARGUMENT,
        "session_id is 300 chars; at most 256",
    ),
    # Long values are cut in the message: a status message over 16 KiB fails the call.
    "a 100k-character model name": (
        {"model": "m" * 100_000, **IDS},
        grpc.StatusCode.NOT_FOUND,
        "... (100000 characters) is not served",
    ),
    "a 10k-character role": (  # (at 100k the chat is over the size limit first)
        {"model": MODEL, "chat": pb.Chat(messages=[pb.ChatMessage(role="r" * 10_000)])},
        grpc.StatusCode.INVALID_ARGUMENT,
        "... (10000 characters): must be one of",
    ),
    # 3000 x (16 framing + 4 "user"): refused before the template renders 3000 messages.
    "a chat of 3000 empty messages": (
        {"model": MODEL, "chat": pb.Chat(messages=[pb.ChatMessage(role="user")] * 3000)},
        grpc.StatusCode.INVALID_ARGUMENT,
        "chat is 60000 characters (with its messages' template framing); at most 16384 here",
    ),
    "stop token out of range": (
        {"model": MODEL, **IDS, "stopping": pb.StoppingParams(stop_token_ids=[4000])},
        grpc.StatusCode.INVALID_ARGUMENT,
        "4000",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_a_clear_status(stack, case):
    st, addr, _, _ = stack
    kw, code, needle = BAD[case]
    got, details = status_of(addr, **kw)
    assert got == code, (got, details)
    assert needle in details, details


def test_bad_input_leaves_other_requests_alone(stack, reference):
    """A flood of bad requests beside a good one: the good one's tokens are unchanged."""
    import concurrent.futures as cf

    st, addr, _, _ = stack
    _, gen = reference
    prompt = list(range(7, 50))
    want = gen.generate(prompt, 20, SamplingParams(), ignore_eos=True).token_ids
    with cf.ThreadPoolExecutor(8) as ex:
        good = ex.submit(
            generate,
            addr,
            prompt_token_ids=pb.TokenIds(ids=prompt),
            stopping=pb.StoppingParams(max_tokens=20, ignore_eos=True),
        )
        bad = [ex.submit(status_of, addr, **kw) for kw, _, _ in list(BAD.values()) * 2]
        assert [f.result()[0] for f in bad] == [c for _, c, _ in list(BAD.values()) * 2]
        assert good.result()[0] == want
    pools_idle(st)


def test_expired_deadline(stack):
    _, addr, _, _ = stack
    got, _ = status_of(addr, timeout=0.0005, model=MODEL, **IDS)
    assert got == grpc.StatusCode.DEADLINE_EXCEEDED


def test_duplicate_in_flight_request_id(stack, reference):
    st, addr, _, _ = stack
    _, gen = reference
    prompt = list(range(9, 40))
    with grpc.insecure_channel(addr) as ch:
        stub = pbg.GenerationStub(ch)
        first = stub.Generate(
            pb.GenerateRequest(
                model=MODEL,
                request_id="dup-1",
                prompt_token_ids=pb.TokenIds(ids=prompt),
                # Long enough to still be in flight at the second call (every program is
                # compiled before serving, so 60 tokens could finish first).
                stopping=pb.StoppingParams(max_tokens=400, ignore_eos=True),
            ),
            timeout=120,
        )
        head = next(first)  # in flight now
        got, details = status_of(addr, model=MODEL, request_id="dup-1", **IDS)
        assert got == grpc.StatusCode.ALREADY_EXISTS and "'dup-1'" in details
        ids = list(head.token_ids) + [t for r in first for t in r.token_ids]
    assert ids == gen.generate(prompt, 400, SamplingParams(), ignore_eos=True).token_ids
    assert status_of(addr, model=MODEL, request_id="dup-1", **IDS)[0] == grpc.StatusCode.OK
    pools_idle(st)


def test_tokenize_refuses_text_longer_than_any_context(stack):
    """Tokenize applies Generate's size limit (32 characters a context token, 512 here)."""
    _, addr, _, _ = stack
    empty_chat = pb.Chat(messages=[pb.ChatMessage(role="user")] * 3000)
    with grpc.insecure_channel(addr) as ch:
        stub = pbg.GenerationStub(ch)
        for req, needle in (
            (pb.TokenizeRequest(model=MODEL, prompt="word " * 4000), "prompt is 20000 characters"),
            (pb.TokenizeRequest(model=MODEL, chat=empty_chat), "chat is 60000 characters"),
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.Tokenize(req, timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert f"{needle}" in e.value.details() and "at most 16384" in e.value.details()
        ok = stub.Tokenize(pb.TokenizeRequest(model=MODEL, prompt="word " * 3000), timeout=30)
        assert len(ok.token_ids) == len(ok.tokens) > 0  # under the limit, on the thread
