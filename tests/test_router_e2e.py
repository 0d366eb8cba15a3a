"""Router -> prefill -> decode as real processes on a real Redis: tokens equal in-process
generation for text, chat and token-id inputs; stop conditions; sessions (one router and two);
health and reflection; generated and prompt log-probabilities equal the in-process generator's
and transformers'. Bad input is in tests/test_router_e2e_bad_input.py."""

from __future__ import annotations

import json
import subprocess

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from megaserve.checkpoint import load_tokenizer
from megaserve.sampling_params import SamplingParams
from megaserve.v1 import generation_pb2 as pb
from megaserve.v1 import generation_pb2_grpc as pbg
from megaserve_app.launch import worker_stats
from tests.conftest import FIXTURES
from tests.router_stack import (
    DECODE,
    DISAGG_MIN,
    IDS,
    MODEL,
    generate,
    offline_reference,
    router_stack,
    status_of,
)
from tests.stack import counters_moved, decode_counters, tokens_equal_report, wait_router_view


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with router_stack(tmp_path_factory.mktemp("router")) as s:
        yield s


@pytest.fixture(scope="module")
def reference(stack):
    return offline_reference(stack[2])


def _ref_ids(ck, kind, value):
    tok = load_tokenizer(str(ck)).tokenizer
    if kind == "prompt":
        return tok.encode(value)
    if kind == "chat":
        return tok.encode_chat(value)
    return value


LONG = "Serving systems batch requests continuously over a paged KV cache. " * 4
CASES = {
    "prompt": LONG,  # long enough (>= 48 uncached tokens) to take the prefill tier
    "chat": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
    "prompt_token_ids": list(range(3, 90)),  # long too
}
# The seeded runs' long prompts start differently, so no block of them is cached by the greedy
# runs: they are uncached and must take the prefill tier too.
SEEDED = {
    "prompt": "Seeded run. " + LONG,
    "chat": CASES["chat"],
    "prompt_token_ids": list(range(200, 113, -1)),
}


