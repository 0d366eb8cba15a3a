"""`megaserve bench`: the benchmark subcommands; decode and prefill run beside their peers."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from megaserve.worker_args import nice_increment, positive_int
from megaserve_app.bench.router_cli import add_router

REPO = Path(__file__).resolve().parents[2]


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse type for a comma-separated list of positive ints (exit 2 naming a bad one)."""
    return tuple(positive_int(x) for x in text.split(","))


def add_peer_arguments(p) -> None:
    also = "also run transformers and llama.cpp from --ref-python if it exists"
    p.add_argument("--peers", default="auto", choices=("auto", "none"), help=also)
    p.add_argument("--ref-python", default=str(REPO / ".venv-ref" / "bin" / "python"))


def _add_prefill(bsub) -> None:
    pf = bsub.add_parser("prefill", help="prefill ms/prompt and GFLOP/s vs peers and a GEMM")
    pf.add_argument("--checkpoint", default="smollm2")
    pf.add_argument("--lengths", type=positive_ints, default="128,1024,4096,8192")
    pf.add_argument("--batch", type=positive_ints, default="1,4", help="prompts per run")
    pf.add_argument("--runs", type=positive_int, default=3, help="timed runs per row")
    pf.add_argument("--warmup", type=positive_int, default=1, help="untimed runs first")
    pf.add_argument("--chunk", type=positive_int, help="ours: tokens per call (the worker's)")
    pf.add_argument("--max-context", type=positive_int, help="ours: page-table width, tokens")
    pf.add_argument("--gemm-shape", type=positive_ints, default="4096,576,1536", help="M,K,N")
    add_peer_arguments(pf)
    pf.add_argument("--json-out", help="also write all rows to this JSON file")
    pf.set_defaults(func=cmd_bench_prefill)


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    d = bsub.add_parser("decode", help="decode step ms/step vs peers and the bandwidth floor")
    d.add_argument("--checkpoint", default="smollm2")
    d.add_argument("--batch", default="1,8,32")
    d.add_argument("--context", type=int, default=512)
    d.add_argument("--steps", type=int, default=16)
    d.add_argument("--warmup", type=int, default=3)
    d.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    d.add_argument("--steps-per-call", type=int, default=1)
    add_peer_arguments(d)
    d.add_argument("--json-out", help="also write all rows to this JSON file")
    d.set_defaults(func=cmd_bench_decode)
    _add_prefill(bsub)
    m = bsub.add_parser(
        "moe", help="MoE decode on a random Qwen3-MoE, served vs dense (or --prefill-tokens)"
    )
    m.add_argument("--batch", default="1,8,32")
    m.add_argument("--context", type=int, default=512)
    m.add_argument("--steps", type=int, default=10)
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument(
        "--prefill-tokens",
        type=positive_ints,
        help="instead: one prefill MoE layer at these token counts, ours vs ragged_dot vs dense",
    )
    m.add_argument("--runs", type=positive_int, default=5, help="--prefill-tokens: timed calls")
    m.add_argument("--json-out")
    m.set_defaults(func=cmd_bench_moe)
    sv = bsub.add_parser("server", help="decode worker over real gRPC vs the in-process step")
    sv.add_argument("--checkpoint", default="smollm2")
    sv.add_argument("--concurrency", default="1,8,32")
    sv.add_argument("--prompt-len", type=int, default=128)
    sv.add_argument("--new-tokens", type=int, default=64)
    sv.add_argument("--json-out")
    sv.set_defaults(func=cmd_bench_server)
    dg = bsub.add_parser("disagg", help="prefill->decode hand-off: TTFT split, KV GB/s")
    dg.add_argument("--checkpoint", default="smollm2")
    dg.add_argument("--lengths", default="128,1024,4096")
    dg.add_argument("--raw-only", action="store_true", help="only the transport GB/s rows")
    dg.add_argument("--json-out")
    dg.set_defaults(func=cmd_bench_disagg)
    add_router(bsub)
    se = bsub.add_parser(
        "serve", help="closed-loop service load: disaggregated vs colocated through the router"
    )
    se.add_argument("--checkpoint", default="smollm2")
    se.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    se.add_argument(
        "--requests-per-level", type=int, help="default: max(16, 2 x concurrency), capped"
    )
    se.add_argument("--max-requests-per-level", type=int, default=64, help="the default's cap")
    se.add_argument(
        "--prompt-mix",
        default="short:32-128:0.6,medium:256-512:0.3,long:1024-1536:0.1",
        help="name:LO-HI:WEIGHT,... prompt tokens (log-uniform within a bin)",
    )
    se.add_argument("--output-lens", default="16-128", help="LO-HI new tokens (log-uniform)")
    se.add_argument("--seed", type=int, default=0)
    se.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    se.add_argument("--slo-itl-ms", type=float, default=200.0, help="on a request's mean ITL")
    se.add_argument("--layouts", default="disaggregated,colocated")
    se.add_argument("--max-context", type=int, default=2048)
    se.add_argument("--kv-budget-mb", type=int, default=1536, help="per worker")
    se.add_argument(
        "--cpu-turns",
        action="store_true",
        help="the disaggregated layout's prefill and decode workers take turns on the cores "
        "(their --cpu-turns on one lock file)",
    )
    se.add_argument(
        "--prefill-chunk",
        type=positive_int,
        help="the disaggregated prefill worker's --prefill-chunk (default: the worker's own)",
    )
    se.add_argument(
        "--decode-cpu-nice",
        type=nice_increment,
        default=0,
        help="the disaggregated decode worker's --cpu-nice (it shares the cores with the "
        "prefill worker)",
    )
    se.add_argument("--json-out")
    se.add_argument("--plot", default=str(REPO / "docs" / "bench_serve.png"), help="PNG path")
    se.set_defaults(func=cmd_bench_serve)
    st = bsub.add_parser(
        "startup", help="a worker's seconds to SERVING, cold then warm compilation cache"
    )
    st.add_argument("--role", choices=("decode", "prefill"), default="decode")
    st.add_argument("--runs", type=int, default=2, help="starts over one cache (first: cold)")
    st.add_argument("--cache-dir", help="an existing cache (every start then counts as warm)")
    st.add_argument("worker_args", nargs="*", help="after --: the worker's own flags")
    st.set_defaults(func=cmd_bench_startup)


