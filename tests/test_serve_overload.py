"""`megaserve serve` with its default flags (the README's run command: SmolLM2, one decode and
one prefill worker, every program compiled before SERVING) answers its demo question, then takes
160 concurrent streams: every stream ends exactly or is refused (RESOURCE_EXHAUSTED with a
retry-after hint, or UNAVAILABLE) within 5 s of arrival, none hangs, none waits on a compile, no
process's resident memory grows by more than 200 MB over the burst, and the stack answers
exactly afterwards."""

from __future__ import annotations

import json
import re
import time

import grpc
import pytest

from megaserve.v1 import generation_pb2 as pb
from tests.conftest import FIXTURES
from tests.serve_process import Served, Streams, descendants, make_requests

REF = json.loads((FIXTURES / "smollm2_reference.json").read_text())
STREAMS, COPIES = 160, 8  # 4 transformers cases x 8 copies, the rest random prompts
WAVE = 32  # the undisturbed reference runs the random prompts 32 at a time
MAX_RSS_GROWTH_MB = 200
REFUSE_WITHIN_S = 5.0
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


def _transformers_requests() -> tuple[list[pb.GenerateRequest], list[list[int]]]:
    """The fixture's chat and plain prompts, greedy, ignore_eos, max_tokens 8..32 by copy:
    the requests and the tokens transformers generated for them."""
    reqs, want = [], []
    for case in [*REF["cases"], REF["plain_case"]]:
        for c in range(COPIES):
            n = 8 + (24 * c) // (COPIES - 1)
            reqs.append(
                pb.GenerateRequest(
                    prompt_token_ids=pb.TokenIds(ids=case["prompt_ids"]),
                    sampling=pb.SamplingParams(temperature=0.0),
                    stopping=pb.StoppingParams(max_tokens=n, ignore_eos=True),
                )
            )
            want.append(case["greedy_ids_ignore_eos"][:n])
    return reqs, want


def _rss_mb(served: Served) -> dict[str, float]:
    """Resident memory (MB) of `megaserve serve` and each of its children, by role."""
    procs = {served.p.pid: "serve"} | {
        pid: _role(cmd) for pid, cmd in descendants(served.p.pid).items()
    }
    out = {}
    for pid, role in procs.items():
        if role is None:
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        out[role] = kb / 1024
    return out


def _role(cmd: str) -> str | None:
    if "redis-server" in cmd:
        return "redis"
    m = re.search(r"megaserve_app\.cli (router|decode-worker|prefill-worker) ", cmd)
    return m.group(1) if m else None


@pytest.mark.slow
def test_serve_answers_its_demo_then_160_streams_with_default_flags():
    """Why this is long: one SmolLM2 stack with the README's flags (its start, compiling
    every program, is the expensive part) answers the demo question and then the burst."""
    s = Served("--verbose", warm_up="all")  # the demo on, as `make run` has it
    try:
        i, m = s.wait_line(r"^megaserve is serving smollm2 at (\S+) \(up in ([\d.]+) s", 600)
        address = m.group(1)
        # The demo streams before the stack takes other requests; its answer ends in a newline.
        _, demo = s.wait_line(r"Paris", 120, i)
        print(f"\nstack up in {float(m.group(2)):.1f} s; demo: {demo.string.strip()!r}")
        print(f"rss at start {_fmt(_rss_mb(s))}")
        hf_reqs, hf_want = _transformers_requests()
        rand = make_requests(seed=5, n=STREAMS - len(hf_reqs), long_every=8, max_tokens=(8, 16))
        # The workers compiled every program before SERVING, so no request waits on a compile
        # (checked below): the undisturbed reference for the random prompts comes first.
        t1 = time.monotonic()
        rand_want = []
        for w in range(0, len(rand), WAVE):
            rand_want += Streams(address, rand[w : w + WAVE], f"ref{w}-").join()
        print(f"reference {time.monotonic() - t1:.1f} s")
        before = _rss_mb(s)

        reqs, want = hf_reqs + rand, hf_want + rand_want
        burst = Streams(address, reqs, "burst-")
        got = burst.join(600, allow_errors=True)
        after = _rss_mb(s)

        codes = [burst.codes.get(i, grpc.StatusCode.OK) for i in range(STREAMS)]
        assert set(codes) <= ALLOWED, burst.errors
        wrong = [i for i in range(STREAMS) if codes[i] == grpc.StatusCode.OK and got[i] != want[i]]
        assert wrong == [], [(i, got[i], want[i]) for i in wrong[:4]]
        refused = {i: burst.done[i] - burst.started[i] for i in burst.codes}
        slow = {i: t for i, t in refused.items() if t > REFUSE_WITHIN_S}
        assert not slow, {i: (t, burst.errors[i]) for i, t in slow.items()}
        for i, c in burst.codes.items():
            if c == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert burst.retry_after[i] and int(burst.retry_after[i]) > 0, burst.errors[i]
        ok = codes.count(grpc.StatusCode.OK)
        assert ok >= len(hf_reqs), codes  # the defaults admit far more than 32 at once
        growth = {k: after[k] - before[k] for k in before if k in after}
        print(
            f"burst of {STREAMS}: {ok} exact ({len(hf_reqs)} against transformers), "
            f"{codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)} RESOURCE_EXHAUSTED, "
            f"{codes.count(grpc.StatusCode.UNAVAILABLE)} UNAVAILABLE, slowest refusal "
            f"{max(refused.values(), default=0.0):.2f} s; {burst.summary()}\n"
            f"rss before {_fmt(before)}; after {_fmt(after)}"
        )
        assert set(growth) == set(before), (before, after)  # no process died
        assert max(growth.values()) <= MAX_RSS_GROWTH_MB, growth

        # Afterwards the stack answers exactly: the first 8 of each kind again.
        again = Streams(address, hf_reqs[::COPIES] + rand[:8], "again-").join()
        assert again == hf_want[::COPIES] + rand_want[:8]
        late = [line for line in s.lines if "program compiled while serving" in line]
        assert late == [], late[:4]  # the warm-up set covers every shape the burst used
    finally:
        rc = s.stop()
    assert rc == 0, s.output()[-3000:]


def _fmt(rss: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f} MB" for k, v in sorted(rss.items()))
