"""`megaserve bench view-refresh`: a router's CPU per view refresh against workers with large
block sets, idle and with every set changing at each heartbeat (real Redis, real Heartbeats),
and while another router shares placements on every worker."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import deque
from pathlib import Path

from megaserve.state_keys import WorkerInfo, block_hex
from megaserve_app.bench.summary import run_stats

REFRESHES_PER_BEAT = 5  # the router's 0.2 s refresh against the workers' 1 s heartbeat


class _Blocks:
    """A worker's cached blocks as its page allocator shows them to the heartbeat."""

    def __init__(self, worker: int, blocks: int):
        self.block_events: deque = deque(maxlen=1 << 20)
        base = worker * 10**9
        self.hashes = set(range(base, base + blocks))
        self.next = base + blocks

    def cached_hashes(self) -> list[int]:
        return list(self.hashes)

    def replace(self, n: int) -> None:
        """Evicts the n oldest blocks for n new ones."""
        for _ in range(n):
            old = min(self.hashes)
            self.hashes.discard(old)
            self.block_events.append((-1, old))
            self.hashes.add(self.next)
            self.block_events.append((1, self.next))
            self.next += 1


def _cpu_per_refresh(seconds: list[float]) -> dict:
    """The bench statistic (summary.run_stats' median) of refreshes' CPU, and their mean."""
    return {
        "cpu_ms_per_refresh_median": round(run_stats(seconds).median_ms, 3),
        "cpu_ms_per_refresh_mean": round(1000 * sum(seconds) / len(seconds), 3),
    }


async def _refreshes(url: str, sources, beats, n: int, churn: int) -> dict:
    from router.state import ClusterState

    state = ClusterState(url)
    try:
        await state.refresh()  # the first read of every set, not timed
        cpu = []
        for i in range(n):
            if churn and i % REFRESHES_PER_BEAT == 0:
                for src, hb in zip(sources, beats):
                    src.replace(churn)
                    hb.beat()
            t = time.thread_time()
            await state.refresh()
            cpu.append(time.thread_time() - t)
        exact = all(
            state.workers[f"w{w}"].blocks == {block_hex(h) for h in src.hashes}
            for w, src in enumerate(sources)
        )
        return {
            "blocks_replaced_per_beat": churn,
            **_cpu_per_refresh(cpu),
            "view_equals_the_sets": exact,
        }
    finally:
        await state.stop()


async def _placements(url: str, workers: int, per_s: int, blocks: int, n: int) -> dict:
    """A router's refreshes while another shares `per_s` placements of `blocks` new blocks a
    second on each worker (ClusterState.expect, as on the request path); the CPU of the
    last `n` refreshes, once the placements' window (OPTIMISTIC_S) is full."""
    from router import worker_view
    from router.state import ClusterState

    writer, reader = ClusterState(url), ClusterState(url)
    try:
        await writer.refresh()
        await reader.refresh()
        writer._ids.fire(("PING",))  # connects the writer's pipelined connection
        await asyncio.sleep(0.05)
        ticks = int(worker_view.OPTIMISTIC_S / 0.2) + n
        cpu, made = [], 0
        for _ in range(ticks):
            for w in range(workers):
                for _ in range(max(1, round(per_s * 0.2))):
                    made += 1
                    start = made * (blocks + 1) * 16
                    writer.expect(
                        writer.workers[f"w{w}"], list(range(start, start + blocks * 16 + 1))
                    )
            await asyncio.sleep(0.2)
            t = time.thread_time()
            await reader.refresh()
            cpu.append(time.thread_time() - t)
        return {
            "placements_per_s_per_worker": per_s,
            "blocks_per_placement": blocks,
            **_cpu_per_refresh(cpu[-n:]),
            "blocks_expected_on_w0": len(reader.workers["w0"].optimistic),
        }
    finally:
        await writer.stop()
        await reader.stop()


def bench_view_refresh(
    blocks: int,
    workers: int,
    churn: int,
    refreshes: int,
    placements_per_s: int = 5,
    placement_blocks: int = 128,
    resync_s: float | None = None,
) -> dict:
    """CPU per refresh of one router's view: its workers idle, then `churn` blocks replaced
    on each worker every REFRESHES_PER_BEAT refreshes (a heartbeat); checks the view.
    resync_s: the heartbeats' periodic rewrite of their sets (None: Heartbeat.RESYNC_S)."""
    from megaserve.registration import Heartbeat
    from megaserve_app.launch import RedisProcess

    tmp = Path(tempfile.mkdtemp(prefix="megaserve-bench-"))
    redis_proc = RedisProcess(tmp).start()
    try:
        sources = [_Blocks(w, blocks) for w in range(workers)]
        beats = [
            Heartbeat(
                redis_proc.url,
                lambda w=w: WorkerInfo(
                    f"w{w}", "decode", f"127.0.0.1:{7000 + w}", "m", blocks, blocks, 0, 0, 16
                ),
                ttl=60,
                blocks=src,
            )
            for w, src in enumerate(sources)
        ]
        for hb in beats:
            if resync_s is not None:
                hb.RESYNC_S = resync_s
            hb.beat()
        rows = [
            asyncio.run(_refreshes(redis_proc.url, sources, beats, refreshes, c))
            for c in (0, churn)
        ]
        placed = asyncio.run(
            _placements(redis_proc.url, workers, placements_per_s, placement_blocks, refreshes)
        )
        return {
            "workers": workers,
            "blocks_per_worker": blocks,
            "resync_s": resync_s,
            "rows": rows,
            "placed": placed,
        }
    finally:
        redis_proc.kill()


def add_view_refresh(bsub) -> None:
    v = bsub.add_parser(
        "view-refresh", help="a router's CPU per view refresh against large block sets"
    )
    v.add_argument("--blocks", type=int, default=50_000, help="cached blocks per worker")
    v.add_argument("--workers", type=int, default=4)
    v.add_argument("--churn", type=int, default=16, help="blocks replaced per heartbeat")
    v.add_argument("--refreshes", type=int, default=25, help="timed refreshes per row")
    v.add_argument("--placements-per-s", type=int, default=5, help="shared, per worker")
    v.add_argument("--placement-blocks", type=int, default=128, help="new blocks per placement")
    v.add_argument(
        "--resync-s", type=float, help="the workers' periodic set rewrite (0: every heartbeat)"
    )
    v.add_argument("--json-out")
    v.set_defaults(func=cmd_bench_view_refresh)


def cmd_bench_view_refresh(a) -> int:
    out = bench_view_refresh(
        a.blocks,
        a.workers,
        a.churn,
        a.refreshes,
        a.placements_per_s,
        a.placement_blocks,
        a.resync_s,
    )
    for r in out["rows"]:
        print(
            f"{out['workers']} workers x {out['blocks_per_worker']} blocks, "
            f"{r['blocks_replaced_per_beat']} replaced per heartbeat: "
            f"{r['cpu_ms_per_refresh_median']:.2f} ms CPU per refresh (median; mean "
            f"{r['cpu_ms_per_refresh_mean']:.2f}); view equals the sets: "
            f"{r['view_equals_the_sets']}"
        )
    p = out["placed"]
    print(
        f"{out['workers']} workers, {p['placements_per_s_per_worker']} placements/s of "
        f"{p['blocks_per_placement']} blocks shared on each: {p['cpu_ms_per_refresh_median']:.2f}"
        f" ms CPU per refresh (median; mean {p['cpu_ms_per_refresh_mean']:.2f}); "
        f"{p['blocks_expected_on_w0']} blocks expected on w0"
    )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))
    return 0 if all(r["view_equals_the_sets"] for r in out["rows"]) else 1
