"""One jax.experimental.transfer server per process, cached connections to peers, and the
bookkeeping that lets a sender take back offers no peer will pull."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable

import jax

_lock = threading.Lock()
_server = None
_conns: dict[str, object] = {}
_ids = itertools.count(1)
# Offers made here and not yet settled: uuid -> what a pull of it must ask for.
_offered: dict[int, list[jax.ShapeDtypeStruct]] = {}


def server(bind: str = "127.0.0.1:0"):
    """This process's transfer server (started on first use)."""
    global _server
    with _lock:
        if _server is None:
            from jax.experimental import transfer

            client = jax.devices()[0].client
            host = bind.rsplit(":", 1)[0]
            _server = transfer.start_transfer_server(client, bind, [f"{host}:0"])
        return _server


def offer(arrays: list[jax.Array]) -> tuple[str, int]:
    """Makes arrays pullable once; returns (address, uuid). The server holds them until
    pulled: `settle` once a peer has pulled them, `withdraw` if no peer will."""
    s = server()
    uuid = next(_ids)
    with _lock:
        _offered[uuid] = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    s.await_pull(uuid, arrays)
    return s.address(), uuid


def outstanding() -> set[int]:
    """The uuids offered here and neither settled nor withdrawn."""
    with _lock:
        return set(_offered)


def settle(uuids: Iterable[int]) -> None:
    """A peer pulled these offers (or may have: they are left to the server)."""
    with _lock:
        for u in uuids:
            _offered.pop(u, None)


def withdraw(uuids: Iterable[int], wait: bool = True) -> None:
    """Takes back offers no peer has pulled or will pull, by pulling them here: jax's
    await_pull has no withdrawal, and the server holds offered arrays until one pull. Only
    for uuids known unpulled: a second pull of a pulled uuid never returns (seen with jax
    0.12.0.1), so a uuid a peer may have started to pull must be settled instead. The
    records go at once; wait=False pulls in a thread of its own."""
    with _lock:
        specs = {u: _offered.pop(u) for u in uuids if u in _offered}
    if not specs:
        return
    if not wait:
        threading.Thread(target=_pull_back, args=(specs,), daemon=True).start()
        return
    _pull_back(specs)


def _pull_back(specs: dict[int, list[jax.ShapeDtypeStruct]]) -> None:
    address = server().address()
    for u, spec in specs.items():
        jax.block_until_ready(pull(address, u, [s.shape for s in spec], spec[0].dtype))


def pull(address: str, uuid: int, shapes: list[tuple[int, ...]], dtype) -> list[jax.Array]:
    """Pulls the arrays offered under uuid by a peer (one round trip for all of them) into
    this process's default device."""
    with _lock:
        conn = _conns.get(address)
    if conn is None:
        conn = server().connect(address)
        with _lock:
            _conns[address] = conn
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return conn.pull(uuid, [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in shapes])
