"""`megaserve kernels compile-worker`: a worker's whole program set compiled for tpu7x from
this CPU. One representative per role and family here (tiny configs; the real-shape sweeps
are in docs/programs.md): every program compiles, the report holds each program's memory and
re-layout count and the per-device memory plan; bad requests exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import FIXTURES, REPO


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megaserve_app.cli", "kernels", "compile-worker", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


SMALL = ("--max-context", "64", "--prefill-chunk", "16", "--kv-budget-mb", "16", "--json")


@pytest.mark.tpu_compile
@pytest.mark.parametrize(
    "config, role, extra, names",
    [
        (
            "llama_gqa2",
            "decode",
            ("--max-running", "2"),
            {"pallas_decode", "prefill", "prefill_logprobs", "pick", "kv_write"},
        ),
        ("qwen3_moe_e8k2", "prefill", ("--max-batch", "2"), {"prefill", "pick", "kv_read"}),
    ],
    ids=["llama-decode", "qwen3_moe-prefill"],
)
def test_compile_worker_compiles_the_whole_set(config, role, extra, names):
    r = _cli("--config", str(FIXTURES / "tiny" / config / "config.json"), "--role", role,
             *extra, *SMALL)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["all_compiled"] and res["role"] == role
    assert {p["name"] for p in res["programs"]} == names
    for p in res["programs"]:
        assert p["compiled"] and p["hbm_temp_bytes"] is not None and p["relayout_ops"] >= 0
    mem = res["hbm_per_device"]
    per_page = mem["kv_pool"] // mem["kv_pool_pages"]
    assert 16 * 2**20 - per_page < mem["kv_pool"] <= 16 * 2**20  # --kv-budget-mb 16
    assert mem["capacity"] == int(94.74 * 2**30)  # read back from the compiler's HBM refusal
    assert mem["total"] == mem["weights"] + mem["kv_pool"] + mem["temp_max"] and res["fits"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (("--role", "decode", "--target", "v9"), "target 'v9' is not one of"),
        (("--role", "decode", "--max-running", "0"), "--max-running=0 must be >= 1"),
        (("--role", "serve"), "argument --role: invalid choice: 'serve'"),
    ],
)
def test_bad_requests_exit_2(args, needle):
    r = _cli("--config", str(FIXTURES / "tiny" / "llama_gqa2" / "config.json"), *args, timeout=300)
    assert r.returncode == 2 and needle in r.stderr, r.stderr[-2000:]


def test_a_batch_the_megakernel_cannot_plan_is_lowered_as_the_worker_does():
    """Qwen3-14B at batch 64 needs 60.2 MiB of VMEM (56 MiB budget): the worker serves at
    most 32 at once (`fit_running`), and compile-worker builds that set and says why. No
    compile here: the program set and the report's fields only."""
    from megaserve_app.compile_worker import WorkerTarget, _setup

    t = WorkerTarget(str(REPO / "configs" / "models" / "qwen3-14b.json"), max_running=64)
    programs, runner, _, backend, _, served = _setup(t, 64)
    assert backend == "pallas"
    assert max(p.key[0] for p in programs if p.name == "pallas_decode") == 32
    assert served["max_running_served"] == 32
    assert (
        "lowered from 64" in served["max_running_why"] and "60.2 MiB" in served["max_running_why"]
    )
