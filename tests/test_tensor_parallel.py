"""Tensor parallelism for the Llama family on forced host devices: the same greedy tokens as
one device and logits within f32 rounding; bad meshes are refused naming the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kernels.llama import LlamaConfig
from megaserve.errors import MeshError
from megaserve.parallel.mesh import (
    HOST_DEVICES_FLAG,
    ParallelConfig,
    ensure_host_devices,
    make_mesh,
    with_device_count,
)
from tests.conftest import FIXTURES, REPO, tiny_llama_config
from tests.parity import rel_err

# Logits of tp shards against one device: the row-parallel matmuls sum their partial
# products in another order (a psum of tp pieces), so they differ by f32 rounding only:
# measured <= 1e-6 of the largest logit on these fixtures; 1e-5 leaves headroom.
LOGITS_TOL = 1e-5


def _cfg(**overrides) -> LlamaConfig:
    return LlamaConfig.from_hf(tiny_llama_config(**overrides))


def _devices_env(n: int) -> dict:
    flags = with_device_count(os.environ.get("XLA_FLAGS", ""), n)
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


def _child(n_devices: int, names: list[str], tps: list[int], steps: int = 1, *extra) -> dict:
    """tests/tp_child.py in a process with n_devices host devices (this one's JAX already
    started with one), its JSON line parsed."""
    args = [*names, "--tp", *map(str, tps), "--steps", str(steps), *extra]
    cmd = [sys.executable, "-m", "tests.tp_child", *args]
    run = subprocess.run(
        cmd, cwd=REPO, env=_devices_env(n_devices), capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["devices"] == n_devices
    return out


def _check_same_as_one_device(out: dict, name: str, tps: list[int]) -> None:
    one = out[name]["1"]
    assert one["greedy"] == out[name]["want"], name  # the transformers reference itself
    for tp in map(str, tps):
        got = out[name][tp]
        for key in ("greedy", "sampled", "decode_tokens"):
            assert got[key] == one[key], (name, tp, key)
        for key in ("last_logits", "final_logits", "decode_logits"):
            err = rel_err(got[key], one[key])
            assert err < LOGITS_TOL, (name, tp, key, err)
        if "target" in one:  # log-probabilities: absolute, as f32 rounding of O(1) values
            assert np.max(np.abs(np.subtract(got["target"], one["target"]))) < LOGITS_TOL
            assert got["top_ids"] == one["top_ids"], (name, tp)


def test_tp2_and_tp4_match_one_device():
    """llama_gqa2 (4 q / 2 KV heads: TP=4 replicates each KV head twice), llama_gqa1 (4 KV
    heads, none replicated), qwen3 q/k norms (8 q heads) and qwen2 q/k/v biases."""
    names = ["llama_gqa2", "llama_gqa1", "qwen3_qknorm", "qwen2_bias"]
    out = _child(4, names, [2, 4])
    for name in names:
        _check_same_as_one_device(out, name, [2, 4])


def test_tp2_multi_step_decode_and_tied_embeddings():
    """Several decode steps per call (the scan with the distributed argmax inside), a tied
    lm_head (vocab-parallel copy of the embedding) and the prompt-scoring prefill."""
    names = ["llama_tied", "llama_rope_llama3"]
    out = _child(2, names, [2], 4, "--logprobs")
    for name in names:
        _check_same_as_one_device(out, name, [2])


def test_cli_generate_tp_matches_reference():
    """`megaserve generate --tp 2` forces its own host devices (none set here)."""
    d = FIXTURES / "tiny" / "llama_gqa4"
    ref = json.loads((d / "reference.json").read_text())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "megaserve_app.cli", "generate", "--checkpoint", str(d)]
    cmd += ["--prompt-ids", ",".join(map(str, ref["prompt_ids"])), "--tp", "2", "--json"]
    cmd += ["--max-new-tokens", str(len(ref["greedy_ids"])), "--ignore-eos"]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["token_ids"] == ref["greedy_ids"]


def test_cli_bad_tp_exits_2_naming_the_numbers():
    d = FIXTURES / "tiny" / "llama_gqa2"  # 4 query heads
    cmd = [sys.executable, "-m", "megaserve_app.cli", "generate", "--checkpoint", str(d)]
    cmd += ["--prompt-ids", "1,2,3", "--tp", "3", "--json"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "tp=3 does not divide num_attention_heads=4" in run.stderr


@pytest.mark.parametrize(
    "overrides,tp,needle",
    [
        ({}, 3, "tp=3 does not divide num_attention_heads=4"),
        ({"intermediate_size": 50}, 4, "tp=4 does not divide intermediate_size=50"),
        ({"num_attention_heads": 12, "num_key_value_heads": 4}, 6, "multiple of num_key_value"),
        ({"num_attention_heads": 12, "num_key_value_heads": 6}, 4, "num_key_value_heads=6"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "num_key_value_heads=3"),
        ({"num_attention_heads": 8, "num_key_value_heads": 8}, 16, "num_attention_heads=8"),
    ],
)
def test_bad_tp_is_refused_naming_the_numbers(overrides, tp, needle):
    with pytest.raises(MeshError, match=needle):
        ParallelConfig(tp=tp).check_model(_cfg(**overrides))


def test_kv_heads_fewer_than_tp_are_replicated():
    lay = ParallelConfig(tp=4).check_model(_cfg())  # 4 q heads, 2 KV heads
    assert (lay.heads, lay.kv_heads, lay.kv_replicas, lay.stored_kv_heads) == (1, 1, 2, 4)
    lay = ParallelConfig(tp=2).check_model(_cfg())
    assert (lay.heads, lay.kv_heads, lay.kv_replicas, lay.stored_kv_heads) == (2, 1, 1, 2)
    assert lay.ffn == 24 and lay.vocab == 48
    assert ParallelConfig(tp=4).check_model(_cfg(vocab_size=97)).vocab == 25  # padded


def test_shard_major_layout_gives_each_shard_its_heads():
    """Shard i's block of the fused q|k|v columns holds q heads i*hq.. and its KV head."""
    from kernels.tp_llama import _qkv_shard_major, tp_layout

    cfg = _cfg()  # D 32, 4 q heads, 2 KV heads of 8
    lay = tp_layout(cfg, 4)
    # Column c of the fused bias names its head: q heads 0-3, then k 10-11, v 20-21.
    heads = np.concatenate([np.repeat(np.arange(4), 8), np.repeat([10, 11], 8)])
    fused = np.concatenate([heads, np.repeat([20, 21], 8)]).astype(np.float32)
    blocks = _qkv_shard_major(cfg, lay, fused).reshape(4, 3, 8)[:, :, 0]
    assert blocks.tolist() == [[0, 10, 20], [1, 10, 20], [2, 11, 21], [3, 11, 21]]


