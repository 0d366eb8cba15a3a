"""The megakernel over tensor-parallel shards in the TPU interpreter (remote-DMA all-reduce
under jax.shard_map on host devices): the same greedy tokens as one device over several
steps, logits within f32 rounding, pools within one bf16 ulp, and no race the interpreter's
checker sees (which does flag the all-reduce with one buffer slot)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kernels.megakernel.tp import tp_plan
from kernels.qwen3_moe import Qwen3MoeConfig
from kernels.tp_llama import tp_layout
from tests.conftest import REPO, tiny_moe_config
from tests.test_tensor_parallel import LOGITS_TOL, _devices_env

# What one bf16 rounding step of a new K/V element may move the later logits by, relative to
# the largest (measured up to 7.2e-5; a bf16 ulp is 3.9e-3 of its element).
BF16_KV_STEP_TOL = 1e-4


def _child(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.megakernel_tp_child", *args]
    return subprocess.run(
        cmd, cwd=REPO, env=_devices_env(4), capture_output=True, text=True, timeout=900
    )


@pytest.mark.parametrize(
    "kind, tp, steps, reduce",
    [
        ("dense", 2, 4, "one_shot"),  # 4 q / 2 KV heads: one KV head per shard
        ("dense", 4, 4, "one_shot"),  # each KV head replicated on two shards
        ("qwen2", 2, 2, "one_shot"),  # q/k/v biases split with their heads
        ("dense", 2, 3, "two_phase"),  # reduce-scatter + all-gather, 128-lane blocks
        ("dense", 4, 3, "two_phase"),  # hidden_p 256 over 4 shards: zero-padded blocks
    ],
)
def test_tp_megakernel_equals_one_device(kind, tp, steps, reduce):
    run = _child(kind, str(tp), str(steps), *(["--two-phase"] if reduce == "two_phase" else []))
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4 and out["kv_replicas"] == (2 if tp == 4 else 1)
    assert out["tp_tokens"] == out["one_tokens"] == out["ref_tokens"]
    # With bit-identical pools (kv_ulps 0) the shards are within f32 rounding of the
    # one-device kernel (9.4e-7 of the largest logit on this mini), and within that plus the
    # one-device kernel's own distance of the XLA reference. A new K/V element that the two
    # summation orders put on either side of a bf16 rounding step (kv_ulps > 0, at most one
    # ulp: checked below) moves every later score by a bf16 ulp of that element: 2.1e-5 on
    # the dense mini at tp 2 (2026-12-07, kv_ulps 0.57), 7.2e-5 on the qwen2 mini (2026-12-05);
    # which host lands on which side moves. With an f32 pool that distance is gone
    # (test_megakernel.py's f32-pool qwen2 test holds the kernel to 1e-5). A wrong shard or
    # all-reduce is off by far more than either bound, and its greedy tokens differ.
    tol = LOGITS_TOL if out["kv_ulps"] == 0 else BF16_KV_STEP_TOL
    assert out["tp_vs_one"] < tol, out
    assert out["tp_vs_ref"] < tol + out["one_vs_ref"], out
    assert out["kv_ulps"] <= 1.0, out  # new K/V rows: at most one bf16 rounding apart


def test_race_checker_flags_a_one_slot_all_reduce():
    """The check above is live: with the MLP's all-reduce on the attention's slot, a shard's
    next block can overwrite one a peer has not read yet, and the interpreter says so."""
    run = _child("dense", "2", "1", "--one-slot")
    assert run.returncode != 0
    assert "RACE DETECTED" in run.stderr


def test_tp_plan_refuses_moe_naming_tp():
    hf = tiny_moe_config(num_attention_heads=4, num_key_value_heads=2, num_experts=8)
    cfg = Qwen3MoeConfig.from_hf(hf)
    with pytest.raises(ValueError, match="megakernel tp=2: MoE"):
        tp_plan(cfg, tp_layout(cfg, 2), 4, 16, 4)


@pytest.mark.parametrize("tp", [2, 4])
def test_pallas_backend_over_tp_decodes_as_the_tp_xla_runner(tp):
    """`make_runner(backend="pallas", parallel=tp)`: the tp XLA prefill, then decode steps
    through the tp megakernel (interpreted), against the tp XLA runner on the same pools."""
    run = _child("runner", str(tp))
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["runners"] == {"xla": "TpXlaRunner", "pallas": "TpMegakernelRunner"}
    assert out["tokens"]["pallas"] == out["tokens"]["xla"]
    assert out["logits_vs_xla"] < LOGITS_TOL, out  # measured 1.5e-6 at tp=2
