"""How the decode engine's tokens and endings reach each request's sink (engine thread)."""

from __future__ import annotations

from decode_service.events import TokenEvent
from decode_service.sequence import Sequence
from megaserve.finish import FinishReason


class Emission:
    """Mixed into DecodeEngine (its scheduler, sinks and step count). `logprobs`: the new
    tokens' entries; `prompt_logprobs`: the prompt's, with a request's first token."""

    def _emit(
        self,
        seq: Sequence,
        new: list[int],
        first: bool = False,
        logprobs=None,
        prompt_logprobs=None,
    ) -> None:
        seq.output.extend(new)
        reason = None
        if new[-1] in seq.stop_ids:
            reason = FinishReason.STOP
        elif len(seq.output) >= seq.max_tokens:
            reason = FinishReason.LENGTH
        if reason:
            self._finish(seq, reason, new, first, logprobs, prompt_logprobs)
        else:
            self._send(seq, new, None, first, logprobs, prompt_logprobs)

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        new: list[int],
        first: bool = False,
        logprobs=None,
        prompt_logprobs=None,
    ) -> None:
        self.sched.finish(seq, reason)
        self._send(seq, new, reason, first, logprobs, prompt_logprobs)
        self._forget(seq.request_id)

    def _send(
        self,
        seq: Sequence,
        new: list[int],
        reason: FinishReason | None,
        first: bool,
        logprobs=None,
        prompt_logprobs=None,
    ) -> None:
        if first:
            self.cached_prompt_tokens += seq.num_cached_tokens
        sink = self._sinks.get(seq.request_id)
        if sink is None:
            return
        sink(
            TokenEvent(
                seq.request_id,
                new,
                reason,
                self.steps,
                len(seq.prompt) if first else 0,
                seq.num_cached_tokens if first else 0,
                logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        )

    def _fail(self, seq: Sequence, msg: str) -> None:
        self.sched.finish(seq, FinishReason.ERROR)
        sink = self._sinks.get(seq.request_id)
        if sink is not None:
            sink(TokenEvent(seq.request_id, [], FinishReason.ERROR, self.steps, error=msg))
        self._forget(seq.request_id)
