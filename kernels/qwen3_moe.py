"""Qwen3-MoE family: Qwen3 attention, top-k softmax-routed experts, optional dense layers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels import llama
from kernels.llama import LlamaConfig, TensorSource
from kernels.moe import local_experts, moe_dense, moe_gather, route
from kernels.moe_prefill import moe_prefill

MODEL_TYPES = ("qwen3_moe",)


@dataclass(frozen=True)
class Qwen3MoeConfig(LlamaConfig):
    """LlamaConfig plus the expert layout; `moe_layers` lists the layers that route."""

    num_experts: int = 0
    top_k: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    # "auto": gather distinct experts for decode, grouped matmul for prefill; "dense" runs
    # every expert on every token (the reference, for contrast in benchmarks).
    moe_impl: str = "auto"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen3MoeConfig:
        if hf.get("model_type") not in MODEL_TYPES:
            raise ValueError(f"model_type {hf.get('model_type')!r} is not {MODEL_TYPES}")
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not experts or int(experts) < 1:
            raise ValueError(f"qwen3_moe needs num_experts >= 1, got {experts!r}")
        experts = int(experts)
        k = int(hf.get("num_experts_per_tok", 0))
        if not 1 <= k <= experts:
            raise ValueError(f"num_experts_per_tok={k} must be in [1, num_experts={experts}]")
        for key in ("shared_expert_intermediate_size", "n_shared_experts"):
            if hf.get(key):
                raise ValueError(f"config field {key}={hf[key]!r} is not implemented for qwen3_moe")
        step = int(hf.get("decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"decoder_sparse_step={step} must be >= 1")
        n_layers = int(hf["num_hidden_layers"])
        dense_only = set(hf.get("mlp_only_layers") or [])
        bad = sorted(i for i in dense_only if not 0 <= i < n_layers)
        if bad:
            raise ValueError(f"mlp_only_layers {bad} outside [0, {n_layers})")
        moe_layers = tuple(
            i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0
        )
        attn = {k: v for k, v in hf.items() if k not in ("num_experts", "num_local_experts")}
        base = LlamaConfig.from_hf({**attn, "model_type": "qwen3"})
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}
        return cls(
            **(fields | {"model_type": "qwen3_moe"}),
            num_experts=experts,
            top_k=k,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            moe_layers=moe_layers,
        )

    @property
    def expert_bytes_f32(self) -> int:
        """Bytes of one expert's gate, up and down matrices in float32."""
        return 3 * self.hidden_size * self.moe_intermediate_size * 4


def _pack_experts(cfg: Qwen3MoeConfig, src: TensorSource, i: int) -> dict[str, np.ndarray]:
    """Router [D, E] and stacked experts [E, D, 2I], [E, I, D] from per-expert or fused names."""
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    p = f"model.layers.{i}.mlp."
    out = {"router": src.get(p + "gate.weight", (e, d)).T}
    if p + "experts.gate_up_proj" in src:  # fused, as transformers 5 holds them in memory
        out["w_gate_up"] = src.get(p + "experts.gate_up_proj", (e, 2 * f, d)).transpose(0, 2, 1)
        out["w_down"] = src.get(p + "experts.down_proj", (e, d, f)).transpose(0, 2, 1)
        return out
    gu, dn = [], []
    for j in range(e):
        q = f"{p}experts.{j}."
        gate = src.get(q + "gate_proj.weight", (f, d))
        up = src.get(q + "up_proj.weight", (f, d))
        gu.append(np.concatenate([gate, up], axis=0).T)
        dn.append(src.get(q + "down_proj.weight", (d, f)).T)
    out["w_gate_up"], out["w_down"] = np.stack(gu), np.stack(dn)
    return out


def pack_params(
    cfg: Qwen3MoeConfig, tensors: dict[str, np.ndarray], dtype: Any = jnp.float32, on_device=True
) -> dict[str, Any]:
    src = TensorSource(tensors)
    layers = []
    for i in range(cfg.num_layers):
        mlp = (
            _pack_experts(cfg, src, i) if i in cfg.moe_layers else llama.pack_dense_mlp(cfg, src, i)
        )
        layers.append(llama.pack_attention(cfg, src, i) | mlp)
    return llama.finish_params(cfg, src, layers, dtype, on_device)


def abstract_params(cfg: Qwen3MoeConfig, dtype: Any = jnp.float32) -> dict[str, Any]:
    """`pack_params`'s output as ShapeDtypeStructs (see `llama.abstract_params`)."""
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    experts = {
        "router": jax.ShapeDtypeStruct((d, e), dtype),
        "w_gate_up": jax.ShapeDtypeStruct((e, d, 2 * f), dtype),
        "w_down": jax.ShapeDtypeStruct((e, f, d), dtype),
    }
    layers = [
        llama.abstract_attention(cfg, dtype)
        | (experts if i in cfg.moe_layers else llama.abstract_dense_mlp(cfg, dtype))
        for i in range(cfg.num_layers)
    ]
    return llama.abstract_model(cfg, layers, dtype)


def moe_mlp(cfg: Qwen3MoeConfig, lp: dict, x: jnp.ndarray, first_expert: Any = 0) -> jnp.ndarray:
    """The layer's MLP on f32[B, T, D]: routed experts where the layer has a router.

    Under expert parallelism (`tp_moe`) lp holds only experts first_expert.. (i32 scalar) of
    the router's E: the result is their share of the output (a psum over the shards adds the
    rest), the router still choosing among all E."""
    if "router" not in lp:
        return llama.dense_mlp(cfg, lp, x)
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    weights, idx = route(lp["router"], flat, cfg.top_k, cfg.norm_topk_prob)
    held = lp["w_gate_up"].shape[0]
    if held < cfg.num_experts:
        weights, idx = local_experts(weights, idx, first_expert, held)
    if cfg.moe_impl == "dense":
        impl = moe_dense
    else:
        impl = moe_gather if t == 1 else moe_prefill
    # Activations in the experts' dtype (bf16 experts are read as they lie, not cast up).
    dt = lp["w_gate_up"].dtype
    out = impl(lp["w_gate_up"], lp["w_down"], weights.astype(dt), idx, flat.astype(dt))
    return out.reshape(b, t, d).astype(x.dtype)


def forward(cfg, params, tokens, positions, k_cache, v_cache, page_table, logits_index):
    """`llama.forward` with the MoE MLP; same arguments and returns."""
    return llama.forward(
        cfg, params, tokens, positions, k_cache, v_cache, page_table, logits_index, mlp=moe_mlp
    )
