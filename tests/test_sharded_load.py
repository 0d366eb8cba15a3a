"""Sharded checkpoint loading (`megaserve.checkpoint.sharded`): the same tp-split params, bit
for bit, as packing the whole model and splitting it, and a process's peak RSS bounded by its
devices' share of a checkpoint many times larger, not by the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megaserve.checkpoint.sharded import CHUNK_PEAK, TensorFiles
from megaserve.errors import CheckpointError
from megaserve.model import LoadedModel
from megaserve.parallel.mesh import ParallelConfig
from tests.conftest import FIXTURES, REPO
from tests.test_tensor_parallel import _devices_env

# Allocator and interpreter noise on top of the stated per-block bound.
RSS_SLACK = 8 << 20


def _child(n_devices: int, *args: str, timeout: int = 300) -> dict:
    """tests/sharded_load_child.py in a fresh process with n_devices host devices."""
    cmd = [sys.executable, "-m", "tests.sharded_load_child", *args]
    run = subprocess.run(
        cmd, cwd=REPO, env=_devices_env(n_devices), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_sharded_params_equal_packed_then_split(tmp_path):
    """TP=2 and TP=4 on the transformers fixtures, in f32 and bf16: llama_gqa2 (TP=4
    replicates each of 2 KV heads), llama_gqa1 (4 KV heads, none replicated), qwen3 q/k
    norms, qwen2 q/k/v biases, a tied embedding, a checkpoint in 7 files, and a bf16 qwen2
    file with one KV head and a vocabulary of 97 (lm_head padding). Then greedy tokens
    through the tp runner from the sharded load, which keeps those params."""
    names = ["llama_gqa2", "llama_gqa1", "qwen3_qknorm", "qwen2_bias", "llama_tied"]
    dirs = [str(tmp_path / "odd"), *(str(FIXTURES / "tiny" / n) for n in names)]
    dirs.append(str(FIXTURES / "tiny" / "llama_sharded"))
    out = _child(4, "equal", *dirs, "--tp", "2", "4")
    assert len(out["cases"]) == len(dirs) * 2 * 2
    assert out["mismatches"] == []
    assert out["generate"] == {"same": True, "kept": True}


def test_peak_rss_is_bounded_by_the_share_not_the_checkpoint(tmp_path):
    """A 412 MiB f32 checkpoint; device 0 of tp=8 holds 53 MiB of it. Building (and keeping)
    that device's blocks with the loader's own per-block functions grows the peak RSS by at
    most its share plus one read chunk: the per-block part of the stated bound (on CPU the
    loader's 2 x share adds the device copy jax makes of each block). Its largest tensors
    are 64 MiB: a loader that read any of them whole (or touched it through a memmap) would
    exceed this."""
    d = tmp_path / "big"
    size = _child(1, "write", str(d))["bytes"]
    out = _child(8, "rss", str(d), "8")
    if not out["reset"]:
        pytest.skip("this kernel does not let /proc/self/clear_refs reset the peak RSS")
    share, growth = out["share"], out["growth"]
    print(f"checkpoint {size / 2**20:.0f} MiB, share {share / 2**20:.1f} MiB, "
          f"peak RSS growth {growth / 2**20:.1f} MiB")  # fmt: skip
    assert out["values"]
    assert size >= 7 * share
    assert growth <= share + CHUNK_PEAK + RSS_SLACK, (growth, share)
    assert growth < size / 4


def test_load_sharded_declines_what_it_does_not_cover():
    """A GGUF file or Qwen3-MoE: None, so the caller loads whole and the runner splits."""
    tp2 = ParallelConfig(tp=2)
    assert LoadedModel.load_sharded(str(FIXTURES / "tiny" / "missing.gguf"), None, tp2) is None
    moe = FIXTURES / "tiny" / "qwen3_moe_e8k2"
    assert LoadedModel.load_sharded(str(moe), None, tp2) is None


def test_missing_or_misshapen_tensors_are_named():
    from megaserve.checkpoint.hf import tensor_index

    index = tensor_index(FIXTURES / "tiny" / "llama_gqa2")
    with TensorFiles(index) as src:
        with pytest.raises(ValueError, match="missing tensor 'nope'"):
            src.need("nope", (1,))
        with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(64,\)"):
            src.need("model.norm.weight", (65,))


def test_truncated_file_is_a_checkpoint_error(tmp_path):
    from megaserve.checkpoint.safetensors_file import read_header

    src = FIXTURES / "tiny" / "llama_gqa2" / "model.safetensors"
    cut = tmp_path / "model.safetensors"
    cut.write_bytes(src.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        read_header(cut)
