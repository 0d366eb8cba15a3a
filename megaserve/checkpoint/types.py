"""The loaded-checkpoint record every loader returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from megaserve.tokenizer import TextTokenizer


@dataclass(frozen=True)
class Checkpoint:
    """HF-style config dict, HF-named float tensors, and the tokenizer when one ships."""

    source: str
    config: dict
    tensors: dict[str, np.ndarray]
    tokenizer: TextTokenizer | None
    eos_token_ids: tuple[int, ...]
