"""One read of every registered worker from Redis: its record, load and cached blocks."""

from __future__ import annotations

import time

import redis.asyncio
import structlog

from megaserve.state_keys import (
    BLOCKS_VERSION,
    DELTAS_KEPT,
    WorkerInfo,
    block_deltas_key,
    placed_blocks_key,
    worker_blocks_key,
    worker_key,
    workers_set,
)
from router.worker_view import WorkerView, text

log = structlog.get_logger("megaserve.router.state")
# Placements read per worker per refresh (the rest at the next): bounds one refresh's work.
PLACEMENTS_PER_READ = 10_000


async def read_workers(
    r: redis.asyncio.Redis, known: dict[str, WorkerView]
) -> tuple[dict[str, WorkerView], list[str]]:
    """(the views of the registered workers, ids whose record expired). Views in `known`
    are updated in place. A worker's block set is read only when its BLOCKS_VERSION moved
    from the one `known` holds (or it has none), and then as the changes since, when those
    are kept: three round trips, the third often empty, instead of every set whole on every
    refresh. Shared placements are read from where this router's last read ended."""
    pipe = r.pipeline(transaction=False)
    for role in ("decode", "prefill"):
        pipe.smembers(workers_set(role))
    ids = [text(m) for ms in await pipe.execute() for m in ms]
    pipe = r.pipeline(transaction=False)
    pipe.time()  # placements expire by Redis's clock (their ids): no skew between routers
    for wid in ids:
        pipe.hgetall(worker_key(wid))
        seen_id = known[wid].placed_seen if wid in known else None
        start = f"({seen_id}" if seen_id else "-"  # the entries not read yet (at most kept)
        pipe.xrange(placed_blocks_key(wid), min=start, count=PLACEMENTS_PER_READ)
    clock, *res = await pipe.execute()
    now_ms = clock[0] * 1000 + clock[1] / 1000
    records = {wid: ({text(k): text(v) for k, v in res[2 * i].items()}, res[2 * i + 1])
               for i, wid in enumerate(ids)}  # fmt: skip
    pipe, reads = r.pipeline(transaction=False), []
    for wid, (h, _) in records.items():
        v, old = h.get(BLOCKS_VERSION), known.get(wid)  # (an older worker writes no version)
        if not h or (v is not None and old is not None and old.blocks_version == v):
            continue  # gone, or its set has not moved
        since = _missed(old.blocks_version if old else None, v)
        if since:
            pipe.hmget(block_deltas_key(wid), since)
        else:
            pipe.smembers(worker_blocks_key(wid))
        reads.append((wid, bool(since)))
    got = await pipe.execute() if reads else []
    seen, stale = {}, []
    now = time.monotonic()
    for wid, (h, _) in records.items():
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
        seen[wid] = view
    for (wid, deltas), value in zip(reads, got):
        view = seen.get(wid)
        if view is None:
            continue
        version = records[wid][0].get(BLOCKS_VERSION)
        if not deltas:
            view.blocks, view.blocks_version = frozenset(text(b) for b in value), version
        elif None in value:  # a change no longer kept, or a rewrite: the next refresh reads all
            view.blocks_version = None
        else:
            view.blocks, view.blocks_version = _apply(view.blocks, value), version
    for wid, view in seen.items():
        view.optimistic = {
            k: t for k, t in view.optimistic.items() if t > now and k not in view.blocks
        }
        view.merge_placed(records[wid][1], now, now_ms)
    return seen, stale


def _missed(held: str | None, now: str | None) -> list[str]:
    """The versions whose changes take a set from version `held` to `now`: [] when they are
    not all kept (or a version is unreadable), so the set is read whole."""
    try:
        a, b = int(held), int(now)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    return [str(v) for v in range(a + 1, b + 1)] if 0 < b - a <= DELTAS_KEPT else []


def _apply(blocks: frozenset[str], deltas: list) -> frozenset[str]:
    """blocks after each change of `deltas` in order ("added,...|removed,...")."""
    out = set(blocks)
    for d in deltas:
        added, _, removed = text(d).partition("|")
        out.difference_update(removed.split(",") if removed else ())
        out.update(added.split(",") if added else ())
    return frozenset(out)
