"""The megakernel's static cost model: its flop count equals one counted from the model's
shapes alone, and at batch 8 and 4k context on Llama-3.1-8B the decode attention's compute
time is at most its K/V read time (the issue's bar for MXU-shaped attention)."""

from __future__ import annotations

import math

from kernels.megakernel import cost
from kernels.megakernel.aot import load_config
from kernels.megakernel.plan import make_plan
from tests.conftest import REPO

LLAMA = str(REPO / "configs" / "models" / "llama-3.1-8b.json")


def _llama_flops(hf: dict, batch: int, position: int, page_size: int, block_keys: int) -> dict:
    """2*M*K*N per matmul the step must run, from the HF config: every row projects its
    token through each layer and the vocab (padded to 1024-lane tiles, the kv width) and
    attends over its earlier tokens in whole blocks of `block_keys` keys."""
    d, hq, hkv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim", d // hq)
    layers, inter, vocab = hf["num_hidden_layers"], hf["intermediate_size"], hf["vocab_size"]
    kv = hkv * hd
    vocab_p = math.ceil(vocab / kv) * kv
    per_layer = 2 * d * (hq * hd + 2 * kv) + 2 * hq * hd * d + 2 * 3 * d * inter
    keys = math.ceil(position / block_keys) * block_keys
    attention = 4 * hq * hd * keys  # q.K and p.V over every key of the blocks read
    # The new token's per-head score: [G, kv] x [kv, 128] and back, f32 at 6 bf16 passes.
    start = 2 * (2 * (hq // hkv) * kv * 128) * 6
    return {
        "attention": batch * layers * (attention + start),
        "total": batch * (layers * (per_layer + attention + start) + 2 * d * vocab_p),
    }


def test_flops_equal_a_count_from_the_shapes():
    import json

    hf = json.load(open(LLAMA))
    cfg = load_config(LLAMA)
    for batch, context in ((1, 4096), (8, 4096), (32, 32768)):
        plan = make_plan(cfg, batch, 16, context // 16)
        got = cost.step_cost(plan, [context - 1] * batch)
        want = _llama_flops(hf, batch, context - 1, 16, plan.block_width)
        assert got["attention"]["mxu_flops"] == want["attention"], (batch, context)
        assert got["total"]["mxu_flops"] == want["total"], (batch, context)


def test_llama_attention_compute_fits_under_its_kv_read_at_batch_8_4k():
    plan = make_plan(load_config(LLAMA), 8, 16, 4096 // 16)
    attention = cost.step_cost(plan, [4095] * 8)["attention"]
    assert attention["compute_ms"] <= attention["hbm_ms"], attention
    assert attention["bound"] == "hbm"
