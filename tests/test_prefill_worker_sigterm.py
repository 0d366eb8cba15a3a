"""A `megaserve prefill-worker` process stopped by SIGTERM in the middle of a prompt: with a
grace shorter than the prompt it ends its engine after the call it is in and exits 0 (no
crash at exit), the hand-off fails with a status, and the decode worker frees the
reservation and still serves the prompt itself; --shutdown-grace refuses a bad value by
name."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time

from megaserve.cpu_turns import CpuTurns
from megaserve.sampling_params import SamplingParams
from megaserve_app.launch import megaserve_cmd, worker_stats
from router.workers import HandoffFailed
from tests.polling import until
from tests.stack import Stack, disagg_generate, make_chat_checkpoint


def test_sigterm_mid_prompt_exits_0_and_frees_the_reservation(tmp_path, redis_server):
    # The prefill worker computes a prompt in 16-token calls, each taking a CPU turn on a lock
    # file this test holds: it is stopped with its prompt mid-way, deterministically.
    turns_file = tmp_path / "turns"
    st = Stack(redis_server.url, make_chat_checkpoint(tmp_path / "ck"))
    held = CpuTurns(turns_file)
    result: dict = {}
    try:
        d = st.worker("decode", "d1")
        p = st.worker(
            "prefill", "p1",
            "--cpu-turns", str(turns_file), "--prefill-chunk", "16", "--shutdown-grace", "0.5",
        )  # fmt: skip
        d.wait_ready(), p.wait_ready()
        prompt = [(7 * i) % 300 + 5 for i in range(200)]
        held.__enter__()

        def handoff():
            try:
                result["ok"] = asyncio.run(
                    disagg_generate(d.address, p.address, "r1", prompt, 4, SamplingParams())
                )
            except Exception as e:  # noqa: BLE001 (what failed is the assertion below)
                result["error"] = e

        client = threading.Thread(target=handoff)
        client.start()
        until(lambda: worker_stats(d.address).reserved == 1, "no reservation on d1")
        time.sleep(0.5)  # the Prefill call is on p1, its first piece waiting for a turn
        p.p.send_signal(15)
        time.sleep(1.5)  # past the grace: the call is cancelled, stop waits for the engine
        assert p.alive, "p1 exited inside a prefill call"
        held.__exit__(None, None, None)
        assert p.p.wait(timeout=30) == 0, "".join(p.lines[-40:])
        client.join(timeout=60)
        assert not client.is_alive()
        error = result.get("error")
        assert isinstance(error, HandoffFailed) and error.stage == "prefill", result
        stats = until(
            lambda: (s := worker_stats(d.address)).reserved == 0 and s, "reservation held"
        )
        assert stats.free_pages + stats.cached_pages == stats.total_pages, stats
        # d1 serves the prompt on its own.
        _, _, toks = asyncio.run(
            disagg_generate(d.address, None, "r2", prompt, 4, SamplingParams())
        )
        assert len(toks) == 4
    finally:
        held.close()
        st.stop()


def test_a_bad_shutdown_grace_is_refused_by_value():
    for kind in ("prefill", "decode"):
        for bad in ("-1", "x", "inf"):
            r = subprocess.run(
                megaserve_cmd(f"{kind}-worker", "--shutdown-grace", bad),
                capture_output=True,
                text=True,
            )
            assert r.returncode == 2, r.stderr
            assert f"{bad!r} is not a number of seconds >= 0" in r.stderr, r.stderr
