"""One read of every registered worker from Redis: its record, load and cached blocks."""

from __future__ import annotations

import time

import redis.asyncio
import structlog

from megaserve.state_keys import (
    BLOCKS_VERSION,
    WorkerInfo,
    placed_blocks_key,
    worker_blocks_key,
    worker_key,
    workers_set,
)
from router.worker_view import WorkerView

log = structlog.get_logger("megaserve.router.state")


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


async def read_workers(
    r: redis.asyncio.Redis, known: dict[str, WorkerView]
) -> tuple[dict[str, WorkerView], list[str]]:
    """(the views of the registered workers, ids whose record expired). Views in `known`
    are updated in place. A worker's block set is read only when its BLOCKS_VERSION moved
    from the one `known` last read (or it has none): three round trips, the third often
    empty, instead of every set on every refresh."""
    pipe = r.pipeline(transaction=False)
    for role in ("decode", "prefill"):
        pipe.smembers(workers_set(role))
    ids = [_text(m) for ms in await pipe.execute() for m in ms]
    pipe = r.pipeline(transaction=False)
    now_ms = time.time() * 1000
    for wid in ids:
        pipe.hgetall(worker_key(wid))
        pipe.zrangebyscore(placed_blocks_key(wid), now_ms, "+inf", withscores=True)
    res = await pipe.execute() if ids else []
    records = {wid: ({_text(k): _text(v) for k, v in res[2 * i].items()}, res[2 * i + 1])
               for i, wid in enumerate(ids)}  # fmt: skip
    moved = [
        wid
        for wid, (h, _) in records.items()
        if h
        and (
            h.get(BLOCKS_VERSION) is None
            or wid not in known
            or known[wid].blocks_version != h[BLOCKS_VERSION]
        )
    ]
    pipe = r.pipeline(transaction=False)
    for wid in moved:
        pipe.smembers(worker_blocks_key(wid))
    sets = dict(zip(moved, await pipe.execute())) if moved else {}
    seen, stale = {}, []
    now = time.monotonic()
    for wid, (h, placed) in records.items():
        if not h:  # heartbeat expired: the worker is gone
            stale.append(wid)
            continue
        try:
            info = WorkerInfo.from_hash(h)
        except (KeyError, ValueError) as e:
            log.warning("unreadable worker record", worker_id=wid, error=str(e))
            continue
        view = known.get(wid) or WorkerView(info)
        view.info = info
        if wid in sets:
            view.blocks = frozenset(_text(b) for b in sets[wid])
            view.blocks_version = h.get(BLOCKS_VERSION)
        view.optimistic = {
            k: t for k, t in view.optimistic.items() if t > now and k not in view.blocks
        }
        view.merge_placed(placed, now, now_ms)
        seen[wid] = view
    return seen, stale
