"""Log-probabilities in the public API: the decode tier's per-token entries, with texts and
the request's top_n alternatives."""

from __future__ import annotations

from megaserve.rpc import decode_pb2
from megaserve.v1 import generation_pb2 as pb
from router.frontend import Job


def public_logprobs(job: Job, worker: list[decode_pb2.TokenLogprobs]) -> list[pb.TokenLogprob]:
    """One TokenLogprob per generated token ([] when the request asked for none)."""
    if job.logprobs is None:
        return []
    text = job.model.tokenizer.decode

    def top(lp: decode_pb2.TokenLogprobs) -> list[pb.TopLogprob]:
        pairs = list(zip(lp.top_token_ids, lp.top_logprobs))[: job.logprobs]
        return [pb.TopLogprob(token_id=i, token=text([i]), logprob=v) for i, v in pairs]

    return [
        pb.TokenLogprob(
            token_id=lp.token_id, token=text([lp.token_id]), logprob=lp.logprob, top=top(lp)
        )
        for lp in worker
    ]
