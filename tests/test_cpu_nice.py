"""A worker's --cpu-nice: every thread of the real worker process runs at the raised nice
value (the XLA and gRPC threads it starts after the flag is read included), its session's
autogroup too, and a value outside 0-19 is refused by name before anything loads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from megaserve_app.launch import megaserve_cmd
from tests.serve_process import thread_nices
from tests.stack import Stack, make_chat_checkpoint


def test_worker_threads_run_at_cpu_nice(tmp_path, redis_server):
    st = Stack(redis_server.url, make_chat_checkpoint(tmp_path / "ck"))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        p = st.worker("prefill", "p-nice", "--cpu-nice", "5")
        p.wait_ready(300)
        nices = thread_nices(p.p.pid)
        group = Path(f"/proc/{p.p.pid}/autogroup")
        group = group.read_text() if group.exists() else ""
    finally:
        st.stop()
    assert len(nices) > 2, nices  # the gRPC and XLA threads are there, not only the main one
    assert set(nices.values()) == {min(19, base + 5)}, nices
    # The worker leads its own session (Cluster starts it so), whose autogroup starts at
    # nice 0 and weighs it against the other sessions' processes: lowered too.
    assert not group or group.split()[-1] == "5", group


def test_cpu_nice_out_of_range_is_refused():
    for bad in ("20", "-1", "x"):
        r = subprocess.run(
            megaserve_cmd("decode-worker", "--cpu-nice", bad), capture_output=True, text=True
        )
        assert r.returncode == 2, r.stderr
        assert f"{bad!r} is not a nice increment from 0 to 19" in r.stderr, r.stderr
