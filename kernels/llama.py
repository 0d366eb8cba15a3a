"""Llama family (Llama 2/3, SmolLM, Qwen2, Qwen3 dense): config, weights and reference forward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels.kv_cache import lane_padded
from kernels.paged_attention import paged_attention, write_kv
from kernels.rope import RopeConfig, apply_rope, rope_cos_sin

MODEL_TYPES = ("llama", "qwen2", "qwen3")

# Config keys that change the math and that this module does not implement; a checkpoint that
# sets one of them to a non-default value is refused rather than served wrong.
_UNSUPPORTED = {
    "mlp_bias": (False, None),
    "use_sliding_window": (False, None),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "quantization_config": (None,),
    "residual_multiplier": (None, 1.0),
    "embedding_multiplier": (None, 1.0),
    "logits_scaling": (None, 1.0),
    "attention_multiplier": (None,),
    "num_experts": (None, 0),
    "num_local_experts": (None, 0),
}


@dataclass(frozen=True)
class LlamaConfig:
    """Static model shape, read from a Hugging Face config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Builds the config; raises ValueError naming any field we would otherwise get wrong."""
        mt = hf.get("model_type")
        if mt not in MODEL_TYPES:
            raise ValueError(f"model_type {mt!r} is not a Llama-family model {MODEL_TYPES}")
        for key, defaults in _UNSUPPORTED.items():
            if key in hf and hf[key] not in defaults:
                raise ValueError(f"config field {key}={hf[key]!r} is not implemented for {mt}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not implemented (only 'silu')")
        layer_types = hf.get("layer_types") or []
        bad = sorted({t for t in layer_types if t != "full_attention"})
        if bad:
            raise ValueError(f"layer_types {bad} are not implemented (only full_attention)")
        heads = int(hf["num_attention_heads"])
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} not a multiple of {kv_heads=}")
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
        attn_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=mt,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rope=RopeConfig.from_hf(hf, head_dim),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attn_bias or mt == "qwen2",
            o_bias=attn_bias and mt != "qwen2",
            qk_norm=mt == "qwen3",
        )


class TensorSource:
    """HF-named tensors with shape checks; remembers what was used so leftovers are reported."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        t = np.asarray(self.tensors[name])
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        self.used.add(name)
        return t.astype(np.float32)

    def check_all_used(self) -> None:
        extra = sorted(
            n for n in self.tensors if n not in self.used and not n.endswith("rotary_emb.inv_freq")
        )
        if extra:
            raise ValueError(f"checkpoint has tensors this model does not use: {extra[:5]}")


def pack_attention(cfg: LlamaConfig, src: TensorSource, i: int) -> dict[str, np.ndarray]:
    """Layer i's norms and attention, projections [in, out] with q|k|v fused."""
    d, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    p = f"model.layers.{i}."
    wq = src.get(p + "self_attn.q_proj.weight", (q, d))
    wk = src.get(p + "self_attn.k_proj.weight", (kv, d))
    wv = src.get(p + "self_attn.v_proj.weight", (kv, d))
    out = {
        "wqkv": np.concatenate([wq, wk, wv], axis=0).T,
        "wo": src.get(p + "self_attn.o_proj.weight", (d, q)).T,
        "ln_attn": src.get(p + "input_layernorm.weight", (d,)),
        "ln_mlp": src.get(p + "post_attention_layernorm.weight", (d,)),
    }
    if cfg.qkv_bias:
        bq = src.get(p + "self_attn.q_proj.bias", (q,))
        bk = src.get(p + "self_attn.k_proj.bias", (kv,))
        bv = src.get(p + "self_attn.v_proj.bias", (kv,))
        out["bqkv"] = np.concatenate([bq, bk, bv])
    if cfg.o_bias:
        out["bo"] = src.get(p + "self_attn.o_proj.bias", (d,))
    if cfg.qk_norm:
        out["q_norm"] = src.get(p + "self_attn.q_norm.weight", (cfg.head_dim,))
        out["k_norm"] = src.get(p + "self_attn.k_norm.weight", (cfg.head_dim,))
    return out


