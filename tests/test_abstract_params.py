"""Each family's abstract_params (compile-worker's weights without weights) has exactly the
tree, shapes and dtypes its pack_params puts on device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megaserve.checkpoint import Checkpoint
from megaserve.model import LoadedModel
from tests.conftest import random_moe_tensors, random_tensors, tiny_llama_config, tiny_moe_config


def _with_extras(hf: dict) -> dict:
    """random_tensors plus the q/k norms (qwen3) and q/k/v biases (qwen2) the config needs."""
    t = random_tensors(hf)
    hd = hf["hidden_size"] // hf["num_attention_heads"]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        if hf["model_type"] == "qwen3":
            t |= {p + "q_norm.weight": np.ones(hd, np.float32), p + "k_norm.weight": np.ones(hd)}
        if hf["model_type"] == "qwen2":
            for name, heads in (("q", "num_attention_heads"), ("k", "num_key_value_heads")):
                t[p + f"{name}_proj.bias"] = np.zeros(hf[heads] * hd, np.float32)
            t[p + "v_proj.bias"] = np.zeros(hf["num_key_value_heads"] * hd, np.float32)
    return t


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


@pytest.mark.parametrize(
    "hf, tensors",
    [
        (tiny_llama_config(), random_tensors),
        (tiny_llama_config(model_type="qwen3"), _with_extras),
        (tiny_llama_config(model_type="qwen2"), _with_extras),
        (tiny_moe_config(mlp_only_layers=[1]), random_moe_tensors),
    ],
    ids=["llama", "qwen3", "qwen2", "qwen3_moe"],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_abstract_params_match_pack_params(hf, tensors, dtype):
    m = LoadedModel.from_checkpoint(Checkpoint("tiny", hf, tensors(hf), None, ()), dtype)
    assert _shapes(m.family.abstract_params(m.cfg, dtype)) == _shapes(m.params)
