"""`megaserve bench decode`: peers send raw step times that go through our statistic, the same
step counts reach them, the floor is shared only at equal precision, the table, and the
command end to end on the tiny model (ours only)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megaserve_app.bench import cli, decode, peers
from tests.conftest import FIXTURES, REPO

approx = pytest.approx
TINY = str(FIXTURES / "tiny" / "llama_gqa2")


def _ours(batch: int, ms: float) -> dict:
    raw = {"engine": decode.ENGINE, "precision": "f32", "batch": batch, "context": 64}
    return decode.decode_row(raw | {"times_s": [ms / 1000] * 3}, 2_000_000_000, 1e12)


def test_peer_decode_rows_are_raw_timed_steps_summarized_like_ours():
    spec = {"warmup": 2, "precision": "f32", "batch": 4, "context": 512}
    raw = peers.decode_result(spec, [1.0, 1.0, 0.010, 0.030, 0.020], peers.LLAMA_ENGINE)
    # The warm-up steps are left out; no summary on the peer's side.
    assert raw == {
        "engine": "llama.cpp",
        "precision": "f32",
        "batch": 4,
        "context": 512,
        "times_s": [0.010, 0.030, 0.020],
    }
    row = decode.with_peers([], [raw], 1e12)[0]
    assert (row["ms_per_step"], row["ms_min"], row["ms_max"], row["runs"]) == approx(
        (20.0, 10.0, 30.0, 3)
    )
    assert row["tokens_per_s"] == approx(200.0)  # 4 tokens per 20 ms step


def test_peers_share_our_floor_only_at_our_batch_and_precision():
    ours = [_ours(1, 4.0), _ours(8, 10.0)]
    f32 = {"engine": "transformers", "precision": "f32", "batch": 8, "context": 64}
    q4 = {"engine": "llama.cpp", "precision": "q4_1", "batch": 8, "context": 64}
    other = dict(f32, batch=32)
    failed = dict(f32, batch=1, error="timeout after 5s")
    times = {"times_s": [0.005, 0.004, 0.006]}
    rows = decode.with_peers(ours, [f32 | times, q4 | times, other | times, failed], 1e12)
    assert rows[:2] == ours
    assert rows[2]["floor_ms"] == ours[1]["floor_ms"] == 2.0  # 2 GB at 1 TB/s
    assert rows[2]["floor_fraction"] == approx(0.4)  # 2 ms of floor / 5 ms median
    assert "floor_ms" not in rows[3] and "floor_ms" not in rows[4]  # Q4_1; batch 32
    assert rows[5] == failed
    table = decode.markdown_table(rows, 1e12, warmup=3)
    assert "3 warm-up steps, then ms/step = median [min-max] of the timed steps" in table
    ours_8 = "| megaserve-xla | f32 | 8 | 64 | 10.0 [10.0-10.0] | 3 | 800.0 | 2000 | 2.0 | 20% |"
    assert ours_8 in table
    assert "| llama.cpp | q4_1 | 8 | 64 | 5.0 [4.0-6.0] | 3 | 1600.0 | - | - | - |" in table
    assert "| transformers | f32 | 1 | 64 | timeout after 5s | - | - | - | - | - |" in table


def test_peers_time_the_same_steps_after_the_same_warmup(monkeypatch, tmp_path, capsys):
    """cmd_bench_decode passes its --steps/--warmup to the peers and summarizes their rows
    with ours (model, bandwidth and our measurement stubbed)."""
    import megaserve.checkpoint
    import megaserve.model

    monkeypatch.setattr(megaserve.model.LoadedModel, "load", lambda *a, **k: None)
    monkeypatch.setattr(megaserve.checkpoint, "resolve_checkpoint_path", lambda c: c)
    monkeypatch.setattr(decode, "measure_read_bandwidth", lambda: 1e12)
    calls = []

    def ours(model, batch, context, steps, warmup, bw, steps_per_call=1):
        calls.append(("ours", steps, warmup))
        return _ours(batch, 4.0)

    def peer_rows(a, gguf, mode, args):
        calls.append((mode, args))
        spec = {"warmup": 1, "precision": "f32", "batch": 1, "context": 64}
        return [peers.decode_result(spec, [1.0, 0.004, 0.008, 0.006], peers.HF_ENGINE)]

    monkeypatch.setattr(decode, "bench_ours", ours)
    monkeypatch.setattr(cli, "_peer_rows", peer_rows)
    out = tmp_path / "decode.json"
    a = SimpleNamespace(checkpoint="m", batch="1", context=64, steps=3, warmup=1, dtype="f32")
    a.steps_per_call, a.json_out = 1, out
    assert cli.cmd_bench_decode(a) == 0
    assert calls == [
        ("ours", 3, 1),
        ("decode", ["--batch", "1", "--context", "64", "--steps", "3", "--warmup", "1"]),
    ]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["ms_per_step"], r["runs"]) for r in rows] == [
        ("megaserve-xla", 4.0, 3),
        ("transformers", 6.0, 3),
    ]
    assert "| transformers | f32 | 1 | 64 | 6.0 [4.0-8.0] | 3 |" in capsys.readouterr().out


def test_bench_decode_on_the_tiny_model(tmp_path):
    """The command in its own process (it compiles programs and sizes a 1 GiB array)."""
    out = tmp_path / "decode.json"
    argv = ["--checkpoint", TINY, "--batch", "1,2", "--context", "16", "--steps", "3"]
    argv += ["--warmup", "1", "--peers", "none", "--json-out", str(out)]
    cmd = [sys.executable, "-m", "megaserve_app.cli", "bench", "decode", *argv]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| engine | precision | batch | ctx | ms/step median [min-max] | steps |" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["batch"], r["runs"]) for r in rows] == [
        ("megaserve-xla", 1, 3),
        ("megaserve-xla", 2, 3),
    ]
    for row in rows:
        assert len(row["times_s"]) == 3
        assert row["ms_min"] <= row["ms_per_step"] <= row["ms_max"]
        assert row["tokens_per_s"] == approx(row["batch"] * 1000 / row["ms_per_step"])
        assert row["floor_fraction"] == approx(row["floor_ms"] / row["ms_per_step"])
