"""Continuous batching: FCFS admission, chunked prefill interleaved with decode, preemption,
and in-flight prefix sharing between prompts admitted together.

Each iteration runs one decode step for the running batch and one prefill call holding
pieces of several prompts under a token budget (`prefill_chunk`, the worker's
`--prefill-chunk`). The call's rows are padded to its longest piece, so the budget bounds
the padded shape (rows bucket x token bucket), and the real tokens with it: an iteration's
prefill costs at most one full-width piece, which keeps decode streaming. Which prompts get
a piece (`StepConfig.prefill_pieces`): the oldest prefilling prompt always does; each later
one, in admission order, joins when its whole remainder fits the per-row cap of the call
with it added (it finishes in that call), so a short prompt admitted behind a long one gets
its first token in the next iteration, not after the long one. A prompt too long to finish
in a shared piece waits its turn (first come, first served), and long prompts prefill one
at a time at the full budget. A prompt whose next block an earlier one is still computing
sits out (in-flight prefix sharing, `_runnable`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from decode_service.sequence import SeqState, Sequence
from megaserve.errors import NoCapacity
from megaserve.finish import FinishReason
from megaserve.kv.allocator import PageAllocator
from megaserve.kv.pages import claim_pages
from megaserve.runner.buckets import StepConfig


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 64  # sequences in the decode batch
    max_waiting: int = 256  # queued requests beyond which admission says RESOURCE_EXHAUSTED
    # Prompt tokens one iteration's prefill call computes, padding included (the token
    # budget), so decode keeps streaming.
    prefill_chunk: int = 256
    # Prompts one prefill call takes at most (each row bucket is a set of programs to
    # compile; the budget may allow fewer: each row takes at least the smallest token bucket).
    prefill_rows: int = 4


@dataclass(frozen=True)
class PrefillPiece:
    """`tokens` of seq's prompt (and, after preemption, its output), from position `start`."""

    seq: Sequence
    start: int
    tokens: list[int]


