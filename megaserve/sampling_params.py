"""Per-request sampling and stopping parameters, validated at the edge."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megaserve.errors import RequestError


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
            raise RequestError(f"temperature={self.temperature} must be a finite number >= 0")
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

    def as_row(self) -> dict:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence": self.presence_penalty,
            "frequency": self.frequency_penalty,
            "repetition": self.repetition_penalty,
        }
