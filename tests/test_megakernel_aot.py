"""The megakernel AOT-compiles for TPU v7 (tpu7x) at real model shapes, on this CPU host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.megakernel.aot import CompileRequest, compile_megakernel

# Every test here needs libtpu: skipped without it, failed under CI=true (conftest).
pytestmark = pytest.mark.usefixtures("libtpu")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "models"
MIB = 2**20


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
@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3.1-8b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("batch", [1, 8])
def test_real_shapes_compile_within_vmem_near_floor(name, batch):
    res = compile_megakernel(CompileRequest(str(CONFIGS / f"{name}.json"), "tpu7x", batch, 4096))
    assert res["compiled"], res.get("error")
    assert res["vmem_bytes"] < 64 * MIB
    # No re-layout copy of a weight ring or the KV pool around the kernel.
    assert res["relayout_copies"] == []
    if batch == 1:
        assert res["hbm_bytes_per_step"] <= 1.10 * res["floor_bytes_per_step"], res


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
