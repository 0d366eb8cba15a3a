"""The one Redis key layout every tier uses (workers, sessions, prefix blocks); TTLs always."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "megaserve:"


def worker_key(worker_id: str) -> str:
    """Hash: role, address, model, total_pages, free_pages, running, waiting; TTL heartbeat."""
    return f"{PREFIX}worker:{worker_id}"


def workers_set(role: str) -> str:
    """Set of worker ids with this role ('decode' | 'prefill'); members expire via their hash."""
    return f"{PREFIX}workers:{role}"


def session_key(session_id: str) -> str:
    """Hash: decode worker, kv length, token digest; idle TTL."""
    return f"{PREFIX}session:{session_id}"


def worker_blocks_key(worker_id: str) -> str:
    """Set of prefix block hashes (hex) cached on a worker; TTL refreshed by the worker.
    Its version is the worker hash's BLOCKS_VERSION field, written with every change."""
    return f"{PREFIX}blocks:{worker_id}"


# A worker hash's field: a number that goes up by one, in the same transaction, whenever
# the worker's block set changes. Routers read the set again only when it moved, and then
# as the changes since the version they hold when those are kept (a set holds up to a
# pool's pages; read whole every refresh, it was most of a router's background CPU).
BLOCKS_VERSION = "blocks_version"
# Changes kept per worker: 32 heartbeats (about 32 s); a router further behind reads it all.
DELTAS_KEPT = 32


def block_deltas_key(worker_id: str) -> str:
    """Hash: version -> the block set's change that made it ("added,...|removed,..." hex);
    no entry for a version that rewrote the set whole. TTL refreshed by the worker."""
    return f"{PREFIX}blockdeltas:{worker_id}"


def placed_blocks_key(worker_id: str) -> str:
    """Stream: one entry per placement a router just sent to a worker, field `b` its prefix
    block hashes (hex, comma-joined); the entry's id (Redis's clock) starts the expectation.
    Every router reads the entries after the last it read and counts those blocks, for
    what is left of the expectation by Redis's clock, before the worker's own set says so.
    Writers keep the last PLACEMENTS_KEPT entries; the key's TTL bounds an idle one. (A
    stream, not the sorted set of hashes it was: a refresh then read every hash of the last
    seconds, ~10 us each, every 0.2 s.) XRANGE's exclusive start needs Redis >= 6.2."""
    return f"{PREFIX}placements:{worker_id}"


# Entries a placements stream keeps: 200 placements/s on one worker over the 5 s a router
# trusts one (older ones are read as expired anyway).
PLACEMENTS_KEPT = 1000


def block_hex(h: int) -> str:
    """How a block hash (megaserve.kv.block_hash) is written in the block sets."""
    return format(h, "016x")


def inflight_key(request_id: str) -> str:
    """String: the router owning an in-flight public request_id (duplicates are refused)."""
    return f"{PREFIX}inflight:{request_id}"


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker advertises; the router reads these to place requests."""

    worker_id: str
    role: str
    address: str
    model: str
    total_pages: int
    free_pages: int
    running: int
    waiting: int
    page_size: int
    max_context: int = 0  # tokens (prompt + output) one request may use
    vocab_size: int = 0
    tp: int = 1  # tensor-parallel devices (the KV hand-off works across different tp)
    ep: int = 1  # expert-parallel devices (and across different ep)

    def to_hash(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.__dict__.items()}

    @classmethod
    def from_hash(cls, h: dict) -> WorkerInfo:
        h = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in h.items()
        }
        ints = {
            "total_pages",
            "free_pages",
            "running",
            "waiting",
            "page_size",
            "max_context",
            "vocab_size",
            "tp",
            "ep",
        }
        return cls(
            **{
                k: int(h[k]) if k in ints else h[k]
                for k in cls.__dataclass_fields__
                if k in h  # fields added later have defaults
            }
        )
