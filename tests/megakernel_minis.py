"""The megakernel tests' mini models: small dense and MoE shapes that take every code path the
real ones do, with bf16-representable random weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tests.conftest import random_moe_tensors, random_tensors, tiny_llama_config, tiny_moe_config

PS = 16
# Mini shapes that take every code path the real ones do: hidden 192 is not a lane multiple
# (like SmolLM2's 576), head_dim 64 packs two heads per 128 lanes, GQA groups of 2, three
# MLP tiles, a vocab that ends inside its last tile; the MoE mini mixes MoE and dense layers.
MINI = dict(
    hidden_size=192,
    intermediate_size=384,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=300,
)


def _bf16_round(t: dict) -> dict:
    return {k: np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32)) for k, v in t.items()}


def mini_model(kind: str):
    """(model, hf) with bf16-representable weights, so the f32 reference and the kernel's
    bf16 weights are the same numbers and only activation rounding differs."""
    from megaserve.checkpoint import Checkpoint
    from megaserve.model import LoadedModel

    if kind == "moe":
        hf = tiny_moe_config(**MINI, moe_intermediate_size=96, num_experts=8)
        t = random_moe_tensors(hf, scale=0.2)
    elif kind == "qwen2":  # q/k/v biases, in the kernel's vector rows
        hf = tiny_llama_config(**MINI, model_type="qwen2")
        t = random_tensors(hf, scale=0.2)
        rng = np.random.default_rng(7)
        hd = MINI["head_dim"]
        q, kv = MINI["num_attention_heads"] * hd, MINI["num_key_value_heads"] * hd
        for i in range(hf["num_hidden_layers"]):
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                bias = (rng.standard_normal(n) * 0.5).astype(np.float32)
                t[f"model.layers.{i}.self_attn.{name}_proj.bias"] = bias
    elif kind == "kv192":  # 3 kv heads of 64: a K/V row of 192 lanes (SmolLM2's)
        hf = tiny_llama_config(**(MINI | {"num_attention_heads": 6, "num_key_value_heads": 3}))
        t = random_tensors(hf, scale=0.2)
    else:
        hf = tiny_llama_config(**MINI)
        t = random_tensors(hf, scale=0.2)
    return LoadedModel.from_checkpoint(Checkpoint(kind, hf, _bf16_round(t), None, ())), hf
