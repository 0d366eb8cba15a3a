"""For tests that drive the router's `Dispatcher` directly, without a router process: a view
of a worker at an address, and a job of prompt token ids (greedy, EOS ignored)."""

from __future__ import annotations

from types import SimpleNamespace

from megaserve.rpc import decode_pb2
from megaserve.state_keys import WorkerInfo
from router.frontend import Job
from router.worker_view import WorkerView


def worker_view(
    worker_id: str, role: str, address: str, page_size: int = 16, max_context: int = 512
) -> WorkerView:
    """A worker of model "m" with 64 free pages of 64, nothing running, vocabulary 384."""
    info = WorkerInfo(worker_id, role, address, "m", 64, 64, 0, 0, page_size, max_context, 384)
    return WorkerView(info)


def job(request_id: str, prompt: list[int], max_tokens: int) -> Job:
    return Job(request_id, SimpleNamespace(name="m"), prompt, decode_pb2.SamplingParams(),
               max_tokens, (), (), True, "")  # fmt: skip
