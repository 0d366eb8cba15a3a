"""Bad checkpoints and bad requests fail with errors that name the problem."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from megaserve.checkpoint import load_checkpoint, resolve_checkpoint_path
from megaserve.checkpoint.safetensors_file import read_safetensors
from megaserve.errors import CheckpointError, RequestError
from megaserve.model import LoadedModel
from megaserve.offline import OfflineGenerator
from tests.conftest import random_tensors, tiny_llama_config


def _write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


@pytest.fixture
def hf_dir(tmp_path):
    cfg = tiny_llama_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _write_safetensors(tmp_path / "model.safetensors", random_tensors(cfg))
    return tmp_path


def test_hf_dir_loads(hf_dir):
    m = LoadedModel.load(str(hf_dir), progress=False)
    assert m.cfg.num_layers == 2


def test_truncated_safetensors(hf_dir):
    f = hf_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated: tensor"):
        load_checkpoint(str(hf_dir), progress=False)


def test_corrupt_safetensors_header(hf_dir):
    f = hf_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[10:20] = b"\xff" * 10
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        read_safetensors(f)


def test_absurd_header_length(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        read_safetensors(f)


def test_missing_shard(hf_dir):
    idx = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="shard files missing"):
        load_checkpoint(str(hf_dir), progress=False)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("model_type", "gpt_neox", "model_type 'gpt_neox' is not supported"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("mlp_bias", True, "mlp_bias=True"),
        ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}, "rope type 'longrope'"),
        ("layer_types", ["sliding_attention", "full_attention"], "sliding_attention"),
        ("use_sliding_window", True, "use_sliding_window=True"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ],
)
def test_unsupported_config_field(hf_dir, field, value, match):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg[field] = value
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        LoadedModel.load(str(hf_dir), progress=False)


def test_wrong_tensor_shape(hf_dir):
    t = random_tensors(tiny_llama_config())
    t["model.norm.weight"] = np.ones(7, np.float32)
    _write_safetensors(hf_dir / "model.safetensors", t)
    with pytest.raises(CheckpointError, match="'model.norm.weight' has shape"):
        LoadedModel.load(str(hf_dir), progress=False)


def test_unexpected_tensor(hf_dir):
    t = random_tensors(tiny_llama_config()) | {"model.layers.0.mystery.weight": np.ones(3)}
    _write_safetensors(hf_dir / "model.safetensors", t)
    with pytest.raises(CheckpointError, match="mystery"):
        LoadedModel.load(str(hf_dir), progress=False)


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_checkpoint_path("smollm2")


def test_truncated_gguf(tmp_path, gguf_path):
    f = tmp_path / "cut.gguf"
    with gguf_path.open("rb") as src:
        f.write_bytes(src.read(gguf_path.stat().st_size // 2))
    with pytest.raises(CheckpointError, match=r"cut\.gguf"):
        load_checkpoint(str(f), progress=False)


def test_gguf_with_bad_magic(tmp_path, gguf_path):
    f = tmp_path / "bad.gguf"
    shutil.copy(gguf_path, f)
    with f.open("r+b") as h:
        h.write(b"NOPE")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_checkpoint(str(f), progress=False)


def test_gguf_with_corrupt_header(tmp_path, gguf_path):
    f = tmp_path / "hdr.gguf"
    with gguf_path.open("rb") as src:
        data = bytearray(src.read(4096))
    data[8:16] = struct.pack("<Q", 2**40)  # tensor count far beyond the file
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="hdr.gguf"):
        load_checkpoint(str(f), progress=False)


def test_missing_path():
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint("/nonexistent/model")


def test_request_errors(tiny_model):
    gen = OfflineGenerator(tiny_model, max_context=64)
    with pytest.raises(RequestError, match=r"\[96, -1\] are outside the vocabulary \[0, 96\)"):
        gen.generate([1, 96, -1], 4)
    with pytest.raises(RequestError, match="exceeds the context length 64"):
        gen.generate(list(range(60)), 8)
    with pytest.raises(RequestError, match="max_new_tokens=0"):
        gen.generate([1, 2], 0)
    with pytest.raises(RequestError, match="prompt is empty"):
        gen.generate([], 3)