def pack_dense_mlp(cfg: LlamaConfig, src: TensorSource, i: int) -> dict[str, np.ndarray]:
    """Layer i's SwiGLU MLP with gate|up fused, [in, out]."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    p = f"model.layers.{i}.mlp."
    gate = src.get(p + "gate_proj.weight", (f, d))
    up = src.get(p + "up_proj.weight", (f, d))
    return {
        "w_gate_up": np.concatenate([gate, up], axis=0).T,
        "w_down": src.get(p + "down_proj.weight", (d, f)).T,
    }


def finish_params(
    cfg: LlamaConfig,
    src: TensorSource,
    layers: list[dict[str, np.ndarray]],
    dtype: Any,
    on_device: bool = True,
) -> dict[str, Any]:
    """Adds embedding, final norm, lm_head and RoPE tables; moves everything to device.

    Layers stay one dict each (not stacked [L, ...]): an unrolled layer loop over separate
    buffers reads each weight once, whereas slicing a stacked array in a scan copied every
    layer's weights on XLA:CPU (SmolLM2 batch 1: 20.6 ms vs 34.2 ms for the matmuls alone).
    lm_head is stored transposed even when tied, because reading the embedding transposed
    cost ~34 ms/step more on XLA:CPU (PLATFORM.md).
    """
    d = cfg.hidden_size
    embed = src.get("model.embed_tokens.weight", (cfg.vocab_size, d))
    if "lm_head.weight" in src and not cfg.tie_word_embeddings:
        lm_head = src.get("lm_head.weight", (cfg.vocab_size, d))
    elif cfg.tie_word_embeddings:
        lm_head = embed
        src.used.add("lm_head.weight")
    else:
        raise ValueError("checkpoint has no 'lm_head.weight' and tie_word_embeddings is false")
    final_norm = src.get("model.norm.weight", (d,))
    src.check_all_used()
    inv_freq, rope_scale = cfg.rope.inv_freq()

    # on_device=False keeps every array on the host, already in its serving dtype: a runner
    # that repacks the weights (the megakernel's rings) then puts only its own copy on device.
    put = jnp.asarray if on_device else np.asarray

    def dev(a: np.ndarray, dt: Any = None):
        # Norm weights and biases stay float32; matrices take the serving dtype.
        return put(a, dt or (jnp.float32 if a.ndim == 1 else dtype))

    return {
        "embed": dev(pad_rows(embed), dtype),
        "lm_head": dev(np.ascontiguousarray(lm_head.T), dtype),
        "final_norm": dev(final_norm, jnp.float32),
        "inv_freq": dev(inv_freq, jnp.float32),
        "rope_scale": jnp.float32(rope_scale) if on_device else np.float32(rope_scale),
        "layers": [{k: dev(np.ascontiguousarray(v)) for k, v in lp.items()} for lp in layers],
    }


def pad_rows(embed: np.ndarray) -> np.ndarray:
    """The embedding table [V, D] with its rows zero-padded to whole 128-lane tiles.

    On TPU a [V, 576] table (SmolLM2) defaults to a column-major layout, and the row gather
    re-laid the whole table out before every prefill and decode step (compile-worker); a
    lane-multiple width defaults to row-major. Rows are gathered whole and cut back to D.
    """
    width = lane_padded(embed.shape[1])
    if width == embed.shape[1]:
        return embed
    return np.pad(np.asarray(embed), ((0, 0), (0, width - embed.shape[1])))


def pack_params(
    cfg: LlamaConfig, tensors: dict[str, np.ndarray], dtype: Any = jnp.float32, on_device=True
) -> dict[str, Any]:
    """HF tensors -> the per-layer layout `forward` reads (on the host when not on_device)."""
    src = TensorSource(tensors)
    layers = [
        pack_attention(cfg, src, i) | pack_dense_mlp(cfg, src, i) for i in range(cfg.num_layers)
    ]
    return finish_params(cfg, src, layers, dtype, on_device)


def abstract_attention(cfg: LlamaConfig, dtype: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes of `pack_attention`'s output on device (matrices in dtype, vectors f32)."""
    d, q, kv, f32 = cfg.hidden_size, cfg.q_size, cfg.kv_size, jnp.float32
    out = {
        "wqkv": jax.ShapeDtypeStruct((d, q + 2 * kv), dtype),
        "wo": jax.ShapeDtypeStruct((q, d), dtype),
        "ln_attn": jax.ShapeDtypeStruct((d,), f32),
        "ln_mlp": jax.ShapeDtypeStruct((d,), f32),
    }
    if cfg.qkv_bias:
        out["bqkv"] = jax.ShapeDtypeStruct((q + 2 * kv,), f32)
    if cfg.o_bias:
        out["bo"] = jax.ShapeDtypeStruct((d,), f32)
    if cfg.qk_norm:
        out["q_norm"] = jax.ShapeDtypeStruct((cfg.head_dim,), f32)
        out["k_norm"] = jax.ShapeDtypeStruct((cfg.head_dim,), f32)
    return out


