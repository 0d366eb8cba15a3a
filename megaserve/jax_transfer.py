"""One jax.experimental.transfer server per process, and cached connections to peers."""

from __future__ import annotations

import itertools
import threading

import jax

_lock = threading.Lock()
_server = None
_conns: dict[str, object] = {}
_ids = itertools.count(1)


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
    """Makes arrays pullable once; returns (address, uuid). The server holds them until pulled."""
    s = server()
    uuid = next(_ids)
    s.await_pull(uuid, arrays)
    return s.address(), uuid


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
