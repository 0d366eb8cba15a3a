"""`megaserve kernels compile --topology T --tp N --megakernel`: the tensor-parallel megakernel
(h all-reduced inside the kernel by remote DMA) compiled over the 8 devices of tpu7x:2x2x1 at
Llama-3.1-70B's real shapes: inside VMEM, no copy of the pool around it, the kernel's own
collective rounds and only the argmax's all-gather left to XLA; bad requests exit 2."""

from __future__ import annotations

import json

import pytest

from tests.test_compile_mesh import TINY_MOE, _cli, _write, tiny_config  # noqa: F401

LLAMA_70B = "configs/models/llama-3.1-70b.json"
LAYERS_70B = 80


def _compile(*args: str) -> dict:
    r = _cli("--topology", "tpu7x:2x2x1", "--tp", "8", "--megakernel", "--json", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.tpu_compile
def test_llama_70b_tp8_batch_64_compiles_with_the_two_phase_all_reduce():
    res = _compile("--config", LLAMA_70B, "--batch", "64", "--context", "4096")
    dec = res["decode"]
    assert res["compiled"] and res["program"] == "megakernel" and res["kv_replicas"] == 1
    assert dec["vmem_bytes"] <= 64 * 2**20
    # The pool (2 x 5.4 GB per device here) is read by the kernel and its new pages scattered
    # in place after it: no copy of it around the kernel (`plan.pages_out`).
    assert dec["relayout_copies"] == [] and dec["hbm_temp_bytes"] < 64 * 2**20, dec
    ar = dec["in_kernel_all_reduce"]
    assert ar["kind"] == "two_phase" and ar["rounds"] == 2 * 2 * LAYERS_70B
    # XLA's only collective is the cross-shard argmax's all-gather.
    assert set(dec["xla_collectives"]["collective_rounds_by_kind"]) == {"all-gather"}
    assert 1.0 <= dec["bytes_over_floor"] < 1.02, dec["bytes_over_floor"]
    assert dec["argument_bytes"] < 96e9  # weights + pool fit one TensorCore's HBM


@pytest.mark.tpu_compile
def test_small_batch_uses_the_one_shot_all_reduce(tiny_config):  # noqa: F811
    res = _compile("--config", tiny_config, "--batch", "4", "--context", "256")
    ar = res["decode"]["in_kernel_all_reduce"]
    assert res["compiled"] and ar["kind"] == "one_shot" and ar["rounds"] == 2 * 2


@pytest.mark.tpu_compile
@pytest.mark.parametrize(
    "mesh, named",
    [(("--tp", "4", "--ep", "2"), ("--ep 2",)), (("--tp", "8"), ("tp=8", "MoE"))],
    ids=["ep", "moe-experts-not-split"],
)
def test_bad_megakernel_meshes_exit_2(tmp_path, mesh, named):
    config = _write(tmp_path, TINY_MOE)
    r = _cli("--config", config, "--topology", "tpu7x:2x2x1", "--megakernel", *mesh)
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert all(n in r.stderr for n in named), r.stderr[-2000:]
