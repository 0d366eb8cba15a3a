"""Per-request sampling parameters: the one type every tier validates, converts to and from
both protos, and turns into the per-row arrays the device programs read."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from megaserve.errors import RequestError

MAX_LOGPROBS = 20  # top-n log-probabilities per token, every tier's limit


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 disable their filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(f"temperature={self.temperature} must be finite and >= 0")
        if self.top_k < 0:
            raise RequestError(f"top_k={self.top_k} must be >= 0 (0 disables)")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p={self.top_p} must be in (0, 1]")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise RequestError(f"min_p={self.min_p} must be in [0, 1]")
        if not 0 <= self.seed < 2**32:
            raise RequestError(f"seed={self.seed} must be in [0, 2**32)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2 <= v <= 2):
                raise RequestError(f"{name}={v} must be in [-2, 2]")
        r = self.repetition_penalty
        if not (math.isfinite(r) and 0 < r <= 10):
            raise RequestError(f"repetition_penalty={r} must be in (0, 10]")

    @property
    def penalized(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @classmethod
    def from_proto(cls, p, seed: int | None = None, prefix: str = "") -> SamplingParams:
        """Validated params from either proto's SamplingParams (the public and the internal
        message have the same fields). Unset top_p and repetition_penalty (0) mean disabled;
        `seed` overrides the message's; errors name the field as `prefix` + name."""
        try:
            return cls(
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=1.0 if p.top_p == 0 else p.top_p,
                min_p=p.min_p,
                seed=p.seed if seed is None else seed,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                repetition_penalty=1.0 if p.repetition_penalty == 0 else p.repetition_penalty,
            )
        except RequestError as e:
            raise RequestError(f"{prefix}{e}") from None

    def to_proto(self, message_cls):
        """This as a `message_cls` (decode_pb2.SamplingParams or the public one)."""
        return message_cls(**dataclasses.asdict(self))


# Device dtype of each column; every other field is an f32 column.
_INT_COLUMNS = {"top_k": np.int32, "seed": np.uint32}
_COLUMNS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_DEFAULT = SamplingParams()  # what padding rows carry


def _dtype(name: str):
    return _INT_COLUMNS.get(name, np.float32)


@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters as host arrays, one column per SamplingParams field.

    `counts`/`seen` are only built when some row uses a penalty: the runner then applies
    them in a separate small `pick` program on the step's logits, so unpenalized batches
    pay nothing and the decode/prefill program sets do not double.
    """

    columns: dict[str, np.ndarray]  # field name -> [B] array (f32, top_k i32, seed u32)
    counts: np.ndarray | None = None  # i32[B, V] occurrences of each token in the output
    seen: np.ndarray | None = None  # bool[B, V] token appears in prompt or output

    @property
    def rows(self) -> int:
        return len(self.columns["temperature"])

    @classmethod
    def greedy(cls, batch: int) -> SamplingArrays:
        return cls.build([_DEFAULT] * batch)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        histories: list[tuple[list[int], list[int]]] | None = None,
        vocab: int = 0,
    ) -> SamplingArrays:
        """params: one per row; histories: (prompt, output) per row, needed for penalties."""
        cols = {k: np.array([getattr(p, k) for p in params], _dtype(k)) for k in _COLUMNS}
        counts = seen = None
        if any(p.penalized for p in params):
            assert histories is not None and vocab > 0, "penalties need token histories"
            counts = np.zeros((len(params), vocab), np.int32)
            seen = np.zeros((len(params), vocab), bool)
            for i, (prompt, output) in enumerate(histories):
                np.add.at(counts[i], np.asarray(output, np.int64), 1)
                seen[i, np.asarray(prompt + output, np.int64)] = True
        return cls(cols, counts=counts, seen=seen)

    def without_counts(self) -> SamplingArrays:
        """The same rows with no penalty state (what the decode/prefill programs take)."""
        return SamplingArrays(self.columns)

    def with_zero_counts(self, vocab: int) -> SamplingArrays:
        """The same rows with empty penalty state: the shapes of a penalized call."""
        counts = np.zeros((self.rows, vocab), np.int32)
        return SamplingArrays(self.columns, counts, np.zeros((self.rows, vocab), bool))

    def counted(self, tokens: np.ndarray) -> SamplingArrays:
        """Penalty state after each row emitted tokens[row] (i32[rows])."""
        if self.counts is None:
            return self
        rows, tokens = np.arange(self.rows), np.asarray(tokens)[: self.rows]
        counts, seen = self.counts.copy(), self.seen.copy()
        counts[rows, tokens] += 1
        seen[rows, tokens] = True
        return SamplingArrays(self.columns, counts, seen)

    def padded(self, b: int) -> dict[str, np.ndarray]:
        """The columns padded to b rows with default (greedy, unpenalized) rows."""
        n = b - self.rows
        out = {
            k: np.concatenate([v, np.full(n, getattr(_DEFAULT, k), _dtype(k))])
            for k, v in self.columns.items()
        }
        if self.counts is not None:
            v = self.counts.shape[1]
            out["counts"] = np.concatenate([self.counts, np.zeros((n, v), np.int32)])
            out["seen"] = np.concatenate([self.seen, np.zeros((n, v), bool)])
        return out
