"""`megaserve kernels compile --topology T --tp N`: the tensor-parallel decode step and prefill
chunk compiled over the 8 devices of tpu7x:2x2x1 from this CPU (a tiny config here; the
real-shape runs are in docs/parallel.md), the collectives read back from the HLO, and bad
meshes exiting 2 with the numbers named."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megaserve_app.collectives import Collective, collectives, summarize
from tests.conftest import REPO

# 8 query heads (tp 8 divides them), 2 KV heads (each replicated on 4 devices).
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}  # fmt: skip


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megaserve_app.cli", "kernels", "compile", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)


# The same attention with 8 routed experts of which each token takes 2, in every layer.
TINY_MOE = TINY | {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}  # fmt: skip


def _write(tmp_path, cfg: dict) -> str:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return str(p)


@pytest.fixture
def tiny_config(tmp_path):
    return _write(tmp_path, TINY)


@pytest.mark.tpu_compile
def test_tp_x_ep_on_a_tpu7x_host_compiles_the_moe_step(tmp_path):
    config = _write(tmp_path, TINY_MOE)
    r = _cli("--config", config, "--topology", "tpu7x:2x2x1", "--tp", "2", "--ep", "4",
             "--batch", "4", "--context", "256", "--chunk", "64", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    dec = res["decode"]
    assert res["compiled"] and (res["tp"], res["ep"]) == (2, 4)
    # Per layer: attention's psum over tp and the routed MLP's one psum over tp x ep.
    groups = dec["collective_rounds_by_kind"]["all-reduce"]
    assert groups == 2 * TINY_MOE["num_hidden_layers"], dec
    # Attention is replicated on the 4 ep shards: well over the even split of the floor.
    assert dec["bytes_over_floor"] > 1.5
    assert 0 < dec["experts_selected_fraction"] < 1


@pytest.mark.tpu_compile
def test_tp8_on_a_tpu7x_host_compiles_with_its_collectives(tiny_config):
    r = _cli("--config", tiny_config, "--topology", "tpu7x:2x2x1", "--tp", "8",
             "--batch", "4", "--context", "256", "--chunk", "64", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert (res["processes"], res["tp"], res["kv_replicas"], res["fits"]) == (1, 8, 4, True)
    dec, pre = res["decode"], res["prefill"]
    assert dec["compiled"] and pre["compiled"]
    # Two psums per layer (after o and after down), then the distributed argmax's all-gather
    # and the sampled rows' logits gather: read back from the compiled HLO, not counted here.
    assert dec["collective_rounds_by_kind"]["all-reduce"] == 2 * TINY["num_hidden_layers"]
    # Each psum is the f32 residual update of the batch: [4, 1, 256] x 4 bytes on one device.
    assert dec["ici_bytes_per_device"] >= 2 * 2 * (2 * 7 / 8) * 4 * 256 * 4
    assert pre["vmem_bytes"] > 0  # the Pallas ragged prefill kernel ran inside the mesh
    # KV replicated 4x: a device reads more than its even share of the single-device floor.
    assert dec["hbm_bytes_per_step"] > dec["floor_bytes_per_step"] > 0
    assert set(dec["projected_ms"]) == {"hbm", "ici", "rounds", "serial_total"}


@pytest.mark.tpu_compile
@pytest.mark.parametrize(
    "args, named",
    [
        (("--tp", "4"), ("4", "8")),  # the mesh must use every device of the topology
        (("--tp", "16", "--topology", "tpu7x:2x2x2"), ("tp=16", "8")),  # heads 8 % 16
        (("--tp", "8", "--topology", "tpu9:1x1"), ("tpu9:1x1",)),
    ],
    ids=["mesh-smaller-than-topology", "tp-not-dividing-heads", "unknown-topology"],
)
def test_bad_meshes_exit_2_naming_the_numbers(tiny_config, args, named):
    r = _cli("--config", tiny_config, *args)
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert all(n in r.stderr for n in named), r.stderr[-2000:]


def test_collectives_are_read_from_hlo_lines():
    hlo = "\n".join(
        [
            "  %all-reduce.1 = f32[8,1,4096]{2,0,1} all-reduce(%x), channel_id=1, "
            "replica_groups=mesh['tp'=8,'ep'=2] {'tp'}, to_apply=%add",
            "  %ag-start = (bf16[2,64]{1,0}, bf16[16,64]{1,0}) all-gather-start(%y), "
            "replica_groups=[2,8]<=[16], dimensions={0}",
            "  %ag-done = bf16[16,64]{1,0} all-gather-done(%ag-start)",
            "  %a2a = s32[4,4]{1,0} all-to-all(%z), replica_groups={{0,1},{2,3}}",
            "  %add.2 = f32[8]{0} add(%p, %q)",
        ]
    )
    ops = collectives(hlo)
    assert ops == [
        Collective("all-reduce", 8 * 4096 * 4, 8),
        Collective("all-gather", 16 * 64 * 2, 8),
        Collective("all-to-all", 64, 2),
    ]
    s = summarize(ops)
    assert s["collective_rounds"] == 3
    assert s["ici_bytes_per_device"] == int(131072 * 1.75 + 2048 * 7 / 8 + 64 / 2)