def cmd_bench_startup(a) -> int:
    from megaserve_app.bench.startup import bench_startup

    for row in bench_startup(a.role, a.worker_args, a.cache_dir, a.runs):
        print(json.dumps(row), flush=True)
    return 0


def _peer_rows(a, gguf: Path, mode: str, mode_args: list[str]) -> list[dict]:
    """peers.py `mode` run from the reference env on the GGUF (and its F32 copy): its rows."""
    ref = Path(a.ref_python)
    skip = "--peers none" if a.peers == "none" else None
    skip = skip or (None if ref.exists() else f"no {ref}; `make ref-env` builds it")
    skip = skip or (None if gguf.suffix == ".gguf" else f"{gguf} is not a GGUF file")
    if skip:
        print(f"peers skipped ({skip})", file=sys.stderr)
        return []
    f32 = REPO / ".cache" / "smollm2-f32.gguf"
    f32.parent.mkdir(exist_ok=True)
    script = str(Path(__file__).with_name("peers.py"))
    env = {**os.environ, "GGML_NO_BACKTRACE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [str(ref), script, "make-f32", "--src", str(gguf), "--dst", str(f32)], check=False, env=env
    )
    cmd = [str(ref), script, mode, "--gguf", str(gguf), "--f32-gguf", str(f32), *mode_args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    rows = []
    for line in out.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if out.returncode:
        print(out.stderr[-2000:], file=sys.stderr)
    return rows


def cmd_bench_decode(a: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from megaserve.checkpoint import resolve_checkpoint_path
    from megaserve.model import LoadedModel
    from megaserve_app.bench.decode import (
        bench_ours,
        markdown_table,
        measure_read_bandwidth,
        with_peers,
    )

    batches = [int(b) for b in a.batch.split(",")]
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[a.dtype]
    model = LoadedModel.load(a.checkpoint, dtype=dtype, progress=False)
    bw = measure_read_bandwidth()
    print(
        f"read bandwidth: {bw / 1e9:.1f} GB/s (jitted sum over 1 GiB, best of 5)", file=sys.stderr
    )
    ours = [
        bench_ours(model, b, a.context, a.steps, a.warmup, bw, steps_per_call=a.steps_per_call)
        for b in batches
    ]
    # The peers time the same number of steps after the same warm-up.
    peer_args = ["--batch", a.batch, "--context", str(a.context), "--steps", str(a.steps)]
    peer_args += ["--warmup", str(a.warmup)]
    peers = _peer_rows(a, resolve_checkpoint_path(a.checkpoint), "decode", peer_args)
    rows = with_peers(ours, peers, bw)
    print(markdown_table(rows, bw, a.warmup))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"bandwidth_Bps": bw, "rows": rows}, indent=1))
    return 0


def cmd_bench_prefill(a: argparse.Namespace) -> int:
    from megaserve_app.bench.prefill import run

    return run(a, _peer_rows)