def _input(kind, value):
    if kind == "prompt":
        return {"prompt": value}
    if kind == "chat":
        return {"chat": pb.Chat(messages=[pb.ChatMessage(**m) for m in value])}
    return {"prompt_token_ids": pb.TokenIds(ids=value)}


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_tokens_equal_in_process_generation(stack, reference, kind, sampled):
    _, addr, ck, _ = stack
    model, gen = reference
    st = stack[0]
    sp = SamplingParams(temperature=0.9, top_k=40, seed=11) if sampled else SamplingParams()
    sampling = pb.SamplingParams(temperature=sp.temperature, top_k=sp.top_k, seed=sp.seed)
    value = (SEEDED if sampled else CASES)[kind]
    before = decode_counters(st, DECODE)
    ids, text, out = generate(
        addr,
        **_input(kind, value),
        sampling=sampling,
        stopping=pb.StoppingParams(max_tokens=24, ignore_eos=True),
    )
    moved = counters_moved(before, decode_counters(st, DECODE))
    prompt = _ref_ids(ck, kind, value)
    want = gen.generate(prompt, 24, sp, ignore_eos=True).token_ids
    assert ids == want, tokens_equal_report(ids, want)
    assert text == model.tokenizer.decode(ids, skip_special_tokens=True)
    last = out[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert all(o.finish_reason == pb.FINISH_REASON_UNSPECIFIED for o in out[:-1])
    assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == 24
    uncached = len(prompt) - last.usage.cached_tokens
    assert moved["requests"] == 1, moved
    if kind == "chat":
        assert len(prompt) < DISAGG_MIN  # short: prefilled on the decode worker
        assert moved == {"imported_requests": 0, "prefill_tokens": uncached, "requests": 1}
    else:
        # Long and uncached: the prefill tier computed the prompt, the decode worker imported
        # its KV and computed none of it.
        assert last.usage.cached_tokens == 0 and uncached >= DISAGG_MIN, (len(prompt), uncached)
        assert moved == {"imported_requests": 1, "prefill_tokens": 0, "requests": 1}, moved


def test_eos_and_stop_strings(stack, reference):
    _, addr, ck, _ = stack
    model, gen = reference
    prompt = list(range(3, 40))
    free = gen.generate(prompt, 40, SamplingParams(), ignore_eos=True).token_ids
    # A stop token id ends generation and is included.
    stop_tok = free[5]
    ids, _, out = generate(
        addr,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingParams(max_tokens=40, stop_token_ids=[stop_tok], ignore_eos=True),
    )
    assert ids == free[: free.index(stop_tok) + 1]
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP
    # A stop string taken from the free-running text cuts the text before it.
    full = model.tokenizer.decode(free, skip_special_tokens=True)
    stop = full[10:14]
    _, text, out = generate(
        addr,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingParams(max_tokens=40, stop=[stop], ignore_eos=True),
    )
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP_STRING
    assert text == full[: full.index(stop)]


def test_session_second_turn_prefills_only_the_suffix(stack):
    st, addr, ck, _ = stack
    tok = load_tokenizer(str(ck)).tokenizer
    turn1 = [{"role": "user", "content": LONG}]
    first = decode_counters(st, DECODE)
    ids1, text1, out1 = generate(
        addr,
        chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in turn1]),
        stopping=pb.StoppingParams(max_tokens=8, ignore_eos=True),
        session_id="sess-1",
    )
    # Turn 1 is long and new: its prompt went through the prefill tier.
    assert out1[-1].usage.cached_tokens == 0
    assert len(tok.encode_chat(turn1)) >= DISAGG_MIN
    moved = counters_moved(first, decode_counters(st, DECODE))
    assert moved == {"imported_requests": 1, "prefill_tokens": 0, "requests": 1}, moved
    r = redis.Redis.from_url(st.redis_url)
    holder = r.hget("megaserve:session:sess-1", "worker_id").decode()
    addr_of = {w: st.procs[w].address for w in ("d1", "d2")}
    before = {w: worker_stats(a) for w, a in addr_of.items()}
    turn2 = turn1 + [
        {"role": "assistant", "content": text1},
        {"role": "user", "content": "and then?"},
    ]
    prompt2 = tok.encode_chat(turn2)
    _, _, out2 = generate(
        addr,
        chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in turn2]),
        stopping=pb.StoppingParams(max_tokens=4, ignore_eos=True),
        session_id="sess-1",
    )
    after = {w: worker_stats(a) for w, a in addr_of.items()}
    other = "d2" if holder == "d1" else "d1"
    assert after[other].prefill_tokens == before[other].prefill_tokens  # not placed there
    assert after[other].imported_requests == before[other].imported_requests
    computed = after[holder].prefill_tokens - before[holder].prefill_tokens
    cached = out2[-1].usage.cached_tokens
    # Turn 1's prompt pages are cached on the holder; only the rest was prefilled, there.
    prompt1 = tok.encode_chat(turn1)
    assert cached >= (len(prompt1) - 1) // 16 * 16 > 0
    assert computed == len(prompt2) - cached, (computed, len(prompt2), cached)
    assert after[holder].imported_requests == before[holder].imported_requests


def test_health_reflection_and_models(stack):
    _, addr, _, _ = stack
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(addr) as ch:
        h = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="megaserve.v1.Generation")
        )
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
        names = {s.name for s in resp.list_services_response.service}
        assert "megaserve.v1.Generation" in names
        models = pbg.GenerationStub(ch).ListModels(pb.ListModelsRequest()).models
        assert [(m.name, m.max_context, m.decode_workers) for m in models] == [(MODEL, 512, 2)]
        tk = pbg.GenerationStub(ch).Tokenize(pb.TokenizeRequest(model=MODEL, prompt="hello"))
        assert "".join(tk.tokens) == "hello"


