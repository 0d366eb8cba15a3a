"""Tensor-parallel params read straight from safetensors: each process reads its blocks only."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from kernels.kv_cache import lane_padded
from kernels.llama import LlamaConfig
from kernels.tp_llama import TpLayout, kv_heads_of, param_specs
from megaserve.checkpoint.hf import tensor_index
from megaserve.checkpoint.safetensors_file import TensorInfo
from megaserve.errors import CheckpointError

CHUNK_BYTES = 4 << 20  # whole source rows read at once, at most (one row where that is more)
# A chunk's peak: the bytes read, their f32 copy (twice them from a 16-bit file) and the
# serving-dtype copy: 4 x CHUNK_BYTES.
CHUNK_PEAK = 4 * CHUNK_BYTES

Range = tuple[int, int]  # [start, stop) along one dimension


class TensorFiles:
    """HF-named tensors of safetensors files, read by row ranges with os.preadv (no memmap);
    checks shapes and remembers what was used, as `kernels.llama.TensorSource` does."""

    def __init__(self, index: dict[str, TensorInfo]):
        self.index = index
        self.used: set[str] = set()
        self._fds: dict[Path, int] = {}

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def need(self, name: str, shape: tuple[int, ...]) -> str:
        """`name`, marked used, once checked to exist with `shape`; ValueError naming it."""
        if name not in self.index:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        if self.index[name].shape != shape:
            raise ValueError(
                f"tensor {name!r} has shape {self.index[name].shape}, expected {shape}"
            )
        self.used.add(name)
        return name

    def check_all_used(self) -> None:
        extra = sorted(
            n for n in self.index if n not in self.used and not n.endswith("rotary_emb.inv_freq")
        )
        if extra:
            raise ValueError(f"checkpoint has tensors this model does not use: {extra[:5]}")

    def row_bytes(self, name: str) -> int:
        t = self.index[name]
        return t.nbytes // t.shape[0] if t.shape and t.shape[0] else t.nbytes

    def rows(self, name: str, a: int, b: int) -> np.ndarray:
        """Rows a:b of tensor `name` (elements, of a vector) in its file's dtype: [b - a, ...]."""
        t = self.index[name]
        buf = np.empty((b - a) * self.row_bytes(name), np.uint8)
        fd = self._fds.get(t.path)
        if fd is None:
            fd = self._fds[t.path] = os.open(t.path, os.O_RDONLY)
        view, start, done = memoryview(buf), t.offset + a * self.row_bytes(name), 0
        while done < len(buf):
            n = os.preadv(fd, [view[done:]], start + done)
            if n <= 0:
                raise CheckpointError(f"{t.path}: short read of {name!r} at byte {start + done}")
            done += n
        return buf.view(t.dtype).reshape((b - a, *t.shape[1:]))

    def copy(
        self, out: np.ndarray, name: str, rows: Range, cols: Range | None = None, t=False
    ) -> None:
        """out <- tensor[rows, cols] (its transpose when t), through f32 into out.dtype as
        `TensorSource.get` and `finish_params` cast: at most CHUNK_BYTES of whole rows read
        at a time, so a column slice costs one chunk, not the tensor."""
        step = max(CHUNK_BYTES // max(self.row_bytes(name), 1), 1)
        for r in range(rows[0], rows[1], step):
            e = min(r + step, rows[1])
            piece = self.rows(name, r, e)  # [e - r, ...] in the file's dtype
            if cols is not None:
                piece = piece[:, cols[0] : cols[1]]
            piece = piece.astype(np.float32, copy=False).astype(out.dtype, copy=False)
            i, j = r - rows[0], e - rows[0]
            if t:
                out[:, i:j] = piece.T
            else:
                out[i:j] = piece


@dataclass(frozen=True)
class Leaf:
    """One global param of `tp_llama.shard_major_params`' layout: shape, dtype and how to
    build any block of it (per-dimension ranges -> that block, an ndarray)."""

    shape: tuple[int, ...]
    dtype: Any
    block: Callable[[list[Range]], np.ndarray]


@dataclass(frozen=True)
class Seg:
    """Global columns [start, stop) of a fused array: rows src.. of the [N, D] tensor `name`."""

    start: int
    stop: int
    name: str
    src: int


def _zeros(ranges: list[Range], dtype: Any) -> np.ndarray:
    return np.zeros([b - a for a, b in ranges], dtype)


def column_leaf(src: TensorFiles, segs: list[Seg], d: int | None, width: int, dtype) -> Leaf:
    """A fused [D, width] weight ([width] vector when d is None) whose column c is row
    c - start + src of its segment's tensor, transposed (fused q|k|v and gate|up, the
    lm_head); columns no segment covers are 0 (the lm_head's padding)."""
    shape = (width,) if d is None else (d, width)

    def block(ranges: list[Range]) -> np.ndarray:
        out, (c0, c1) = _zeros(ranges, dtype), ranges[-1]
        for s in segs:
            a, b = max(c0, s.start), min(c1, s.stop)
            if a >= b:
                continue
            rows = (s.src + a - s.start, s.src + b - s.start)
            if d is None:
                src.copy(out[a - c0 : b - c0], s.name, rows)
            else:
                src.copy(out[:, a - c0 : b - c0], s.name, rows, ranges[0], t=True)
        return out

    return Leaf(shape, dtype, block)


def transposed_leaf(src: TensorFiles, name: str, k: int, d: int, dtype) -> Leaf:
    """[K, D] = tensor [D, K] transposed (o_proj, down_proj): a block of rows is a column
    slice of the tensor, read in chunks of whole rows."""

    def block(ranges: list[Range]) -> np.ndarray:
        out = _zeros(ranges, dtype)
        src.copy(out, name, ranges[1], ranges[0], t=True)
        return out

    return Leaf((k, d), dtype, block)


def plain_leaf(src: TensorFiles, name: str, shape: tuple[int, ...], dtype, width=None) -> Leaf:
    """A tensor as it lies (norms f32[N]; the embedding [V, D] zero-padded to width columns,
    `llama.pad_rows`)."""
    full = shape if width is None else (shape[0], width)

    def block(ranges: list[Range]) -> np.ndarray:
        out = _zeros(ranges, dtype)
        if len(shape) == 1:
            src.copy(out, name, ranges[0])
            return out
        (c0, c1), hi = ranges[1], shape[1]
        if c0 < min(c1, hi):
            src.copy(out[:, : min(c1, hi) - c0], name, ranges[0], (c0, min(c1, hi)))
        return out

    return Leaf(full, dtype, block)


def value_leaf(value: np.ndarray) -> Leaf:
    """A computed array (the RoPE tables): blocks are its slices."""
    return Leaf(
        value.shape, value.dtype, lambda r: np.asarray(value[tuple(slice(a, b) for a, b in r)])
    )


def vector(src: TensorFiles, name: str, n: int) -> Leaf:
    return plain_leaf(src, src.need(name, (n,)), (n,), np.float32)


def _qkv_segments(cfg: LlamaConfig, lay: TpLayout, p: str, suffix: str) -> list[Seg]:
    """Shard i's q heads then its KV heads' k and v (`tp_llama._qkv_shard_major`)."""
    hd, segs, c = cfg.head_dim, [], 0
    for i in range(lay.tp):
        kv = kv_heads_of(lay, i)[0]  # its KV heads are consecutive: the first and on
        for proj, n, head in (("q", lay.heads, i * lay.heads), ("k", lay.kv_heads, kv),
                              ("v", lay.kv_heads, kv)):  # fmt: skip
            segs.append(Seg(c, c + n * hd, f"{p}{proj}_proj.{suffix}", head * hd))
            c += n * hd
    return segs


def attention_leaves(cfg: LlamaConfig, lay: TpLayout, src: TensorFiles, i: int, dtype) -> dict:
    """`llama.pack_attention`'s layer i, q|k|v shard-major (`shard_major_params`)."""
    d, q, kv, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    for proj, n in (("q", q), ("k", kv), ("v", kv)):
        src.need(f"{a}{proj}_proj.weight", (n, d))
    width = lay.tp * (lay.heads + 2 * lay.kv_heads) * hd  # q+2kv, or more with KV replicas
    out = {
        "wqkv": column_leaf(src, _qkv_segments(cfg, lay, a, "weight"), d, width, dtype),
        "wo": transposed_leaf(src, src.need(a + "o_proj.weight", (d, q)), q, d, dtype),
        "ln_attn": vector(src, p + "input_layernorm.weight", d),
        "ln_mlp": vector(src, p + "post_attention_layernorm.weight", d),
    }
    if cfg.qkv_bias:
        for proj, n in (("q", q), ("k", kv), ("v", kv)):
            src.need(f"{a}{proj}_proj.bias", (n,))
        segs = _qkv_segments(cfg, lay, a, "bias")
        out["bqkv"] = column_leaf(src, segs, None, width, np.dtype(np.float32))
    if cfg.o_bias:
        out["bo"] = vector(src, a + "o_proj.bias", d)
    if cfg.qk_norm:
        out["q_norm"] = vector(src, a + "q_norm.weight", hd)
        out["k_norm"] = vector(src, a + "k_norm.weight", hd)
    return out


def mlp_leaves(cfg: LlamaConfig, lay: TpLayout, src: TensorFiles, i: int, dtype) -> dict:
    """`llama.pack_dense_mlp`'s layer i, gate|up shard-major (`_gate_up_shard_major`)."""
    d, f, per = cfg.hidden_size, cfg.intermediate_size, lay.ffn
    p = f"model.layers.{i}.mlp."
    gate, up = src.need(p + "gate_proj.weight", (f, d)), src.need(p + "up_proj.weight", (f, d))
    segs = []
    for s in range(lay.tp):  # shard s: gate_s | up_s
        c = 2 * s * per
        segs += [Seg(c, c + per, gate, s * per), Seg(c + per, c + 2 * per, up, s * per)]
    down = src.need(p + "down_proj.weight", (d, f))
    return {
        "w_gate_up": column_leaf(src, segs, d, 2 * f, dtype),
        "w_down": transposed_leaf(src, down, f, d, dtype),
    }


def model_leaves(cfg: LlamaConfig, lay: TpLayout, src: TensorFiles, dtype: Any) -> dict:
    """Every param of `shard_major_params(cfg, lay, pack_params(...))` as a Leaf (the same
    tree); ValueError naming a missing, misshapen or unused tensor, as `pack_params`."""
    if type(cfg) is not LlamaConfig or lay.experts:
        raise ValueError(
            f"sharded loading covers the dense Llama family, not {cfg.model_type!r} "
            "(its experts load whole, then split)"
        )
    dtype, d, v = np.dtype(dtype), cfg.hidden_size, cfg.vocab_size
    layers = [
        attention_leaves(cfg, lay, src, i, dtype) | mlp_leaves(cfg, lay, src, i, dtype)
        for i in range(cfg.num_layers)
    ]
    embed = src.need("model.embed_tokens.weight", (v, d))
    if "lm_head.weight" in src and not cfg.tie_word_embeddings:
        head = src.need("lm_head.weight", (v, d))
    elif cfg.tie_word_embeddings:
        head = embed
        src.used.add("lm_head.weight")
    else:
        raise ValueError("checkpoint has no 'lm_head.weight' and tie_word_embeddings is false")
    final_norm = vector(src, "model.norm.weight", d)
    src.check_all_used()
    inv_freq, scale = cfg.rope.inv_freq()
    return {
        "embed": plain_leaf(src, embed, (v, d), dtype, lane_padded(d)),
        # [D, tp * vocab]: HF rows transposed, zero columns past V (`shard_major_params`)
        "lm_head": column_leaf(src, [Seg(0, v, head, 0)], d, lay.tp * lay.vocab, dtype),
        "final_norm": final_norm,
        "inv_freq": value_leaf(np.asarray(inv_freq, np.float32)),
        "rope_scale": value_leaf(np.asarray(np.float32(scale))),
        "layers": layers,
    }


def ranges_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[Range]:
    """A block index (jax's tuple of slices) as [start, stop) per dimension."""
    out = []
    for s, n in zip(index, shape, strict=True):
        a, b, step = s.indices(n)
        if step != 1:
            raise ValueError(f"block index {index} of shape {shape} has a step")
        out.append((a, b))
    return out


def place(leaf: Leaf, sharding: NamedSharding) -> jax.Array:
    """The global array of `leaf`: jax asks only for this process's devices' blocks; each
    distinct block is built once (replicas share it)."""
    built: dict[tuple[Range, ...], np.ndarray] = {}

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple(ranges_of(index, leaf.shape))
        if key not in built:
            built[key] = leaf.block(list(key))
        return built[key]

    return jax.make_array_from_callback(leaf.shape, sharding, callback, dtype=leaf.dtype)


def load_tp_params(d: Path, cfg: LlamaConfig, lay: TpLayout, mesh: Mesh, dtype: Any) -> dict:
    """`shard_params(shard_major_params(cfg, lay, pack_params(...)), specs, mesh)`, bit for
    bit (matrices in dtype, vectors f32), read straight from the HF directory d's safetensors
    files: each process reads only the blocks its addressable devices hold.

    Host memory bound. Let S be the bytes of the blocks this process's devices hold, in the
    serving dtype (1/tp of each split weight per device, plus per device the replicated
    embedding, norms and RoPE tables). One array is built at a time; while it is, its
    distinct local blocks (at most S) live as numpy arrays until jax copies them to the
    devices, plus one read chunk (CHUNK_PEAK = 16 MiB). So the peak host memory this adds is
    at most S + CHUNK_PEAK on an accelerator, and 2 x S + CHUNK_PEAK on CPU, where device
    buffers are host memory too. No tensor is read whole unless a device holds all of it:
    o_proj and down_proj (split by their columns) are read as whole rows chunk by chunk, so
    those two are read tp times over from disk (page cache), never held.
    ValueError naming a missing, misshapen or unused tensor.
    """
    with TensorFiles(tensor_index(d)) as src:
        leaves = model_leaves(cfg, lay, src, dtype)
        specs = param_specs(leaves)
        return jax.tree.map(lambda f, s: place(f, NamedSharding(mesh, s)), leaves, specs)