@dataclass
class StepPlan:
    """What one engine iteration runs: prefill pieces of several prompts (one call), then
    one decode step."""

    prefill: list[PrefillPiece]
    decode: list[Sequence]


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, alloc: PageAllocator, step_cfg: StepConfig):
        """step_cfg: the runner's buckets, which say how the budget splits over rows."""
        self.cfg, self.alloc, self.step_cfg = cfg, alloc, step_cfg
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.ready: deque[Sequence] = deque()  # KV imported from a prefill worker
        self.preemptions = 0
        self.shared_inflight_blocks = 0  # blocks taken from prompts prefilled just before

    @property
    def page_size(self) -> int:
        return self.alloc.page_size

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_ready(self, seq: Sequence) -> None:
        """A sequence whose prompt KV is already in its pages; it joins the batch next plan."""
        self.ready.append(seq)

    def _slots(self) -> int:
        return self.cfg.max_running - len(self.running) - len(self.prefilling)

    def _admit(self) -> None:
        """Moves ready, then waiting sequences (FCFS) in while pages and batch slots allow."""
        while self.ready and self._slots() > 0:
            seq = self.ready.popleft()
            seq.state = SeqState.RUNNING
            self.running.append(seq)
        while self.waiting and len(self.running) + len(self.prefilling) < self.cfg.max_running:
            seq = self.waiting[0]
            try:
                pages, hit = claim_pages(self.alloc, seq.tokens)
            except NoCapacity:
                return  # head-of-line waits: FCFS
            self.waiting.popleft()
            seq.pages = pages
            seq.num_computed = hit * self.page_size
            seq.num_registered = hit
            if not seq.output:
                seq.num_cached_tokens = seq.num_computed
            seq.state = SeqState.PREFILL
            self.prefilling.append(seq)

    def _grow(self, seq: Sequence) -> bool:
        """Makes sure seq has a page for the KV its next step writes; preempts if the pool is full.

        A decode step writes the KV of the last token, at position len(tokens) - 1.
        """
        while seq.pages_needed(len(seq.tokens), self.page_size) > 0:
            try:
                seq.pages += self.alloc.allocate(1)
            except NoCapacity:
                victim = self._pick_victim(exclude=seq)
                if victim is None:
                    return False
                self.preempt(victim)
        return True

    def _pick_victim(self, exclude: Sequence) -> Sequence | None:
        """The most recently arrived sequence holding pages (vLLM's recompute policy)."""
        holders = [s for s in [*self.running, *self.prefilling] if s is not exclude and s.pages]
        return max(holders, key=lambda s: s.arrival_step) if holders else None

    def preempt(self, seq: Sequence) -> None:
        """Frees seq's pages; it re-enters the queue front and recomputes prompt + output."""
        self.alloc.release(seq.pages)
        seq.pages, seq.num_computed, seq.num_registered = [], 0, 0
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def plan(self) -> StepPlan:
        self._admit()
        # Decode pages first: growing may preempt a prefilling sequence, which then has
        # no piece this iteration.
        decode = []
        for seq in list(self.running):
            if seq in self.running and self._grow(seq):
                decode.append(seq)
        decode = [s for s in decode if s in self.running]
        return StepPlan(self._pieces(), decode)

    def _pieces(self) -> list[PrefillPiece]:
        """This iteration's prefill pieces under the token budget (the rule: module doc)."""
        seqs = self._runnable()
        sizes = self.step_cfg.prefill_pieces([len(s.tokens) - s.num_computed for s in seqs])
        return [
            PrefillPiece(s, s.num_computed, s.tokens[s.num_computed : s.num_computed + n])
            for s, n in zip(seqs, sizes)
            if n > 0
        ]

    def _runnable(self) -> list[Sequence]:
        """The prefilling sequences that may compute this iteration, oldest first. Each
        first takes the blocks an earlier prompt has registered since it was admitted
        (`share_computed`); one whose next block an earlier prompt in flight is still to
        compute sits out, to take that block once registered, so no two rows of a call
        compute the same KV. The oldest never waits."""
        ps, pending, out = self.page_size, set(), []
        for seq in self.prefilling:
            self.share_computed(seq)
            shareable = (len(seq.tokens) - 1) // ps  # the last token's block is never taken
            nxt = seq.num_computed // ps
            hashes = seq.block_hashes(shareable, ps) if nxt < shareable else []
            if seq.num_computed % ps == 0 and hashes and hashes[nxt] in pending:
                continue
            pending.update(hashes[nxt:])
            out.append(seq)
        return out

    def prefill_done(self, seq: Sequence, n: int) -> bool:
        """Records n computed prompt tokens; True when the prompt is complete."""
        seq.num_computed += n
        self.register_full_pages(seq)
        if seq.num_computed < len(seq.tokens):
            return False
        self.prefilling.remove(seq)
        seq.state = SeqState.RUNNING
        self.running.append(seq)
        return True

    def share_computed(self, seq: Sequence) -> int:
        """Takes the blocks of seq's prompt that another sequence computed since seq was
        admitted (its prefix was in flight then), instead of computing them again.

        A prompt whose next block an earlier prompt is still computing sits out
        (`_runnable`), so the blocks it can take are registered before it computes them.
        Only whole leading blocks are taken, and never the last token's (its logits are
        needed).
        Returns the number of blocks taken.
        """
        ps, done = self.page_size, seq.num_registered
        if seq.num_computed != done * ps:  # mid-block: what follows is this sequence's own
            return 0
        n_full = (len(seq.prompt) + len(seq.output) - 1) // ps
        if n_full <= done or self.alloc.by_hash.get(seq.block_hashes(done + 1, ps)[done]) is None:
            return 0
        hashes, i = seq.block_hashes(n_full, ps), done
        while i < n_full:
            page = self.alloc.by_hash.get(hashes[i])
            if page is None or page == seq.pages[i]:
                break
            self.alloc.acquire([page])
            self.alloc.release([seq.pages[i]])  # a fresh page with no content: back to free
            seq.pages[i] = page
            i += 1
        taken = i - done
        seq.num_computed, seq.num_registered = i * ps, i
        if not seq.output:
            seq.num_cached_tokens = seq.num_computed
        self.shared_inflight_blocks += taken
        return taken

    def register_full_pages(self, seq: Sequence) -> None:
        """Publishes newly completed pages to the prefix cache."""
        full = seq.num_computed // self.page_size
        if full <= seq.num_registered:
            return
        hashes = seq.block_hashes(full, self.page_size)
        for i in range(seq.num_registered, full):
            self.alloc.register(seq.pages[i], hashes[i])
        seq.num_registered = full

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Releases seq's pages (full pages stay cached for reuse) and drops it."""
        seq.finish_reason, seq.state = reason, SeqState.FINISHED
        for q in (self.running,):
            if seq in q:
                q.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.ready:
            self.ready.remove(seq)
        self.alloc.release(seq.pages)
        seq.pages = []
