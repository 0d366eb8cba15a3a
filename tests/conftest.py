"""Shared fixtures: CPU-only JAX with a persistent compile cache, tiny models, SmolLM2."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from megaserve import compile_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"

compile_cache.configure_jax()  # the user's shared cache: a fresh clone's run starts warm

# The transformers reference environment (Python 3.11, `make ref-env`).
REF_PYTHON = REPO / ".venv-ref" / "bin" / "python"


def under_ci() -> bool:
    """CI sets CI=true: there a missing prerequisite fails the test instead of skipping it, so
    a green run always includes the transformers comparisons and the TPU compiles."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(ok: bool, reason: str) -> None:
    """Skips the calling test (or fixture) unless `ok`; under CI=true fails it instead."""
    if ok:
        return
    if under_ci():
        pytest.fail(f"{reason} (CI=true: a required prerequisite, not skipped)", pytrace=False)
    pytest.skip(reason)


def require_ref_env() -> Path:
    """The reference environment's python; skips without it (fails under CI=true)."""
    require(REF_PYTHON.exists(), f"no {REF_PYTHON} (make ref-env)")
    return REF_PYTHON


def require_libtpu() -> None:
    """libtpu (the `tpu` extra) for AOT TPU compiles; skips without it (fails under CI=true)."""
    require(importlib.util.find_spec("libtpu") is not None, "libtpu not installed (tpu extra)")


def pytest_runtest_setup(item):
    # The markers name the prerequisite, so no marked test can skip around it under CI.
    if item.get_closest_marker("reference"):
        require_ref_env()
    if item.get_closest_marker("tpu_compile"):
        require_libtpu()


class FakeClock:
    """A monotonic clock a test moves by hand (time windows without sleeping); advance by
    binary fractions (0.25, 4.75) so sums stay exact."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def ref_python() -> Path:
    return require_ref_env()


@pytest.fixture
def libtpu() -> None:
    require_libtpu()


def tiny_llama_config(**overrides) -> dict:
    """A small HF-style Llama config dict (random weights come from `random_tensors`)."""
    cfg = {
        "model_type": "llama",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    cfg.update(overrides)
    return cfg


def random_tensors(hf: dict, seed: int = 0, scale: float = 0.2) -> dict[str, np.ndarray]:
    """HF-named random float32 tensors for a Llama-family config dict."""
    rng = np.random.default_rng(seed)
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    hd = hf.get("head_dim") or d // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd

    def r(*shape):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": r(v, d), "model.norm.weight": 1 + r(d)}
    if not hf.get("tie_word_embeddings"):
        t["lm_head.weight"] = r(v, d)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": r(q, d),
            p + "self_attn.k_proj.weight": r(kv, d),
            p + "self_attn.v_proj.weight": r(kv, d),
            p + "self_attn.o_proj.weight": r(d, q),
            p + "mlp.gate_proj.weight": r(f, d),
            p + "mlp.up_proj.weight": r(f, d),
            p + "mlp.down_proj.weight": r(d, f),
            p + "input_layernorm.weight": 1 + r(d),
            p + "post_attention_layernorm.weight": 1 + r(d),
        }
    return t


@pytest.fixture(scope="session")
def tiny_model():
    from megaserve.checkpoint import Checkpoint
    from megaserve.model import LoadedModel

    hf = tiny_llama_config()
    return LoadedModel.from_checkpoint(Checkpoint("tiny", hf, random_tensors(hf), None, ()))


@pytest.fixture(scope="session")
def smollm2():
    from megaserve.model import LoadedModel

    return LoadedModel.load("smollm2", progress=False)


def tiny_moe_config(**overrides) -> dict:
    """A small HF-style qwen3_moe config (layer 1 dense via mlp_only_layers)."""
    cfg = tiny_llama_config(model_type="qwen3_moe", num_hidden_layers=3) | {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    }
    cfg.update(overrides)
    return cfg


def random_moe_tensors(hf: dict, seed: int = 0, scale: float = 0.2) -> dict[str, np.ndarray]:
    """HF-named random tensors for a qwen3_moe config, experts stored per expert as on disk."""
    rng = np.random.default_rng(seed + 1)
    t = random_tensors(hf | {"model_type": "llama"}, seed, scale)
    d, f, e = hf["hidden_size"], hf["moe_intermediate_size"], hf["num_experts"]
    hd = hf["head_dim"]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_norm.weight"] = (1 + scale * rng.standard_normal(hd)).astype(np.float32)
        t[p + "self_attn.k_norm.weight"] = (1 + scale * rng.standard_normal(hd)).astype(np.float32)
        if i in hf["mlp_only_layers"]:
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            del t[p + f"mlp.{name}.weight"]
        t[p + "mlp.gate.weight"] = rng.standard_normal((e, d)).astype(np.float32)
        for j in range(e):
            q = p + f"mlp.experts.{j}."
            t[q + "gate_proj.weight"] = (scale * rng.standard_normal((f, d))).astype(np.float32)
            t[q + "up_proj.weight"] = (scale * rng.standard_normal((f, d))).astype(np.float32)
            t[q + "down_proj.weight"] = (scale * rng.standard_normal((d, f))).astype(np.float32)
    return t


@pytest.fixture(scope="session")
def tiny_moe_model():
    from megaserve.checkpoint import Checkpoint
    from megaserve.model import LoadedModel

    hf = tiny_moe_config()
    return LoadedModel.from_checkpoint(Checkpoint("tiny-moe", hf, random_moe_tensors(hf), None, ()))


@pytest.fixture
def redis_server(tmp_path):
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path).start()
    yield server
    server.kill()