def abstract_dense_mlp(cfg: LlamaConfig, dtype: Any) -> dict[str, jax.ShapeDtypeStruct]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {
        "w_gate_up": jax.ShapeDtypeStruct((d, 2 * f), dtype),
        "w_down": jax.ShapeDtypeStruct((f, d), dtype),
    }


def abstract_model(cfg: LlamaConfig, layers: list[dict], dtype: Any) -> dict[str, Any]:
    """`finish_params`'s output as ShapeDtypeStructs around the given abstract layers."""
    d, v, f32 = cfg.hidden_size, cfg.vocab_size, jnp.float32
    return {
        "embed": jax.ShapeDtypeStruct((v, lane_padded(d)), dtype),  # `pad_rows`
        "lm_head": jax.ShapeDtypeStruct((d, v), dtype),
        "final_norm": jax.ShapeDtypeStruct((d,), f32),
        "inv_freq": jax.ShapeDtypeStruct((cfg.head_dim // 2,), f32),
        "rope_scale": jax.ShapeDtypeStruct((), f32),
        "layers": layers,
    }


def abstract_params(cfg: LlamaConfig, dtype: Any = jnp.float32) -> dict[str, Any]:
    """`pack_params`'s output as ShapeDtypeStructs, without weights: for compiling a
    worker's programs at real shapes (`megaserve kernels compile-worker`)."""
    layers = [abstract_attention(cfg, dtype) | abstract_dense_mlp(cfg, dtype)] * cfg.num_layers
    return abstract_model(cfg, [dict(lp) for lp in layers], dtype)


def rms_norm(x: jnp.ndarray, w: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm in float32, weight applied after the cast back (transformers' order)."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return w * (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def mm(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """x @ w with x in w's dtype and f32 accumulation: bf16 weights are read as they lie
    (casting them to the f32 activations made weight-sized temporaries on TPU: 5.5 GB in
    Llama-3.1-8B's prefill); f32 weights give the plain f32 product."""
    return jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _layer(cfg, lp, h, cos, sin, positions, page_table, k_cache, v_cache, li, mlp, reduces):
    """One decoder layer; returns (h, k_cache, v_cache) with this token's K/V written.

    reduces: (reduce, mlp_reduce). reduce sums the partial outputs of the row-parallel o
    projection across tensor-parallel shards (`tp_llama`: a psum; one device: identity);
    mlp_reduce(lp, y) those of the MLP (routed experts may be split over more shards than
    attention: `tp_moe`). Under tensor parallelism cfg is the shard's `local_config`, so
    the head counts here are its own."""
    reduce, mlp_reduce = reduces
    b, t, _ = h.shape
    x = rms_norm(h, lp["ln_attn"], cfg.rms_norm_eps)
    qkv = mm(x, lp["wqkv"])
    if cfg.qkv_bias:
        qkv = qkv + lp["bqkv"]
    q = qkv[..., : cfg.q_size].reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = qkv[..., cfg.q_size : cfg.q_size + cfg.kv_size].reshape(b, t, cfg.num_kv_heads, -1)
    v = qkv[..., cfg.q_size + cfg.kv_size :].reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    k_cache = write_kv(k_cache, li, k, positions, page_table)
    v_cache = write_kv(v_cache, li, v, positions, page_table)
    attn = paged_attention(
        q, k_cache, v_cache, li, positions, page_table, cfg.head_dim**-0.5, cfg.num_kv_heads
    ).reshape(b, t, cfg.q_size)
    o = reduce(mm(attn, lp["wo"]))
    if cfg.o_bias:
        o = o + lp["bo"]  # once, after the sum
    h = h + o
    x = rms_norm(h, lp["ln_mlp"], cfg.rms_norm_eps)
    return h + mlp_reduce(lp, mlp(cfg, lp, x)), k_cache, v_cache


def dense_mlp(cfg: LlamaConfig, lp: dict, x: jnp.ndarray) -> jnp.ndarray:
    """SwiGLU on f32[B, T, D] with fused gate|up."""
    gu = mm(x, lp["w_gate_up"])
    f = gu.shape[-1] // 2
    return mm(jax.nn.silu(gu[..., :f]) * gu[..., f:], lp["w_down"])


def forward(
    cfg: LlamaConfig,
    params: dict,
    tokens: jnp.ndarray,
    positions: jnp.ndarray,
    k_cache: jnp.ndarray,
    v_cache: jnp.ndarray,
    page_table: jnp.ndarray,
    logits_index: jnp.ndarray | None,
    mlp: Callable = None,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """Runs new tokens of a batch of sequences through the model over a paged KV cache.

    Prefill is T > 1, decode is T == 1: one code path, so both read and write pages identically.

    Args:
      cfg: static model config.
      params: output of `pack_params`.
      tokens: i32[B, T] new token ids (anything for padding).
      positions: i32[B, T] absolute positions of those tokens; -1 marks padding.
      k_cache, v_cache: [L, num_pages, page_size, Hkv * D] pools (donate them under jit).
      page_table: i32[B, P] pages of each sequence; pad with the null page 0.
      logits_index: i32[B] which of the T positions to project to logits; None: every
        position (prompt log-probabilities), f32[B, T, V] logits.
      mlp: (cfg, layer_params, x) -> f32[B, T, D]; families with other MLPs (MoE) pass theirs.
    Returns:
      (f32[B, V] logits (f32[B, T, V] for every position), k_cache, v_cache).
    """
    last, k_cache, v_cache = final_hidden(
        cfg, params, tokens, positions, k_cache, v_cache, page_table, logits_index, mlp
    )
    return mm(last, params["lm_head"]), k_cache, v_cache


def final_hidden(
    cfg, params, tokens, positions, k_cache, v_cache, page_table, logits_index, mlp,
    reduce=None, mlp_reduce=None,
):  # fmt: skip
    """`forward` up to the lm_head: (f32[B, D] (or [B, T, D]) final-normed hidden states,
    k_cache, v_cache). Shared with the tensor-parallel forward (`tp_llama.tp_forward`), which
    passes its shard's config and a psum as reduce (and mlp_reduce(lp, y), default
    reduce(y), where the MLP's partial sums span other shards)."""
    # The table's rows may be lane-padded (`pad_rows`): gathered whole, then cut to D.
    h = params["embed"][tokens][..., : cfg.hidden_size].astype(params["embed"].dtype)
    cos, sin = rope_cos_sin(positions, params["inv_freq"], params["rope_scale"])
    mlp, reduce = mlp or dense_mlp, reduce or (lambda y: y)  # one device: nothing to sum
    reduces = (reduce, mlp_reduce or (lambda lp, y: reduce(y)))
    for li, lp in enumerate(params["layers"]):
        h, k_cache, v_cache = _layer(
            cfg, lp, h, cos, sin, positions, page_table, k_cache, v_cache, li, mlp, reduces
        )
    if logits_index is None:
        last = h
    else:
        last = jnp.take_along_axis(h, logits_index[:, None, None], axis=1)[:, 0]
    return rms_norm(last, params["final_norm"], cfg.rms_norm_eps), k_cache, v_cache
