"""Log-probabilities in the public API: the decode tier's per-token entries (generated tokens,
and prompt tokens on the first message), with texts and the request's top-n alternatives."""

from __future__ import annotations

from megaserve.rpc import decode_pb2
from megaserve.v1 import generation_pb2 as pb
from router.frontend import Job


def _public(job: Job, worker: list[decode_pb2.TokenLogprobs], n: int) -> list[pb.TokenLogprob]:
    text = job.model.tokenizer.decode

    def top(lp: decode_pb2.TokenLogprobs) -> list[pb.TopLogprob]:
        pairs = list(zip(lp.top_token_ids, lp.top_logprobs))[:n]
        return [pb.TopLogprob(token_id=i, token=text([i]), logprob=v) for i, v in pairs]

    return [
        pb.TokenLogprob(
            token_id=lp.token_id, token=text([lp.token_id]), logprob=lp.logprob, top=top(lp)
        )
        for lp in worker
    ]


def public_logprobs(job: Job, worker: list[decode_pb2.TokenLogprobs]) -> list[pb.TokenLogprob]:
    """One TokenLogprob per generated token ([] when the request asked for none)."""
    if job.logprobs is None:
        return []
    return _public(job, worker, job.logprobs)


def public_prompt_logprobs(
    job: Job, worker: list[decode_pb2.TokenLogprobs]
) -> list[pb.TokenLogprob]:
    """One TokenLogprob per prompt token after the first, on the first message ([] on the
    others, and when the request asked for none)."""
    if job.prompt_logprobs is None:
        return []
    return _public(job, worker, job.prompt_logprobs)
