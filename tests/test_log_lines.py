"""Lines two threads write to one pipe stay whole: a worker's JSON log lines (stderr) and its
READY line (stdout), both into the launcher's pipe, and the launcher finds READY even behind
a line some other writer wrote in two parts."""

from __future__ import annotations

import subprocess
import sys

from megaserve_app.launch import Proc, child_env
from tests.conftest import REPO

N = 4000

# A thread logging (as the heartbeat does at start) while the main thread announces lines.
RACE = f"""
import threading
import structlog
from megaserve.logs import announce, configure
configure()
log = structlog.get_logger("t")
def logs():
    for i in range({N}):
        log.info("registered", redis="up", i=i)
t = threading.Thread(target=logs)
t.start()
for i in range({N}):
    announce(f"READY decode worker d{{i}} grpc=127.0.0.1:1 metrics=None")
t.join()
"""


def test_log_lines_and_announced_lines_never_glue():
    out = subprocess.run(
        [sys.executable, "-c", RACE], cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    lines = out.splitlines()
    glued = [x for x in lines if not (x.startswith("{") and x.endswith("}"))]
    glued = [x for x in glued if not (x.startswith("READY ") and x.endswith("metrics=None"))]
    assert not glued, glued[:5]
    assert len(lines) == 2 * N


def test_a_ready_line_glued_behind_another_line_is_found():
    """A library's line written in two parts (text, then newline) with READY between them."""
    script = (
        'import sys; sys.stderr.write(\'{"event": "x"}\'); sys.stderr.flush();'
        "sys.stdout.write('READY decode worker d grpc=127.0.0.1:5 metrics=None\\n');"
        "sys.stdout.flush(); sys.stderr.write('\\n'); import time; time.sleep(30)"
    )
    p = Proc([sys.executable, "-c", script], "glued")
    try:
        assert p.wait_ready(60).startswith("READY decode worker d ")
        assert p.address == "127.0.0.1:5"
    finally:
        p.kill9()


def test_serve_relays_a_childs_tracebacks_and_stacks_whole(capsys):
    """Without --verbose, `serve` relays a child's error log lines and every line of a block
    it wrote outside its log (a traceback, SIGUSR2's stacks) until its next log line."""
    from megaserve_app.serve import _echo

    echo = _echo(verbose=False)
    lines = [
        '{"event": "serving", "level": "info"}\n',
        "Thread 0x00007f (most recent call first):\n",
        '  File "decode_service/main.py", line 82 in serve\n',
        '{"event": "beat", "level": "info"}\n',
        "Traceback (most recent call last):\n",
        '  File "x.py", line 1, in <module>\n',
        "ValueError: bad\n",
        '{"event": "gone", "level": "error"}\n',
    ]
    for line in lines:
        echo("decode-0", line)
    echo("prefill-0", '  File "not in a block"\n')
    got = capsys.readouterr().err.splitlines(keepends=True)
    want = [f"[decode-0] {x}" for i, x in enumerate(lines) if i not in (0, 3)]
    assert got == want