def cmd_bench_moe(a: argparse.Namespace) -> int:
    from megaserve_app.bench import summary
    from megaserve_app.bench.decode import measure_read_bandwidth
    from megaserve_app.bench.moe import bench_moe, random_moe_model

    if a.prefill_tokens:
        return _bench_moe_prefill(a)
    model = random_moe_model()
    bw = measure_read_bandwidth()
    rows = []
    for impl in ("auto", "dense"):
        for b in (int(x) for x in a.batch.split(",")):
            rows.append(bench_moe(model, b, a.context, a.steps, a.warmup, bw, impl))
    cfg = model.cfg
    print(
        f"# MoE decode: {cfg.num_layers} layers, {cfg.num_experts} experts, top-{cfg.top_k}, "
        f"read bandwidth {bw / 1e9:.1f} GB/s"
    )
    print(
        f"{'engine':<26}{'batch':>6}{'ms/step median [min-max]':>26}{'tok/s':>8}"
        f"{'dense MB':>9}{'expert MB':>10}{'KV MB':>7}{'experts/layer':>14}{'of floor':>9}"
    )
    for r in rows:
        print(
            f"{r['engine']:<26}{r['batch']:>6}"
            f"{summary.spread_text(r['ms_per_step'], r['ms_min'], r['ms_max']):>26}"
            f"{r['tokens_per_s']:>8.1f}"
            f"{r['dense_bytes'] / 1e6:>9.1f}{r['expert_bytes_read'] / 1e6:>10.1f}"
            f"{r['kv_bytes'] / 1e6:>7.1f}{r['distinct_experts_per_layer']:>14.1f}"
            f"{100 * r['floor_fraction']:>8.0f}%"
        )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"bandwidth_Bps": bw, "rows": rows}, indent=1))
    return 0


def _bench_moe_prefill(a: argparse.Namespace) -> int:
    from megaserve_app.bench import summary
    from megaserve_app.bench.moe import PREFILL_SHAPES, SLOW_CALL_S, bench_moe_prefill

    print(
        f"# MoE prefill layer, f32, ms per call: median [min-max] of `runs` calls after "
        f"{max(1, a.warmup)} warm-up (one call where the warm-up took over {SLOW_CALL_S:.0f} s)"
    )
    print("| shape (D, I, E, k) | tokens | impl | ms | runs | active GFLOP/s | max diff vs dense |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for shape, dims in PREFILL_SHAPES.items():
        for n in a.prefill_tokens:
            for r in bench_moe_prefill(shape, n, a.runs, a.warmup):
                rows.append(r)
                ms = summary.spread_text(r["ms_per_call"], r["ms_min"], r["ms_max"])
                print(f"| {shape} {dims} | {n} | {r['impl']} | {ms} | {r['runs']} | "
                      f"{r['active_gflop_per_s']:.1f} | {r['max_abs_diff_vs_dense']:.1e} |",
                      flush=True)  # fmt: skip
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


def cmd_bench_server(a: argparse.Namespace) -> int:
    from megaserve.logs import configure
    from megaserve.model import LoadedModel
    from megaserve_app.bench.decode import bench_ours
    from megaserve_app.bench.server import admission_cost, bench_server

    configure("warning")
    model = LoadedModel.load(a.checkpoint, progress=False)
    rows = []
    print(
        f"{'conc':>5}{'server tok/s':>13}{'in-proc tok/s':>14}{'ratio':>7}{'ITL p50':>9}"
        f"{'ITL p99':>9}{'TTFT p50':>10}"
    )
    for c in (int(x) for x in a.concurrency.split(",")):
        r = bench_server(model, c, a.prompt_len, a.new_tokens)
        # The same step in-process, at the context the streams average mid-generation.
        ctx = a.prompt_len + a.new_tokens // 2
        ref = bench_ours(model, c, ctx, steps=8, warmup=2, bandwidth=1e12)
        r["inproc_tokens_per_s"] = ref["tokens_per_s"]
        r["ratio"] = r["decode_tokens_per_s"] / ref["tokens_per_s"]
        rows.append(r)
        print(
            f"{c:>5}{r['decode_tokens_per_s']:>13.1f}{ref['tokens_per_s']:>14.1f}"
            f"{r['ratio']:>7.2f}{r['itl_p50_ms']:>9.1f}{r['itl_p99_ms']:>9.1f}"
            f"{r['ttft_p50_ms']:>10.1f}"
        )
    adm = admission_cost(model)
    print(
        f"admission of a {adm['prompt_len']}-token prompt beside {adm['running']} streams: "
        f"their ITL median {adm['itl_median_ms']:.1f} ms, max during the admission "
        f"{adm['itl_max_during_admission_ms']:.1f} ms"
    )
    rows.append({"admission": adm})
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))
    return 0