def test_two_routers_share_sessions_and_request_ids(stack):
    """A second router on the same Redis: a duplicate id in flight on r1 is refused by r2, and
    a session started on r1 continues on r2 where its KV is."""
    st, addr1, ck, _ = stack
    r2 = st.router("r2", "--config", str(ck.parent / "lb.yaml"))
    r2.wait_ready()
    addr2 = r2.address
    try:
        wait_router_view(addr2, len(DECODE), 1)
        with grpc.insecure_channel(addr1) as ch:
            first = pbg.GenerationStub(ch).Generate(
                pb.GenerateRequest(
                    model=MODEL,
                    request_id="shared-id",
                    prompt_token_ids=pb.TokenIds(ids=list(range(4, 30))),
                    # Long enough to still be in flight when r2 is asked: with every program
                    # compiled before serving, 80 tokens could finish first.
                    stopping=pb.StoppingParams(max_tokens=400, ignore_eos=True),
                ),
                timeout=120,
            )
            next(first)
            got, details = status_of(addr2, model=MODEL, request_id="shared-id", **IDS)
            assert got == grpc.StatusCode.ALREADY_EXISTS, details
            assert sum(len(r.token_ids) for r in first) == 399
        turn1 = [{"role": "user", "content": "Two routers. " + LONG}]  # no block cached yet
        first = decode_counters(st, DECODE)
        _, text1, out1 = generate(
            addr1,
            chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in turn1]),
            stopping=pb.StoppingParams(max_tokens=6, ignore_eos=True),
            session_id="sess-2r",
        )
        assert out1[-1].usage.cached_tokens == 0
        moved = counters_moved(first, decode_counters(st, DECODE))
        assert moved == {"imported_requests": 1, "prefill_tokens": 0, "requests": 1}, moved
        holder = redis.Redis.from_url(st.redis_url).hget("megaserve:session:sess-2r", "worker_id")
        before = worker_stats(st.procs[holder.decode()].address)
        turn2 = turn1 + [
            {"role": "assistant", "content": text1},
            {"role": "user", "content": "more"},
        ]
        _, _, out2 = generate(
            addr2,
            chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in turn2]),
            stopping=pb.StoppingParams(max_tokens=4, ignore_eos=True),
            session_id="sess-2r",
        )
        after = worker_stats(st.procs[holder.decode()].address)
        assert after.requests == before.requests + 1  # r2 sent turn 2 to the session's worker
        assert out2[-1].usage.cached_tokens > 0
    finally:
        r2.stop()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.mark.parametrize("top_n", [0, 3])
def test_logprobs_equal_in_process_logits(stack, reference, top_n):
    """Per generated token: its log-probability and the top_n alternatives (ids, texts,
    values) equal log-softmax of the in-process prefill's logits for the same prefix."""
    st, addr, ck, _ = stack
    model, gen = reference
    prompt = list(range(120, 40, -1))  # long and uncached: it would take the prefill tier
    before = decode_counters(st, DECODE)
    ids, _, out = generate(
        addr,
        prompt_token_ids=pb.TokenIds(ids=prompt),
        stopping=pb.StoppingParams(max_tokens=6, ignore_eos=True),
        logprobs=pb.LogprobsParams(enabled=True, top_n=top_n),
    )
    moved = counters_moved(before, decode_counters(st, DECODE))
    assert moved["imported_requests"] == 0  # the hand-off carries no log-probabilities
    assert all(len(o.logprobs) == len(o.token_ids) for o in out)
    lps = [lp for o in out for lp in o.logprobs]
    assert ids == gen.generate(prompt, 6, SamplingParams(), ignore_eos=True).token_ids
    for i, lp in enumerate(lps):
        _, logits = gen.prefill(prompt + ids[:i], SamplingParams())
        ref = _log_softmax(logits)
        assert lp.token_id == ids[i] and lp.token == model.tokenizer.decode([ids[i]])
        assert abs(lp.logprob - ref[ids[i]]) < 1e-4, (i, lp.logprob, ref[ids[i]])
        want = np.argsort(-ref, kind="stable")[:top_n].tolist()
        assert [t.token_id for t in lp.top] == want
        assert np.allclose([t.logprob for t in lp.top], ref[want], atol=1e-4)
        assert [t.token for t in lp.top] == [model.tokenizer.decode([t]) for t in want]
    # Not asked: none.
    _, _, plain = generate(addr, prompt_token_ids=pb.TokenIds(ids=prompt[:8]), **_SIX)
    assert all(not o.logprobs for o in plain)


