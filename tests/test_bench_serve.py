"""`megaserve bench serve` smoke test: both layouts as real processes on the tiny chat model,
concurrency 1 and 2, a few requests each; rows, zero errors, tokens/s and the PNG."""

from __future__ import annotations

import json

from megaserve_app.bench.serve import Mix, Settings, bench_serve, markdown_table, plot
from tests.stack import make_chat_checkpoint


def test_mix_is_deterministic_and_in_range():
    mix = Mix.parse("short:8-16:3,long:100-120:1", "4-8", seed=5)
    a, b = mix.draw(64, 384, 1), mix.draw(64, 384, 1)
    assert a == b and a != mix.draw(64, 384, 2)
    lengths = [len(p) for p, _ in a]
    assert all(8 <= n <= 16 or 100 <= n <= 120 for n in lengths)
    assert any(n >= 100 for n in lengths) and any(n <= 16 for n in lengths)
    assert all(4 <= m <= 8 for _, m in a)
    assert "short 8-16 (75%)" in mix.describe()


def test_bench_serve_smoke(tmp_path):
    ck = make_chat_checkpoint(tmp_path / "ck")
    s = Settings(
        checkpoint=str(ck),
        concurrency=(1, 2),
        requests_per_level=3,
        mix=Mix.parse("short:16-48:0.7,long:100-160:0.3", "4-8"),
        max_context=512,
        kv_budget_mb=8,
        worker_args=("--prefill-chunk", "64"),
        decode_cpu_nice=3,  # the disaggregated decode worker starts with --cpu-nice 3
        cpu_turns=True,  # and both disaggregated workers with --cpu-turns on one file
        prefill_chunk=32,  # the prefill worker's --prefill-chunk (after worker_args' 64)
    )
    partial = []
    out = bench_serve(s, log=lambda *_: None, on_row=partial.append)
    assert [len(p["rows"]) for p in partial] == [1, 2, 3, 4] and partial[-1]["partial"]
    rows = {(r["layout"], r["concurrency"]): r for r in out["rows"]}
    assert set(rows) == {(lay, c) for lay in ("disaggregated", "colocated") for c in (1, 2)}
    for (layout, _), r in rows.items():
        assert r["errors"] == 0, r["error_messages"]
        assert r["requests"] == 3 and r["output_tok_s"] > 0 and r["ttft_p50_ms"] > 0
        # Disaggregated: every prompt's KV came from the prefill worker; colocated: none.
        assert r["via_prefill_tier"] == (3 if layout == "disaggregated" else 0)
    assert "| disaggregated | 2 | 3 |" in markdown_table(out["rows"])
    png = plot(out["rows"], tmp_path / "serve.png", "smoke")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    json.dumps(out)  # the --json-out payload serializes