def cmd_bench_disagg(a: argparse.Namespace) -> int:
    from megaserve.logs import configure
    from megaserve.malloc import keep_large_buffers
    from megaserve.model import LoadedModel
    from megaserve_app.bench import summary
    from megaserve_app.bench.disagg import bench_disagg, bench_raw_transfer

    configure("warning")
    keep_large_buffers()  # as the workers do: both ends of the push run in this process
    model = LoadedModel.load(a.checkpoint, progress=False)
    lengths = tuple(int(x) for x in a.lengths.split(","))
    rows = [] if a.raw_only else bench_disagg(model, lengths)
    print(
        "# hand-off per prompt, ms; transfer = first chunk sent .. commit (overlaps compute); "
        "tail = transfer after compute ended; hidden = 1 - tail / raw push of the same bytes"
    )
    print(
        f"{'transport':<14}{'prompt':>7}{'MB':>7}{'reserve':>9}{'compute':>9}{'transfer':>9}"
        f"{'tail':>8}{'raw':>8}{'hidden':>8}{'1st tok':>9}{'1st step':>9}"
    )
    for r in rows:
        print(
            f"{r['transport']:<14}{r['prompt']:>7}{r['bytes'] / 1e6:>7.1f}"
            f"{r['reserve_ms']:>9.1f}{r['prefill_compute_ms']:>9.1f}{r['transfer_ms']:>9.1f}"
            f"{r['transfer_tail_ms']:>8.1f}{r['raw_push_ms']:>8.1f}"
            f"{100 * r['hidden_fraction']:>7.0f}%{r['first_token_ms']:>9.1f}"
            f"{r['first_decode_step_ms']:>9.1f}"
        )
    raw = bench_raw_transfer(model, max(lengths))
    print(
        "# KV transfer alone: pre-made pages into a reservation (checksums, staging and the "
        "commit into the pool included) vs a bare gRPC bytes stream of the same message "
        "sizes; median [min-max] ms of the interleaved rounds after a warm-up, GB/s of the median"
    )
    for r in raw:
        ceiling = f"  {100 * r['of_ceiling']:5.1f}% of bare" if "of_ceiling" in r else ""
        print(
            f"{r['transport']:<17}{r['bytes'] / 1e6:>6.1f} MB "
            f"{summary.spread_text(r['ms'], r['ms_min'], r['ms_max'])} ms ({r['runs']} runs) "
            f"{r['GBps']:>5.2f} GB/s{ceiling}  memcpy {r['memcpy_GBps']:.1f} GB/s "
            f"({r['ratio']:.3f})"
        )
    rows = {"handoff": rows, "raw": raw}
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))
    return 0


def cmd_bench_serve(a) -> int:
    from megaserve_app.bench.serve import Mix, Settings, bench_serve
    from megaserve_app.bench.serve_report import markdown_table, plot

    s = Settings(
        checkpoint=a.checkpoint,
        concurrency=tuple(int(c) for c in a.concurrency.split(",")),
        requests_per_level=a.requests_per_level,
        max_requests=a.max_requests_per_level,
        mix=Mix.parse(a.prompt_mix, a.output_lens, a.seed),
        slo_ttft_ms=a.slo_ttft_ms,
        slo_itl_ms=a.slo_itl_ms,
        layouts=tuple(a.layouts.split(",")),
        max_context=a.max_context,
        kv_budget_mb=a.kv_budget_mb,
        decode_cpu_nice=a.decode_cpu_nice,
        cpu_turns=a.cpu_turns,
        prefill_chunk=a.prefill_chunk,
    )
    print(f"mix: {s.mix.describe()}")
    print(f"SLO: TTFT <= {s.slo_ttft_ms:g} ms and mean ITL <= {s.slo_itl_ms:g} ms")
    save = (lambda o: Path(a.json_out).write_text(json.dumps(o, indent=1))) if a.json_out else None
    out = bench_serve(s, on_row=save)
    print(markdown_table(out["rows"]))
    print(f"runtime {out['runtime_s']:.0f} s")
    if a.plot:
        title = (
            f"{a.checkpoint}: {s.mix.describe()}; goodput SLO: TTFT <= {s.slo_ttft_ms:g} ms "
            f"and mean ITL <= {s.slo_itl_ms:g} ms"
        )
        print(f"plot: {plot(out['rows'], a.plot, title)}")
    if save:
        save(out)
    errors = sum(r["errors"] for r in out["rows"])
    if errors:
        print(f"{errors} requests failed", file=sys.stderr)
    return 1 if errors else 0