_SIX = {"stopping": pb.StoppingParams(max_tokens=6, ignore_eos=True)}


def test_prompt_logprobs_equal_in_process_logits(stack, reference):
    """Prompt token i + 1's log-probability given tokens 0..i (and the prompt_top_n there), on
    the first message only: log-softmax of the in-process prefill's logits for that prefix,
    over 3 prefill chunks of 64; the same again from the prefix cache; so is perplexity."""
    _, addr, _, _ = stack
    model, gen = reference
    prompt = list(range(360, 210, -1))
    ref = [_log_softmax(gen.prefill(prompt[:i], SamplingParams())[1]) for i in range(1, 150)]
    kw = {"prompt_token_ids": pb.TokenIds(ids=prompt), "session_id": "plp", **_SIX}  # one worker
    lp = pb.LogprobsParams(enabled=True, prompt=True, prompt_top_n=2)
    for cached in (False, True):
        ids, _, out = generate(addr, logprobs=lp, **kw)
        assert (out[-1].usage.cached_tokens > 0) == cached
        assert len(out[0].prompt_logprobs) == 149 and all(not o.prompt_logprobs for o in out[1:])
        assert len([x for o in out for x in o.logprobs]) == len(ids) == 6
        for p, e in enumerate(out[0].prompt_logprobs):
            want = np.argsort(-ref[p], kind="stable")[:2].tolist()
            assert e.token_id == prompt[p + 1] and e.token == model.tokenizer.decode([e.token_id])
            assert abs(e.logprob - ref[p][e.token_id]) < 1e-4, (p, e.logprob)
            assert [t.token_id for t in e.top] == want
            assert np.allclose([t.logprob for t in e.top], ref[p][want], atol=1e-4)
        got = np.exp(-np.mean([e.logprob for e in out[0].prompt_logprobs]))
        assert abs(got / np.exp(-np.mean([r[t] for r, t in zip(ref, prompt[1:])])) - 1) < 1e-4
    # Prompt only (no generated-token entries), without alternatives.
    _, _, out = generate(addr, logprobs=pb.LogprobsParams(prompt=True), **kw)
    assert [e.token_id for e in out[0].prompt_logprobs] == prompt[1:]
    assert all(not e.top for e in out[0].prompt_logprobs) and not out[0].logprobs


@pytest.mark.reference  # needs .venv-ref: skips without it, fails under CI=true (conftest)
def test_logprobs_equal_transformers(stack, ref_python):
    """Through the router, prompt and generated-token log-probabilities equal transformers'
    own forward over the same checkpoint (run now, from .venv-ref) to f32 rounding."""
    _, addr, ck, _ = stack
    prompt = list(range(290, 180, -1))  # two prefill chunks
    lp = pb.LogprobsParams(enabled=True, prompt=True)
    ids, _, out = generate(addr, prompt_token_ids=pb.TokenIds(ids=prompt), logprobs=lp, **_SIX)
    cmd = [str(ref_python), str(FIXTURES / "hf_logprobs.py"), str(ck)]
    run = subprocess.run(cmd, input=json.dumps(prompt + ids), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = np.asarray(json.loads(run.stdout))  # entry i: log p(token i + 1 | tokens 0..i)
    scored = [e.logprob for e in out[0].prompt_logprobs]
    generated = [e.logprob for o in out for e in o.logprobs]
    assert len(scored) == len(prompt) - 1 and len(generated) == len(ids) == 6
    assert np.max(np.abs(np.asarray(scored + generated) - ref)) < 1e-4
    perplexity = np.exp(-np.mean(scored))
    assert abs(perplexity / np.exp(-np.mean(ref[: len(prompt) - 1])) - 1) < 1e-5
