"""GGUF files (llama.cpp): metadata to an HF-style config, dequantized HF-named tensors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from megaserve.checkpoint.types import Checkpoint
from megaserve.errors import CheckpointError
from megaserve.progress import Progress

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # a field type gguf cannot decode is metadata we do not need
            continue
    return out


def gguf_config(f: dict) -> dict:
    """The HF config.json a llama-architecture GGUF corresponds to."""
    arch = f.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (only 'llama')")

    def need(key):
        if key not in f:
            raise CheckpointError(f"GGUF metadata lacks {key!r}")
        return f[key]

    heads = int(need("llama.attention.head_count"))
    hidden = int(need("llama.embedding_length"))
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(need("llama.feed_forward_length")),
        "num_hidden_layers": int(need("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(f.get("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(need("llama.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(need("llama.context_length")),
        "rope_theta": float(f.get("llama.rope.freq_base", 10000.0)),
        "vocab_size": int(f.get("llama.vocab_size", len(f.get("tokenizer.ggml.tokens", [])))),
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = f.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"GGUF llama.rope.scaling.type={scaling!r} is not implemented")
    return cfg


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (its RoPE layout) to get HF's weights back."""
    d, d_in = w.shape
    return w.reshape(n_head, d // n_head // 2, 2, d_in).swapaxes(1, 2).reshape(d, d_in)


def load_gguf(path: Path, progress: bool = True) -> Checkpoint:
    """Reads and dequantizes every tensor; raises CheckpointError on truncation or corruption."""
    import gguf

    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct.error/IndexError on bad bytes
        raise CheckpointError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from e
    f = _fields(reader)
    config = gguf_config(f)
    tensors: dict[str, np.ndarray] = {}
    bar = Progress(f"dequantizing {path.name}", len(reader.tensors), enabled=progress)
    for i, t in enumerate(reader.tensors):
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes}, "
                f"file has {size}"
            )
        shape = tuple(int(x) for x in reversed(t.shape))
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        except Exception as e:
            raise CheckpointError(
                f"{path}: cannot dequantize tensor {t.name!r} ({t.tensor_type.name}): {e}"
            ) from e
        if not np.isfinite(w).all():
            raise CheckpointError(f"{path}: tensor {t.name!r} has non-finite values (corrupt?)")
        tensors[_hf_name(t.name, path)] = w
        bar.update(i + 1)
    h, kvh = config["num_attention_heads"], config["num_key_value_heads"]
    for i in range(config["num_hidden_layers"]):
        for proj, n in (("q_proj", h), ("k_proj", kvh)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            if name in tensors:
                tensors[name] = _unpermute(tensors[name], n)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    from megaserve.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_gguf_fields(f) if "tokenizer.ggml.tokens" in f else None
    eos = f.get("tokenizer.ggml.eos_token_id")
    return Checkpoint(str(path), config, tensors, tokenizer, () if eos is None else (int(eos),))


def gguf_file_config(path: Path) -> dict:
    """The HF config of a GGUF file, from its metadata; no tensor is read."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from e
    return gguf_config(_fields(reader))


def gguf_tokenizer(path: Path):
    """(TextTokenizer, eos ids, vocab size) from a GGUF's metadata; no tensor is read."""
    import gguf

    from megaserve.tokenizer import TextTokenizer

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") from e
    f = _fields(reader)
    if "tokenizer.ggml.tokens" not in f:
        raise CheckpointError(f"{path}: no tokenizer in the GGUF metadata")
    eos = f.get("tokenizer.ggml.eos_token_id")
    return (
        TextTokenizer.from_gguf_fields(f),
        () if eos is None else (int(eos),),
        int(gguf_config(f)["vocab_size"]),
    )


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.match(name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise CheckpointError(f"{path}: GGUF tensor {name!r} is not part of a llama model")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
