"""Tensor x expert parallelism for Qwen3-MoE on forced host devices: the same greedy tokens as
one device and transformers, logits within f32 rounding; bad meshes refused naming numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from kernels.llama import LlamaConfig
from kernels.moe import local_experts, moe_dense, moe_gather, route
from kernels.moe_prefill import MoePrefillConfig, moe_gmm, moe_sorted_loop
from kernels.qwen3_moe import Qwen3MoeConfig
from kernels.tp_llama import param_specs
from megaserve.errors import MeshError
from megaserve.parallel.mesh import ParallelConfig
from tests.conftest import FIXTURES, REPO, tiny_llama_config, tiny_moe_config
from tests.test_tensor_parallel import _check_same_as_one_device, _child

SMALL = MoePrefillConfig(rows=8, tail_rows=3, gmm_rows=16, gmm_max_kn=128)
IMPLS = {
    "gather": moe_gather,
    "sorted_loop": lambda *a: moe_sorted_loop(*a, cfg=SMALL),
    "dense": moe_dense,
    # The TPU prefill path in the TPU interpreter, whose unwritten rows read as NaN: the
    # other shards' pairs must land in a group, or they would poison the sum.
    "gmm": lambda *a: moe_gmm(*a, cfg=SMALL, interpret=pltpu.InterpretParams()),
}


def test_tp2_ep4_and_ep2_match_one_device_and_transformers():
    """8 experts over 4 ep shards (2 each, every expert's 32 columns split over tp=2), and
    over 2 ep shards at tp=1: greedy and sampled tokens equal, logits within 1e-5."""
    out = _child(8, ["qwen3_moe_e8k2"], ["2x4", "1x2"])
    _check_same_as_one_device(out, "qwen3_moe_e8k2", ["2x4", "1x2"])


def test_tp2_ep2_dense_layers_multi_step_and_scoring():
    """Dense layers between routed ones (their MLP over tp only, copied on the ep shards),
    4 decode steps per call and the prompt-scoring prefill."""
    out = _child(4, ["qwen3_moe_dense_layers"], ["2x2"], 4, "--logprobs")
    _check_same_as_one_device(out, "qwen3_moe_dense_layers", ["2x2"])


def _cli(checkpoint: str, *args: str) -> subprocess.CompletedProcess:
    """`megaserve generate --json` in a process that forces its own host devices."""
    d = FIXTURES / "tiny" / checkpoint
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "megaserve_app.cli", "generate", "--checkpoint", str(d)]
    cmd += [*args, "--json", "--ignore-eos"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_cli_generate_tp_ep_matches_reference():
    ref = json.loads((FIXTURES / "tiny" / "qwen3_moe_e8k2_v4" / "reference.json").read_text())
    ids = ",".join(map(str, ref["prompt_ids"]))
    n = str(len(ref["greedy_ids"]))
    run = _cli("qwen3_moe_e8k2_v4", "--prompt-ids", ids, "--max-new-tokens", n, "--tp", "2",
               "--ep", "2")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout)["token_ids"] == ref["greedy_ids"]


def test_cli_bad_ep_exits_2_naming_the_numbers():
    run = _cli("qwen3_moe_e8k2", "--prompt-ids", "1,2,3", "--ep", "3")
    assert run.returncode == 2, run.stderr[-3000:]
    assert "ep=3 does not divide num_experts=8" in run.stderr


def _moe(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig.from_hf(tiny_moe_config(**overrides))


@pytest.mark.parametrize(
    "cfg,tp,ep,needle",
    [
        (_moe(), 1, 3, "ep=3 does not divide num_experts=8"),
        (_moe(), 1, 16, "ep=16 does not divide num_experts=8"),
        (_moe(moe_intermediate_size=18), 4, 1, "tp=4 does not divide moe_intermediate_size=18"),
        (_moe(), 3, 2, "tp=3 does not divide num_attention_heads=4"),
        (LlamaConfig.from_hf(tiny_llama_config()), 1, 2, "ep=2: expert parallelism needs a"),
    ],
)
def test_bad_ep_is_refused_naming_the_numbers(cfg, tp, ep, needle):
    with pytest.raises(MeshError, match=needle):
        ParallelConfig(tp=tp, ep=ep).check_model(cfg)


def test_expert_layout_and_specs():
    """Each device: num_experts / ep experts, moe_intermediate_size / tp of each; the
    attention plan over tp as for the Llama family; the router replicated."""
    lay = ParallelConfig(tp=2, ep=4).check_model(_moe())  # 8 experts of 16 columns, 4 heads
    assert (lay.tp, lay.ep, lay.experts, lay.moe_ffn, lay.heads) == (2, 4, 2, 8, 2)
    assert ParallelConfig(tp=2).check_model(_moe()).experts == 8
    assert ParallelConfig(tp=2).check_model(LlamaConfig.from_hf(tiny_llama_config())).experts == 0
    routed = {"router": 0, "w_gate_up": 0, "w_down": 0}
    dense = {"w_gate_up": 0, "w_down": 0}
    specs = param_specs({"embed": 0, "lm_head": 0, "layers": [routed, dense]})["layers"]
    assert specs[0] == {
        "router": P(),
        "w_gate_up": P("ep", None, "tp"),
        "w_down": P("ep", "tp", None),
    }
    assert specs[1] == {"w_gate_up": P(None, "tp"), "w_down": P("tp", None)}


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_ep_shards_sum_to_the_whole_moe(impl):
    """Each ep shard runs the served MoE on its experts with `local_experts`' routing; the
    shards' outputs add up to the one-device output (the psum over ep, here on the host)."""
    e, d, f, n, k, ep = 8, 40, 24, 13, 2, 4
    rng = np.random.default_rng(0)
    router = jnp.asarray(rng.standard_normal((d, e)).astype(np.float32))
    wgu = jnp.asarray((0.2 * rng.standard_normal((e, d, 2 * f))).astype(np.float32))
    wdn = jnp.asarray((0.2 * rng.standard_normal((e, f, d))).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((n, d)).astype(np.float32))
    w, idx = route(router, x, k, True)
    fn, held = jax.jit(IMPLS[impl]) if impl != "gmm" else IMPLS[impl], e // ep
    parts = []
    for j in range(ep):
        lw, lidx = local_experts(w, idx, j * held, held)
        block = slice(j * held, (j + 1) * held)
        parts.append(np.asarray(fn(wgu[block], wdn[block], lw, lidx, x)))
    whole = np.asarray(moe_dense(wgu, wdn, w, idx, x))
    assert np.all(np.isfinite(parts))
    np.testing.assert_allclose(np.sum(parts, axis=0), whole, rtol=1e-5, atol=1e-5)
