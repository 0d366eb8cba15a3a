"""grpc.aio servers on a background event-loop thread (benchmarks and tests in one process)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable


class ServerThread:
    """Starts servers from `factories` (each an async () -> (server, port, ...)) on one loop.

    `addresses` lists "127.0.0.1:port" in factory order; `stop()` stops them and the loop.
    """

    def __init__(self, *factories: Callable[[], Awaitable[tuple]], timeout: float = 60.0):
        self.loop = asyncio.new_event_loop()
        self.servers: list = []
        self.results: list[tuple] = []
        ready = threading.Event()
        failure: list[BaseException] = []

        def run():
            asyncio.set_event_loop(self.loop)
            try:
                for make in factories:
                    out = self.loop.run_until_complete(make())
                    self.results.append(out)
                    self.servers.append(out[0])
            except BaseException as e:  # surfaced in the constructor's thread
                failure.append(e)
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        if not ready.wait(timeout):
            raise TimeoutError("servers did not start")
        if failure:
            raise failure[0]
        self.addresses = [f"127.0.0.1:{r[1]}" for r in self.results]

    def stop(self, grace: float = 0) -> None:
        for s in self.servers:
            asyncio.run_coroutine_threadsafe(s.stop(grace), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
