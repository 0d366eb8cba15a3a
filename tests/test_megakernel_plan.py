"""Megakernel planning without running the kernel: the VMEM budget counts its scratch, the plan
refuses what the kernel does not implement, and the HBM floor counts active weights."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import pytest

from kernels.megakernel import schedule
from kernels.megakernel.plan import VMEM_BYTES, make_plan, padded_bytes
from tests.conftest import tiny_llama_config
from tests.megakernel_minis import MINI, PS, mini_model

REPO = Path(__file__).resolve().parents[1]


def test_vmem_budget_counts_the_kernels_scratch():
    from kernels.registry import family_for

    assert padded_bytes((16, 192), jnp.bfloat16) == 16 * 256 * 2
    assert padded_bytes((3, 1, 64), jnp.float32) == 3 * 8 * 128 * 4
    assert padded_bytes((1, 100), jnp.bfloat16) == 16 * 128 * 2
    for name in ("smollm2-135m", "llama-3.1-8b", "qwen3-30b-a3b"):
        hf = json.loads((REPO / "configs" / "models" / f"{name}.json").read_text())
        cfg = family_for(hf["model_type"])[1].from_hf(hf)
        for batch in (1, 8):
            plan = make_plan(cfg, batch, 16, 256)
            scratch = sum(padded_bytes(s.shape, s.dtype) for s in plan.scratch() if s.vmem_bytes)
            io = sum(padded_bytes(sh, dt) for sh, dt in plan.io_vmem())
            assert plan.vmem_bytes() == scratch + io
            assert plan.vmem_bytes() < VMEM_BYTES
            assert plan.depth_a >= 2 and plan.depth_b >= 2 and plan.depth_kv >= 2
    with pytest.raises(ValueError, match="MiB VMEM"):
        make_plan(cfg, 8, 16, 256, vmem_budget=2**20)


def test_plan_refuses_what_the_kernel_does_not_implement():
    from kernels.llama import LlamaConfig

    hf = tiny_llama_config(**MINI)
    with pytest.raises(ValueError, match="o_bias"):
        make_plan(LlamaConfig.from_hf(hf | {"attention_bias": True}), 1, PS, 4)
    with pytest.raises(ValueError, match="page_size=12"):
        make_plan(LlamaConfig.from_hf(hf), 1, 12, 4)
    with pytest.raises(ValueError, match="head_dim=48"):
        make_plan(LlamaConfig.from_hf(hf | {"head_dim": 48}), 1, PS, 4)


def test_floor_counts_active_weights_and_context():
    m, _ = mini_model("moe")
    cfg = m.cfg
    plan = make_plan(cfg, 2, PS, 4)
    floor = schedule.floor_bytes(cfg, plan, [20, -1], [2, 2])
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    experts = 2 * 2 * 3 * d * f * 2  # two MoE layers, two distinct experts each, bf16
    assert floor["kv"] == cfg.num_layers * 20 * 2 * plan.kv * 2
    assert floor["embedding_rows"] == d * 2
    assert floor["weights"] > experts
    assert schedule.expected_distinct_experts(128, 8, 1) == 8
    assert 8 < schedule.expected_distinct_experts(128, 8, 8) <= 64


def test_logits_leave_vmem_and_batch_64_fits_8k_context():
    """The logits output is not VMEM-resident: only a 2-slot staging block is, and batch 64
    at 8192 tokens per row fits the budget for both real configs."""
    from kernels.registry import family_for

    for name in ("llama-3.1-8b", "qwen3-30b-a3b"):
        hf = json.loads((REPO / "configs" / "models" / f"{name}.json").read_text())
        cfg = family_for(hf["model_type"])[1].from_hf(hf)
        plan = make_plan(cfg, 64, 16, 512)
        stage = {s.name: s for s in plan.scratch()}["logits_stage"]
        assert stage.shape == (2, 64, plan.ta)
        assert all(shape[0] != plan.vocab_tiles for shape, _ in plan.io_vmem())
        assert plan.vmem_bytes() <= VMEM_BYTES - 8 * 2**20
        walked = schedule.dma_bytes(plan, [8191] * 64, [64] * len(plan.moe_layers))
        assert walked["logits"] == plan.vocab_tiles * 64 * plan.ta * 4
        no_logits = make_plan(cfg, 64, 16, 512, emit_logits=False)
        assert "logits_stage" not in {s.name for s in no_logits.scratch()}
        assert (
            schedule.dma_bytes(no_logits, [8191] * 64, [64] * len(plan.moe_layers))["logits"] == 0
        )
