"""`megaserve serve` as a real subprocess, for the whole-stack tests: its process tree, its
output, concurrent public streams against it, and the request sets those tests send."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import grpc

from megaserve.status import RETRY_AFTER_KEY
from megaserve.v1 import generation_pb2 as pb
from megaserve_app.client import stream_request
from megaserve_app.launch import child_env, dump_stacks
from tests.conftest import REPO


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of pid: its command line."""
    parents, cmds = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmds[int(d)] = f.read().replace(b"\0", b" ").decode()
            except OSError:
                continue
    out, frontier = {}, {pid}
    while frontier:
        kids = {p for p, pp in parents.items() if pp in frontier}
        out |= {k: cmds.get(k, "") for k in kids}
        frontier = kids
    return out


def thread_nices(pid: int) -> dict[int, int]:
    """tid -> nice of each thread of pid (/proc/PID/task/TID/stat field 19)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
    return out


def pid_of(serve_pid: int, worker_id: str) -> int:
    found = [p for p, c in descendants(serve_pid).items() if f"--worker-id {worker_id} " in c]
    assert len(found) == 1, (worker_id, found)
    return found[0]


class Served:
    """`megaserve serve` as a subprocess (--verbose: the router's placement and migration log
    lines come through); its output is read in the background."""

    def __init__(self, *args: str, warm_up: str = "none"):
        # By default shapes compile on first use: tests that kill and restart workers run on
        # timers that a full warm-up (minutes cold on CPU) would not meet.
        cmd = [sys.executable, "-m", "megaserve_app.cli", "serve", "--port", "0"]
        cmd += ["--warm-up", warm_up, *args]
        self.p = subprocess.Popen(
            cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_line(self, pattern: str, timeout: float, start: int = 0) -> tuple[int, re.Match]:
        """The first output line from index `start` on matching pattern: (index, match)."""
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                for i in range(start, len(self.lines)):
                    m = re.search(pattern, self.lines[i])
                    if m:
                        return i, m
                left = end - time.monotonic()
                if left <= 0 or self.p.poll() is not None:
                    break
                self._cv.wait(min(left, 1.0))
        raise AssertionError(pattern, self.hung_output())

    def hung_output(self) -> str:
        """The output's end, with every live megaserve child's thread stacks (SIGUSR2: see
        megaserve_app/cli.py) when serve is still up: what a timed-out wait waited on."""
        if self.p.poll() is None:
            kids = [p for p, cmd in descendants(self.p.pid).items() if "megaserve_app.cli" in cmd]
            dump_stacks([self.p.pid, *kids])
        return self.output(own_only=False)[-20000:]

    def output(self, own_only: bool = True) -> str:
        with self._cv:
            lines = list(self.lines)
        return "".join(x for x in lines if not (own_only and x.startswith("[")))

    def router_events(self, event: str, prefix: str) -> list[dict]:
        """The router's JSON log records of `event` for request ids starting with prefix."""
        out = []
        with self._cv:
            lines = [x[len("[router] ") :] for x in self.lines if x.startswith("[router] {")]
        for x in lines:
            try:
                rec = json.loads(x)
            except ValueError:
                continue
            if rec.get("event") == event and str(rec.get("request_id", "")).startswith(prefix):
                out.append(rec)
        return out

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return self.p.returncode


def make_requests(
    seed: int, n: int = 24, long_every: int = 6, max_tokens: tuple[int, int] = (48, 72)
) -> list[pb.GenerateRequest]:
    """n requests: every long_every-th prompt longer than disagg_min_uncached_tokens (256, the
    default: the prefill tier), the others short (co-located); greedy and seeded alternate."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randrange(264, 296) if i % long_every == 0 else rng.randrange(16, 48)
        sampling = (
            pb.SamplingParams(temperature=0.8, top_k=40, seed=1000 + seed + i)
            if i % 2
            else pb.SamplingParams(temperature=0.0)
        )
        out.append(
            pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(
                    ids=[rng.randrange(100, 49000) for _ in range(length)]
                ),
                sampling=sampling,
                stopping=pb.StoppingParams(max_tokens=rng.randint(*max_tokens), ignore_eos=True),
            )
        )
    return out


def warmup_of(reqs: list[pb.GenerateRequest]) -> list[pb.GenerateRequest]:
    """The requests with other prompt tokens of the same lengths, 4 tokens each."""
    out = []
    for i, r in enumerate(reqs):
        w = pb.GenerateRequest()
        w.CopyFrom(r)
        w.prompt_token_ids.ids[:] = [(t * 7 + i) % 48000 + 100 for t in r.prompt_token_ids.ids]
        w.stopping.max_tokens = 4
        out.append(w)
    return out


class Streams:
    """The requests as concurrent public streams (one thread each), under request ids
    `{prefix}{i}`: tokens, first-token and end times, errors."""

    def __init__(self, address: str, reqs: list[pb.GenerateRequest], prefix: str):
        self.prefix, self.n = prefix, len(reqs)
        self.tokens: list[list[int]] = [[] for _ in reqs]
        self.first: list[float | None] = [None] * len(reqs)
        self.started: list[float | None] = [None] * len(reqs)
        self.done: list[float | None] = [None] * len(reqs)
        self.errors: dict[int, str] = {}
        self.codes: dict[int, grpc.StatusCode] = {}
        self.retry_after: dict[int, str | None] = {}
        self.t0 = time.monotonic()
        self.threads = []
        for i, r in enumerate(reqs):
            req = pb.GenerateRequest()
            req.CopyFrom(r)
            req.request_id = f"{prefix}{i}"
            t = threading.Thread(target=self._one, args=(address, i, req), daemon=True)
            t.start()
            self.threads.append(t)

    def _one(self, address: str, i: int, req: pb.GenerateRequest) -> None:
        self.started[i] = time.monotonic()
        try:
            for r in stream_request(address, req, timeout=300):
                if r.token_ids and self.first[i] is None:
                    self.first[i] = time.monotonic()
                self.tokens[i] += r.token_ids
        except grpc.RpcError as e:
            self.errors[i] = f"{e.code().name}: {e.details()}"
            self.codes[i] = e.code()
            self.retry_after[i] = dict(e.trailing_metadata() or ()).get(RETRY_AFTER_KEY)
        self.done[i] = time.monotonic()

    def wait(self, pred, timeout: float = 240.0) -> None:
        end = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < end, (self.first, self.done, self.errors)
            time.sleep(0.01)

    def join(self, timeout: float = 300.0, allow_errors: bool = False) -> list[list[int]]:
        """Every stream's tokens, after each has ended (asserts none is still open)."""
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(end - time.monotonic(), 0.0))
        hung = [i for i, t in enumerate(self.threads) if t.is_alive()]
        assert not hung, f"{len(hung)} streams still open after {timeout} s: {hung[:10]}"
        assert allow_errors or not self.errors, self.errors
        return self.tokens

    def summary(self) -> str:
        firsts = [f - self.t0 for f in self.first if f is not None]
        ends = [d - self.t0 for d in self.done if d is not None]
        return (
            f"{self.n} streams, first tokens {min(firsts):.1f}-{max(firsts):.1f} s, "
            f"done {min(ends):.1f}-{max(ends):.1f} s"
        )
