"""`megaserve bench prefill`: the FLOP count against a hand count, the run statistic, the
command end to end on the tiny model (ours only), bad flags, and the peers' "not installed"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kernels import llama
from megaserve_app.bench import peers
from megaserve_app.bench.prefill import markdown_table, prefill_flops, row_stats
from megaserve_app.cli import main
from tests.conftest import FIXTURES, REPO, tiny_llama_config

approx = pytest.approx
TINY = str(FIXTURES / "tiny" / "llama_gqa2")  # hidden 64, F 128, 2 layers, 4/2 heads of 16


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The command in its own process: it configures logging and compiles programs, which
    must not leak into the other tests' process (a closed capture stream, cache entries)."""
    cmd = [sys.executable, "-m", "megaserve_app.cli", "bench", "prefill", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def small_cfg():
    """The conftest tiny Llama: hidden 32, F 48, 2 layers, 4 heads / 2 KV heads of 8, V 96."""
    return llama.LlamaConfig.from_hf(tiny_llama_config())


def test_prefill_flops_match_a_hand_count():
    # Weights per layer: q/k/v 32 x (4 + 2 * 2) * 8 = 2048, o 32 * 32 = 1024, gate/up/down
    # 3 * 32 * 48 = 4608: 7680. 16 tokens: 2 * 16 * 7680 = 245760 per layer. Attention: 4 heads
    # x 8 dims x 4 (QK^T and PV, multiply + add) x 16^2 / 2 causal pairs = 16384 per layer.
    # Two layers: 524288; lm_head for the last token: 2 * 32 * 96 = 6144.
    assert prefill_flops(small_cfg(), 16) == 530432
    # Twice the tokens: the projections double, the attention quadruples, the lm_head stays.
    assert prefill_flops(small_cfg(), 32) == 2 * (2 * 245760 + 4 * 16384) + 6144


def test_row_stats_summarize_runs_per_prompt():
    raw = {"engine": "x", "precision": "f32", "batch": 2, "context": 16}
    row = row_stats(raw | {"times_s": [0.004, 0.002, 0.003]}, small_cfg(), gemm_gflops=2.0)
    # Each run prefills 2 prompts: 2.0, 1.0 and 1.5 ms per prompt.
    assert (row["ms_per_prompt"], row["ms_min"], row["ms_max"]) == approx((1.5, 1.0, 2.0))
    assert row["runs"] == 3 and row["length"] == 16 and row["batch"] == 2
    assert row["tokens_per_s"] == approx(16 / 1.5e-3)
    assert row["gflops"] == approx(530432 / 1.5e-3 / 1e9)
    assert row["gemm_fraction"] == approx(row["gflops"] / 2.0)
    assert row_stats(raw | {"error": "not installed"}, small_cfg(), 2.0) == {
        "engine": "x",
        "precision": "f32",
        "length": 16,
        "batch": 2,
        "error": "not installed",
    }


def test_bench_prefill_on_the_tiny_model(tmp_path):
    out = tmp_path / "prefill.json"
    argv = ["--checkpoint", TINY, "--lengths", "16,40", "--batch", "1,2", "--runs", "2"]
    argv += ["--chunk", "16", "--gemm-shape", "256,64,128", "--peers", "none"]
    r = _cli(*argv, "--json-out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout
    assert "| engine | precision | length | batch | ms/prompt median [min-max] |" in table
    for length in (16, 40):
        for batch in (1, 2):
            assert f"| megaserve-xla | f32 | {length} | {batch} |" in table
    result = json.loads(out.read_text())
    assert result["gemm"]["shape"] == [256, 64, 128]
    assert result["gemm"]["flops"] == 2 * 256 * 64 * 128
    assert result["page_table_tokens"] == 4096  # the prefill worker's default max_context
    rows = result["rows"]
    assert [(r["length"], r["batch"], r["chunks"]) for r in rows] == [
        (16, 1, 1),
        (16, 2, 1),
        (40, 1, 3),  # 16 + 16 + 8 tokens
        (40, 2, 3),
    ]
    # The fixture: weights per layer 64 x 8 x 16 + 4 x 16 x 64 + 3 x 64 x 128 = 36864;
    # 16 tokens: 2 layers x (2 x 16 x 36864 + 4 x 4 x 16 x 128) + 2 x 64 x 512 = 2490368.
    assert rows[0]["flops_per_prompt"] == 2490368
    for r in rows:
        assert len(r["times_s"]) == r["runs"] == 2
        assert r["ms_min"] <= r["ms_per_prompt"] <= r["ms_max"]
        assert r["tokens_per_s"] == approx(r["length"] * 1000 / r["ms_per_prompt"])
        assert r["gflops"] == approx(r["flops_per_prompt"] / r["ms_per_prompt"] / 1e6)
        assert r["gemm_fraction"] == approx(r["gflops"] / result["gemm"]["gflops"])


@pytest.mark.parametrize("bad", ["128,abc", "0", "128,,256"])
def test_bad_lengths_exit_2_naming_the_value(bad, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "prefill", "--lengths", bad, "--peers", "none"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    item = next(x for x in bad.split(",") if not x.isdigit() or x == "0")
    assert "--lengths" in err and f"{item!r} is not a positive integer" in err


@pytest.mark.parametrize(
    "flag, message",
    [
        (["--lengths", "16,300"], "--lengths 300 exceeds the model's max_position_embeddings 256"),
        (["--gemm-shape", "64,64"], "--gemm-shape 64,64 is not M,K,N"),
        (["--max-context", "16", "--lengths", "32"], "--max-context 16 is below --lengths 32"),
    ],
)
def test_values_the_model_or_runner_cannot_take_exit_2(flag, message):
    r = _cli("--checkpoint", TINY, "--peers", "none", *flag)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-3000:]


def test_peer_prefill_specs_and_llama_cpp_not_installed(monkeypatch, capsys):
    monkeypatch.setattr(peers, "llama_cpp_missing", lambda: True)
    monkeypatch.setattr(peers, "gguf_precision", lambda path: "q4_1")
    args = ["prefill", "--gguf", "m.gguf", "--lengths", "16,32", "--batch", "1", "--runs", "4"]
    peers.main(args + ["--engines", "llamacpp"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["engine"], r["context"], r["error"]) for r in rows] == [
        ("llama.cpp", 16, "not installed"),
        ("llama.cpp", 32, "not installed"),
    ]
    specs = peers.build_prefill_specs(
        peers_args(args + ["--engines", "transformers", "--batch", "1,4"])
    )
    assert [(s["context"], s["batch"]) for s in specs] == [(16, 1), (16, 4), (32, 1), (32, 4)]
    assert {(s["mode"], s["runs"], s["warmup"], s["steps"], s["precision"]) for s in specs} == {
        ("prefill", 4, 1, 0, "f32")
    }
    # The peers' rows go through the same statistic; an error row reads as its message.
    gemm = {"shape": [4, 4, 4], "times_s": [1.0], "gflops": 1.0, "gflops_min": 1, "gflops_max": 1}
    table = markdown_table(
        {
            "gemm": gemm,
            "settings": {"chunk": 256, "warmup": 1, "runs": 4},
            "page_table_tokens": 4096,
            "rows": [row_stats(r, small_cfg(), 1.0) for r in rows],
        }
    )
    assert "| llama.cpp | q4_1 | 16 | 1 | not installed | - | - | - |" in table


def peers_args(argv):
    """peers.py's parsed arguments for argv (its parser, without running the mode)."""
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    peers.add_prefill_parser(sub)
    return parser.parse_args(argv)
