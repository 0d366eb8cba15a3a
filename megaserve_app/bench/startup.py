"""`megaserve bench startup`: a worker's time to SERVING with a cold, then a warm, persistent
compilation cache (the worker compiles its whole program set before it serves)."""

from __future__ import annotations

import json
import os
import tempfile
import time

from megaserve_app.launch import Proc, megaserve_cmd


def _compiled(lines: list[str]) -> dict:
    """The worker's `programs compiled` log record (JSON lines), or {}."""
    for line in reversed(lines):
        if '"programs compiled"' in line:
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return {}


def bench_startup(role: str, args: list[str], cache_dir: str | None, runs: int = 2) -> list[dict]:
    """Starts `megaserve {role}-worker *args` `runs` times over one compilation cache (a
    fresh temporary one unless given): the first start is cold, the later ones warm."""
    cache = cache_dir or tempfile.mkdtemp(prefix="megaserve-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache  # launch.child_env keeps a set value
    rows = []
    for i in range(runs):
        t0 = time.perf_counter()
        proc = Proc(megaserve_cmd(f"{role}-worker", "--port", "0", *args), f"{role}-{i}")
        proc.wait_ready(timeout=1800)
        ready_s = time.perf_counter() - t0
        proc.stop()
        found = _compiled(proc.lines)
        rows.append(
            {
                "run": "cold" if i == 0 and cache_dir is None else "warm",
                "role": role,
                "ready_s": round(ready_s, 1),
                "programs": found.get("programs"),
                "warm_up_s": found.get("seconds"),
                "from_exec_cache": found.get("from_exec_cache"),
                "by_name": found.get("by_name"),
                "cache_dir": cache,
            }
        )
    return rows
