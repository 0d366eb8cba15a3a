"""Hugging Face checkpoint directories: config, (sharded) safetensors, tokenizer, EOS ids."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megaserve.checkpoint.safetensors_file import TensorInfo, read_header, read_safetensors
from megaserve.checkpoint.types import Checkpoint
from megaserve.errors import CheckpointError
from megaserve.progress import Progress


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (d / f).exists()]
        if missing:
            raise CheckpointError(f"{index}: shard files missing: {missing}")
        return [d / f for f in files]
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(d.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{d}: no *.safetensors weights (pytorch .bin is not supported)")
    return found


def eos_ids(d: Path, config: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (an int or a list in either)."""
    gen = d / "generation_config.json"
    value = _read_json(gen).get("eos_token_id") if gen.exists() else None
    if value is None:
        value = config.get("eos_token_id")
    if value is None:
        return ()
    return tuple(int(x) for x in (value if isinstance(value, list) else [value]))


def _config(d: Path) -> dict:
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{d}: no config.json")
    return _read_json(cfg_path)


def _tokenizer(d: Path):
    if not (d / "tokenizer.json").exists():
        return None
    from megaserve.tokenizer import TextTokenizer

    return TextTokenizer.from_hf_dir(d)


def load_hf_dir(d: Path, progress: bool = True) -> Checkpoint:
    """Loads config.json, safetensors weights and tokenizer files from an HF directory."""
    config = _config(d)
    files = _weight_files(d)
    tensors: dict[str, np.ndarray] = {}
    bar = Progress(f"loading {d.name}", len(files), enabled=progress and len(files) > 1)
    for i, f in enumerate(files):
        for name, arr in read_safetensors(f).items():
            if name in tensors:
                raise CheckpointError(f"{f}: tensor {name!r} appears in two shards")
            tensors[name] = arr
        bar.update(i + 1)
    return Checkpoint(str(d), config, tensors, _tokenizer(d), eos_ids(d, config))


def load_hf_meta(d: Path) -> Checkpoint:
    """An HF directory's config, tokenizer and EOS ids with no tensors (`tensors` is empty):
    for a loader that reads the weights itself (`megaserve.checkpoint.sharded`)."""
    config = _config(d)
    return Checkpoint(str(d), config, {}, _tokenizer(d), eos_ids(d, config))


def tensor_index(d: Path) -> dict[str, TensorInfo]:
    """Name -> where its bytes lie, over every safetensors file of an HF directory; reads
    only the headers. CheckpointError naming a tensor found in two files."""
    out: dict[str, TensorInfo] = {}
    for f in _weight_files(d):
        for name, info in read_header(f).items():
            if name in out:
                raise CheckpointError(f"{f}: tensor {name!r} appears in two shards")
            out[name] = info
    return out
