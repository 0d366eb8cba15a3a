"""`megaserve serve` (the README's run command) on a tiny checkpoint: the stack comes up,
answers, and SIGTERM or --exit-after-demo stops every process it started (no orphans)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from megaserve_app.launch import child_env
from tests.conftest import REPO
from tests.serve_process import descendants, thread_nices
from tests.stack import make_chat_checkpoint


def _role(cmd: str) -> str:
    """A child's megaserve subcommand (decode-worker, prefill-worker, router) or its command."""
    return next((r for r in ("decode-worker", "prefill-worker", "router") if f" {r} " in cmd), cmd)


def _flag(cmd: str, name: str) -> str:
    """The value after `name` in a command line, or ""."""
    words = cmd.split()
    return words[words.index(name) + 1] if name in words else ""


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(p)
        except OSError:
            pass
    return alive


def _serve(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megaserve_app.cli", "serve", "--port", "0", *args]
    return subprocess.Popen(
        cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_serve_answers_then_sigterm_stops_everything(tmp_path):
    ck = make_chat_checkpoint(tmp_path / "ck")
    p = _serve(
        "--checkpoint", str(ck), "--kv-budget-mb", "8", "--max-context", "512",
        "--decode-cpu-nice", "4", "--cpu-turns",
    )  # fmt: skip
    lines, children, nices, turns = [], set(), {}, {}
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("megaserve is serving"):
                kids = descendants(p.pid)  # pid -> command line
                children = set(kids)
                nices = {_role(cmd): set(thread_nices(c).values()) for c, cmd in kids.items()}
                turns = {_role(cmd): _flag(cmd, "--cpu-turns") for cmd in kids.values()}
            if children and line.strip() and not line.startswith(("megaserve", ">", "router")):
                break  # the demo answer streamed
        assert children, "".join(lines)
        assert len(children) >= 4, children  # redis, prefill, decode, router
        # --decode-cpu-nice: the decode worker beside a prefill worker runs at base + 4.
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert nices.get("decode-worker") == {min(19, base + 4)}, nices
        assert nices.get("prefill-worker") == {base}, nices
        # --cpu-turns: both workers take turns on one lock file of the stack's.
        assert turns["decode-worker"] and turns["decode-worker"] == turns["prefill-worker"], turns
        assert os.path.exists(turns["decode-worker"]), turns
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
        lines.append(out)
    finally:
        if p.poll() is None:
            p.kill()
    text = "".join(lines)
    assert p.returncode == 0, text
    assert "stopped" in text
    time.sleep(0.5)
    assert not _alive(children), f"orphans: {_alive(children)}"
    assert not os.path.exists(os.path.dirname(turns["decode-worker"]))  # removed at the stop


def test_exit_after_demo_stops_the_stack_with_status_0(tmp_path):
    """--exit-after-demo: one answer, then every process stopped. (The README's own command,
    SmolLM2 with the default flags, answers its demo in tests/test_serve_overload.py.)"""
    ck = make_chat_checkpoint(tmp_path / "ck")
    p = _serve("--checkpoint", str(ck), "--kv-budget-mb", "8", "--max-context", "512",
               "--exit-after-demo", "--demo-prompt", "Say hi")  # fmt: skip
    children: set[int] = set()
    lines = []
    killer = threading.Timer(480, p.kill)  # a stack that never stops fails below, not hangs
    killer.start()
    try:
        for line in p.stdout:  # to the end of its output: the stack stops by itself
            lines.append(line)
            if line.startswith("megaserve is serving"):  # the children, before the demo
                children = set(descendants(p.pid))
        p.wait(60)
    finally:
        killer.cancel()
        if p.poll() is None:
            p.kill()
    out = "".join(lines)
    assert p.returncode == 0, out
    assert "> Say hi" in out and "stopping (--exit-after-demo)" in out and "stopped" in out, out
    assert len(children) >= 4, children
    time.sleep(0.5)
    assert not _alive(children), f"orphans: {_alive(children)}"
