"""A strict safetensors reader: validates the header against the file before any tensor is used."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from megaserve.errors import CheckpointError

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: its file, dtype, shape and absolute byte offset."""

    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of the first byte, from the start of the file

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Name -> TensorInfo of every tensor, checked against the file's size; reads only the
    header. CheckpointError naming what is wrong."""
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"{path}: file is {size} bytes, too short for a safetensors header")
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(_DTYPES[info["dtype"]])
            shape = tuple(int(s) for s in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: bad header entry for tensor {name!r}: {info!r}") from e
        want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - start != want or start < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r} {info['dtype']}{list(shape)} needs {want} bytes, "
                f"header gives [{start}, {end})"
            )
        if base + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} ends at byte {base + end}, file has {size}"
            )
        out[name] = TensorInfo(path, dtype, shape, base + start)
    return out


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Returns name -> array (memory-mapped); raises CheckpointError naming what is wrong."""
    infos = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r") if infos else np.zeros(0, np.uint8)
    out: dict[str, np.ndarray] = {}
    for name, t in infos.items():
        raw = data[t.offset : t.offset + t.nbytes] if t.nbytes else np.zeros(0, np.uint8)
        out[name] = raw.view(t.dtype).reshape(t.shape)
    return out