def test_config_values_are_checked():
    for bad in ({"tp": 0}, {"ep": 0}, {"tp": 2.0}):
        with pytest.raises(MeshError, match="must be an integer >= 1"):
            ParallelConfig(**bad)
    # Expert parallelism's checks: tests/test_expert_parallel.py.


def test_host_device_flag_is_appended_or_raised():
    assert with_device_count("", 4) == f"{HOST_DEVICES_FLAG}=4"
    assert with_device_count("--xla_foo=1", 2) == f"--xla_foo=1 {HOST_DEVICES_FLAG}=2"
    assert with_device_count(f"{HOST_DEVICES_FLAG}=8", 4) == f"{HOST_DEVICES_FLAG}=8"
    assert with_device_count(f"-a {HOST_DEVICES_FLAG}=2 -b", 4) == f"-a {HOST_DEVICES_FLAG}=4 -b"


def test_too_few_devices_after_jax_started_is_a_clear_error():
    import jax

    jax.devices()  # this process's backend has started (one CPU device)
    ensure_host_devices(1)
    with pytest.raises(MeshError, match="64 devices needed but JAX already started with"):
        ensure_host_devices(64)
    with pytest.raises(MeshError, match="tp=64 needs 64 devices"):
        make_mesh(ParallelConfig(tp=64))
    with pytest.raises(MeshError, match="tp=2 x ep=4 needs 8 devices"):
        make_mesh(ParallelConfig(tp=2, ep=4))
