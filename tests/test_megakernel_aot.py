"""The megakernel AOT-compiles for TPU v7 (tpu7x) at real model shapes, on this CPU host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.megakernel.aot import CompileRequest, compile_megakernel, load_config
from kernels.megakernel.fit import compile_fitting, is_vmem_oom, scoped_vmem

# Every test here needs libtpu: skipped without it, failed under CI=true (conftest).
pytestmark = pytest.mark.usefixtures("libtpu")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "models"
MIB = 2**20


@pytest.fixture(autouse=True)
def _verdict_cache(tmp_path, monkeypatch):
    """compile_fitting's verdict file goes to the test's tmp dir (the CLI inherits it)."""
    monkeypatch.setenv("MEGASERVE_CACHE_DIR", str(tmp_path / "cache"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "megaserve_app.cli", "kernels", "compile", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_compiles_smollm2_for_tpu7x():
    """`megaserve kernels compile --json` prints one JSON object and exits 0 (~20 s)."""
    p = _cli("--config", str(CONFIGS / "smollm2-135m.json"), "--target", "tpu7x", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout)
    assert res["compiled"] is True
    assert res["vmem_bytes"] < 64 * MIB
    for key in ("hbm_bytes_per_step", "floor_bytes_per_step", "projected_ms_per_step"):
        assert res[key] > 0
    assert res["relayout_copies"] == []


@pytest.mark.tpu_compile
# One batch per family here (CI compiles one representative of each); every model at batch
# 1/8/32/64 and 4k/32k is `scripts/megakernel_sweep.py` and `megaserve kernels compile`.
@pytest.mark.parametrize(
    ("name", "batch"), [("smollm2-135m", 8), ("llama-3.1-8b", 1), ("qwen3-30b-a3b", 8)]
)
def test_real_shapes_compile_within_vmem_near_floor(name, batch):
    res = compile_megakernel(CompileRequest(str(CONFIGS / f"{name}.json"), "tpu7x", batch, 4096))
    assert res["compiled"], res.get("error")
    assert res["vmem_bytes"] < 64 * MIB
    # No re-layout copy of a weight ring or the KV pool around the kernel.
    assert res["relayout_copies"] == []
    if batch == 1:
        assert res["hbm_bytes_per_step"] <= 1.10 * res["floor_bytes_per_step"], res


@pytest.mark.tpu_compile
@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_large_batches_compile_at_8k_context(name):
    """Batch 64 (the largest bucket; 32 is in the sweep) at 8192 tokens per row: logits
    leave VMEM by DMA, so the plan fits.

    Qwen3-30B-A3B's weights (61 GB) plus a pool of 64 full rows (51.5 GB) exceed one tpu7x
    TensorCore's 94.7 GB HBM (CompileTimeHbmOom), so that case gets a half-size pool: the
    kernel (page table, read items, VMEM) is the same.
    """
    batch = 64
    pool = 64 * 512 // 2 + 1 if name == "qwen3-30b-a3b" else None
    req = CompileRequest(str(CONFIGS / f"{name}.json"), "tpu7x", batch, 8192, pool_pages=pool)
    res = compile_megakernel(req)
    assert res["compiled"], res.get("error")
    assert res["vmem_bytes"] < 64 * MIB
    assert res["relayout_copies"] == []
    assert res["dma_bytes"]["logits"] > 0  # the logits tiles are the kernel's DMAs now


def test_vmem_oom_messages_are_recognised():
    msg = (
        "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: ... Scoped allocation with "
        "size 2.07M and limit 1.00M exceeded scoped vmem limit by 1.07M."
    )
    assert is_vmem_oom(msg)
    assert is_vmem_oom("INTERNAL: Mosaic: would exceed memory (size=67108864)")
    assert not is_vmem_oom("E2003: cannot statically prove that index is a multiple of 8")
    hbm = "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, ..."
    assert not is_vmem_oom(hbm)
    assert scoped_vmem(msg) == (round(2.07 * MIB), MIB)
    assert scoped_vmem("no sizes here") is None


def test_compile_fitting_shrinks_a_plan_the_compiler_refuses(tmp_path):
    """A ring too deep for the compiler's limit is refused, shrunk, compiled; the verdict is
    cached, so the second call compiles once (SmolLM2 under a 3.5 MiB limit, ~15 s)."""
    cfg = load_config(str(CONFIGS / "smollm2-135m.json"))
    cache = tmp_path / "verdicts.json"
    # make_plan keeps depth 6 (its own budget is ample); the compiler's limit is not.
    shape = dict(depth_a=6, vmem_limit=7 * MIB // 2, cache=cache)
    first = compile_fitting(cfg, 8, 16, 64, **shape)
    assert first.refused and not first.from_cache
    assert all(is_vmem_oom(msg) for _, msg in first.refused)
    assert first.plan.depth_a < 6
    assert first.plan.vmem_bytes() < first.refused[0][0]
    assert first.compiled is not None
    second = compile_fitting(cfg, 8, 16, 64, **shape)
    assert second.from_cache and not second.refused
    assert second.plan == first.plan


@pytest.mark.tpu_compile
def test_cli_reports_compiler_failure():
    """A ring too deep for VMEM: exit 1, compiled=false, and the compiler's own message."""
    p = _cli(
        "--config", str(CONFIGS / "llama-3.1-8b.json"), "--depth-a", "8", "--batch", "1", "--json"
    )
    assert p.returncode == 1 and p.stdout.strip(), p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["compiled"] is False
    assert res["vmem_bytes"] > 64 * MIB
    assert "vmem" in res["error"].lower() or "memory" in res["error"].lower()
    assert p.stderr.strip()


def test_cli_rejects_bad_requests():
    bad = REPO / "configs" / "models" / "missing.json"
    p = _cli("--config", str(bad))
    assert p.returncode == 2 and "missing.json" in p.stderr
    p = _cli("--config", str(CONFIGS / "smollm2-135m.json"), "--target", "v7x")
    assert p.returncode == 2 and "'v7x'" in p.stderr
