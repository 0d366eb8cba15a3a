"""The decode engine's prefill step (pieces of several prompts in one call), and prompt
log-probabilities: each prompt token's log-probability given the tokens before it, scored
chunk by chunk as the prompt prefills, prefix-cache hits included."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from decode_service.events import TokenLogprobs, top_logprobs
from decode_service.scheduler import PrefillPiece
from decode_service.sequence import Sequence
from megaserve.errors import RequestError
from megaserve.kv.pages import pages_for_tokens
from megaserve.runner.base import PositionLogprobs
from megaserve.runner.batch import TokenBatch
from megaserve.sampling_params import SamplingArrays


@dataclass
class PromptScoring:
    """One request's prompt log-probabilities so far: `entries[p]` scores prompt token p + 1
    from the logits at position p (the last position's scores the first generated token)."""

    top_n: int  # alternatives per entry, 0..MAX_LOGPROBS
    entries: list[TokenLogprobs] = field(default_factory=list)
    sent: bool = False  # handed out with the first token: later prefills (preemption) skip it

    @property
    def cursor(self) -> int:
        """Positions scored: 0..cursor-1."""
        return len(self.entries)

    @staticmethod
    def targets(prompt: list[int], start: int, n: int) -> np.ndarray:
        """i32[n]: the token after each of positions start..start+n-1 (0 past the prompt)."""
        out = np.zeros(n, np.int32)
        nxt = prompt[start + 1 : start + n + 1]
        out[: len(nxt)] = nxt
        return out

    def record(self, prompt: list[int], start: int, n: int, out: PositionLogprobs) -> None:
        """Keeps the entries of positions start..start+n-1 (row 0 of `out`) not scored yet."""
        k = self.top_n
        for p in range(self.cursor, min(start + n, len(prompt) - 1)):
            c = p - start
            ids, vals = out.top_ids[0, c, :k].tolist(), out.top[0, c, :k].tolist()
            self.entries.append((prompt[p + 1], float(out.target[0, c]), ids, vals))

    def take(self) -> list[TokenLogprobs] | None:
        """The entries, once (None after)."""
        if self.sent:
            return None
        self.sent = True
        return self.entries


class PrefillStep:
    """Mixed into DecodeEngine (its runner, scheduler, allocator, config, `_scoring` map)."""

    def _run_prefills(self, pieces: list[PrefillPiece]) -> None:
        """The plan's prefill pieces: the plain ones in one runner call (one row each), each
        piece still scoring its prompt's log-probabilities in a call of its own (the scoring
        program takes one sequence, padded to `logprob_chunk`; such requests are rare).

        A call that raises fails the requests of its rows only (`_guarded`; every request
        when it lost the pool): the other calls' rows never depended on it."""
        plain, scored = [], []
        for p in pieces:
            (scored if self._scores(p.seq) else plain).append(p)
        if plain:
            self._guarded([p.seq for p in plain], self._run_prefill, plain)
        for p in scored:
            if p.seq.request_id in self._live:  # not ended by a call that lost the pool
                self._guarded([p.seq], self._run_scored_prefill, p)

    def _scores(self, seq: Sequence) -> bool:
        """Whether seq's prompt log-probabilities are still to be handed out."""
        sc = self._scoring.get(seq.request_id)
        return sc is not None and not sc.sent

    def _run_prefill(self, pieces: list[PrefillPiece]) -> None:
        """Plain pieces of several sequences, one row each, in one prefill call."""
        batch = TokenBatch.from_rows([(p.tokens, p.start, p.seq.pages) for p in pieces])
        nxt, logits = self.runner.prefill(batch, self._rows([p.seq for p in pieces]))
        for i, p in enumerate(pieces):
            self._piece_done(p, int(nxt[i]), logits[i])

    def _run_scored_prefill(self, piece: PrefillPiece) -> None:
        seq = piece.seq
        out = self._scored_prefill(seq, self._scoring[seq.request_id], piece.tokens, piece.start)
        if out is not None:  # None: prefix-cache hits were scored instead; offered again
            self._piece_done(piece, int(out[0][0]), out[1][0])

    def _piece_done(self, piece: PrefillPiece, tok: int, logits: np.ndarray) -> None:
        """Records a computed piece; a prompt's last emits its first (or, after preemption,
        its next) token, sampled from the piece's last position."""
        seq = piece.seq
        self.prefill_tokens += len(piece.tokens)
        if self.sched.prefill_done(seq, len(piece.tokens)):
            first = not seq.output
            lps = [top_logprobs(logits, tok, seq.logprobs)] if seq.logprobs else None
            self._emit(seq, [tok], first, lps, self._prompt_entries(seq.request_id))

    @staticmethod
    def _check_scoring(request_id: str, attaching: bool, top_n: int | None) -> None:
        """RequestError for prompt log-probabilities of a request whose KV is imported."""
        if attaching and top_n is not None:
            raise RequestError(
                f"request_id {request_id!r}: prompt log-probabilities need the prompt "
                "prefilled here, not KV imported from a prefill worker"
            )

    def _prompt_entries(self, request_id: str) -> list[TokenLogprobs] | None:
        """The request's prompt entries, with its first token (once; None if not asked)."""
        sc = self._scoring.get(request_id)
        return None if sc is None else sc.take()

    def _scored_prefill(
        self, seq: Sequence, sc: PromptScoring, chunk: list[int], start: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The plan's prefill chunk through the scoring program, recording its positions'
        entries; None (the chunk not run: the plan offers it again) while positions before
        `start` (prefix-cache hits) are still unscored: one chunk of them runs instead."""
        if start > sc.cursor:
            self._score_cached(seq, sc, start)
            return None
        batch = TokenBatch.from_rows([(chunk, start, seq.pages)])
        targets = sc.targets(seq.prompt, start, len(chunk))
        nxt, logits, out = self.runner.prefill_with_logprobs(batch, self._rows([seq]), targets)
        sc.record(seq.prompt, start, len(chunk), out)
        return nxt, logits

    def _score_cached(self, seq: Sequence, sc: PromptScoring, start: int) -> None:
        """Scores one chunk of the positions before `start` whose KV the prefix cache gave.

        Those pages are shared (other sequences read them; their hashes name their content),
        so they are never written: the chunk starts at its page's start and writes its K/V
        into scratch pages, attending over the cached pages before it, then frees them. A
        short pool gives a shorter chunk; none to spare, it waits (decode goes on, and
        finishing requests free pages)."""
        ps = self.cfg.page_size
        c0 = sc.cursor // ps * ps
        pages = min(self.runner.logprob_chunk // ps, self.alloc.num_available)
        n = min(start - c0, pages * ps)  # whole pages: start and c0 are page starts
        if n == 0:
            return
        scratch = self.alloc.allocate(pages_for_tokens(n, ps))
        try:
            pages = list(seq.pages[: c0 // ps]) + scratch
            batch = TokenBatch.from_rows([(seq.prompt[c0 : c0 + n], c0, pages)])
            targets = sc.targets(seq.prompt, c0, n)
            _, _, out = self.runner.prefill_with_logprobs(batch, SamplingArrays.greedy(1), targets)
        finally:
            self.alloc.release(scratch)  # unhashed: back to free
        sc.record(seq.prompt, c0, n, out)
