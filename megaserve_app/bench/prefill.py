"""Prefill benchmark: ms per prompt, tokens/s and GFLOP/s of our serving prefill and its peers.

"Ours" is the prefill worker's path: `XlaRunner.prefill` over a paged KV pool, each prompt fed
in chunks of the worker's default size (`PrefillConfig.chunk`), every chunk one call of the
prefill program at the runner's full page-table width: the worker's default `max_context`, or
the longest prompt when that is longer (`--max-context` sets it). Batch B means B prompts of
the same length prefilled together, one row each in every call, as the prefill tier batches
them. A plain f32 GEMM (jax, [M, K] x [K, N]) timed in the same process is the yardstick.

Every engine gets the same statistic: `warmup` untimed runs (they compile), then `runs` timed
ones; `row_stats` turns each engine's run seconds (the peers send theirs raw) into ms per
prompt = one run's wall time / B, as the median and the min-max spread of the runs
(`summary.run_stats`, the statistic `megaserve bench decode` uses too), and the tokens/s and
GFLOP/s of that median.

FLOPs are model FLOPs, counted the same way for every engine, so GFLOP/s compares engines
(and the GEMM), not what each engine happens to execute:

    per prompt of T tokens:  L * (2 * T * W + 2 * H * Dh * T^2) + 2 * D * V
    W = D * (H + 2 * Hkv) * Dh + H * Dh * D + 3 * D * F   weights per layer: q/k/v, o,
                                                          gate/up and down projections
    2 * H * Dh * T^2 = 4 * H * Dh * (T^2 / 2)             QK^T and PV, H query heads, over the
                                                          causal half of the T x T scores
    2 * D * V                                             lm_head, for the last token only
    GEMM:                    2 * M * K * N

(L layers, D hidden, F intermediate, H / Hkv query / KV heads of Dh dims, V vocabulary). Left
out: norms, RoPE, softmax, SiLU, the embedding gather. Work beyond the count (our runner
attends over its whole page-table width and projects every chunk's last token to logits)
shows as a lower GFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels import llama
from kernels.kv_cache import KVPool
from megaserve.checkpoint import resolve_checkpoint_path
from megaserve.errors import RequestError
from megaserve.logs import configure
from megaserve.model import LoadedModel
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig
from megaserve.runner.factory import make_runner
from megaserve.sampling_params import SamplingArrays
from megaserve_app.bench import summary
from prefill_service.engine import PrefillConfig, step_config

ENGINE = "megaserve-xla"
GEMM_RUNS = 5
FLOPS_FORMULA = (
    "per prompt of T tokens: L*(2*T*W + 2*H*Dh*T^2) + 2*D*V, W = D*(H+2*Hkv)*Dh + H*Dh*D + 3*D*F "
    "(projection weights per layer); attention counted over the causal half (T^2/2 score "
    "pairs, QK^T and PV); lm_head for the last token only; GEMM: 2*M*K*N"
)


@dataclass(frozen=True)
class PrefillBench:
    """What one `megaserve bench prefill` measures."""

    lengths: tuple[int, ...]
    batches: tuple[int, ...]
    runs: int = 3
    warmup: int = 1
    chunk: int = PrefillConfig.chunk  # the prefill worker's default
    max_context: int | None = None  # page-table width in tokens; None: see the docstring
    gemm: tuple[int, int, int] = (4096, 576, 1536)  # M, K, N: SmolLM2's gate/up shape


def prefill_flops(cfg, length: int) -> float:
    """Model FLOPs to prefill one prompt of `length` tokens (the module docstring's formula)."""
    d, dh, h, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    weights = d * (h + 2 * hkv) * dh + h * dh * d + 3 * d * cfg.intermediate_size
    attention = 4 * h * dh * (length * length / 2)
    return cfg.num_layers * (2 * length * weights + attention) + 2 * d * cfg.vocab_size


def time_gemm(shape: tuple[int, int, int], runs: int = GEMM_RUNS) -> dict:
    """A jitted f32 [M, K] x [K, N] matmul: run seconds and GFLOP/s (median, min, max)."""
    m, k, n = shape
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k), np.float32))
    b = jnp.asarray(rng.standard_normal((k, n), np.float32))
    f = jax.jit(jnp.matmul)
    f(a, b).block_until_ready()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    flops = 2 * m * k * n
    stats = summary.run_stats(times)
    return {
        "shape": [m, k, n],
        "flops": flops,
        "times_s": times,
        "gflops": flops / stats.median_ms / 1e6,
        "gflops_min": flops / stats.max_ms / 1e6,
        "gflops_max": flops / stats.min_ms / 1e6,
    }


def row_stats(raw: dict, cfg, gemm_gflops: float) -> dict:
    """One engine's row from its raw run seconds (`times_s`, each run prefilling `batch`
    prompts of `context` tokens); error rows pass through with their message."""
    batch, length = raw["batch"], raw["context"]
    row = {k: raw[k] for k in ("engine", "precision")} | {"length": length, "batch": batch}
    if "error" in raw:
        return row | {"error": raw["error"]}
    stats = summary.run_stats(raw["times_s"], per=batch)
    ms = stats.median_ms
    flops = prefill_flops(cfg, length)
    gflops = flops / ms / 1e6
    row |= stats.fields("ms_per_prompt")
    return row | {
        "tokens_per_s": summary.tokens_per_s(length, ms),
        "flops_per_prompt": flops,
        "gflops": gflops,
        "gemm_fraction": gflops / gemm_gflops,
        "times_s": raw["times_s"],
        "chunks": raw.get("chunks"),  # ours only: prefill program calls per run
    }


def width_tokens(s: PrefillBench) -> int:
    """Tokens the runner's page table spans (what every prefill chunk attends over), in
    whole pages."""
    tokens = s.max_context or max(PrefillConfig.max_context, max(s.lengths))
    return PrefillConfig.page_size * math.ceil(tokens / PrefillConfig.page_size)


def check(model: LoadedModel, s: PrefillBench) -> None:
    """RequestError naming the value the model or the runner cannot take."""
    if len(s.gemm) != 3:
        raise RequestError(f"--gemm-shape {','.join(map(str, s.gemm))} is not M,K,N")
    cfg = model.cfg
    if model.family is not llama:
        raise RequestError(
            f"model_type {cfg.model_type!r}: prefill FLOPs are counted for the dense Llama "
            f"family ({', '.join(llama.MODEL_TYPES)}) only"
        )
    for n in s.lengths:
        if n > cfg.max_position_embeddings:
            raise RequestError(
                f"--lengths {n} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
    if max(s.lengths) > width_tokens(s):
        raise RequestError(f"--max-context {s.max_context} is below --lengths {max(s.lengths)}")


def time_ours(model: LoadedModel, s: PrefillBench) -> list[dict]:
    """Raw rows (run seconds) of our chunked prefill for every length and batch."""
    cfg, ps = model.cfg, PrefillConfig.page_size
    width = width_tokens(s) // ps
    # Up to the worker's max_batch prompts share a call; a larger --batch gets them all.
    pc = PrefillConfig(
        max_context=width * ps,
        chunk=s.chunk,
        max_batch=max(PrefillConfig.max_batch, *s.batches),
    )
    most = max(s.batches) * math.ceil(max(s.lengths) / ps)
    pool = KVPool.create(
        cfg.num_layers, most + 1, ps, cfg.num_kv_heads, cfg.head_dim, model.params["embed"].dtype
    )
    runner = make_runner(
        model.family, cfg, model.params, pool, step_config(pc, width), backend="xla"
    )
    rows = []
    for length in s.lengths:
        for batch in s.batches:
            times = time_prefill(runner, cfg.vocab_size, length, batch, s)
            rows.append(
                {
                    "engine": ENGINE,
                    "precision": "f32",
                    "batch": batch,
                    "context": length,
                    "chunks": len(pieces(runner.step_cfg, length)),
                    "times_s": times,
                }
            )
    return rows


def pieces(step: StepConfig, length: int) -> list[int]:
    """Tokens per call of one prompt prefilled alone, as the worker's scheduler cuts them
    (`StepConfig.prefill_pieces`: the chunk, and a last piece cut where that pads less)."""
    out = []
    while (done := sum(out)) < length:
        out.append(step.prefill_pieces([length - done])[0])
    return out


def time_prefill(runner, vocab: int, length: int, batch: int, s: PrefillBench) -> list[float]:
    """Run seconds of `batch` random prompts prefilled chunk by chunk, after the warm-up."""
    ps = PrefillConfig.page_size
    n_pages = math.ceil(length / ps)
    # Row r owns its own pages (1-based: page 0 is the null page); no prefix sharing.
    pages = 1 + np.arange(batch * n_pages, dtype=np.int32).reshape(batch, n_pages)
    ids = np.random.default_rng(0).integers(0, vocab, (batch, length), dtype=np.int32)
    sampling = SamplingArrays.greedy(batch)
    cuts = pieces(runner.step_cfg, length)
    times = []
    for i in range(s.warmup + s.runs):
        t = time.perf_counter()
        start = 0
        for n in cuts:
            rows = [(ids[r, start : start + n].tolist(), start, pages[r]) for r in range(batch)]
            runner.prefill(TokenBatch.from_rows(rows), sampling)  # returns host arrays: synced
            start += n
        if i >= s.warmup:
            times.append(time.perf_counter() - t)
    return times


def bench_prefill(model: LoadedModel, s: PrefillBench, peer_rows: Callable[[], list[dict]]) -> dict:
    """The GEMM, our rows, then the peers' raw rows (`peer_rows`, run after ours so they do
    not compete for the cores), all summarized by `row_stats`, grouped by length and batch."""
    check(model, s)
    gemm = time_gemm(s.gemm)
    raw = time_ours(model, s) + peer_rows()
    rows = [row_stats(r, model.cfg, gemm["gflops"]) for r in raw]
    rows.sort(key=lambda r: (r["length"], r["batch"]))  # stable: ours first in each group
    return {
        "settings": asdict(s),
        "page_table_tokens": width_tokens(s),
        "flops_formula": FLOPS_FORMULA,
        "gemm": gemm,
        "rows": rows,
    }


def markdown_table(out: dict) -> str:
    """The result as a markdown table, preceded by the GEMM and the settings."""
    g, s = out["gemm"], out["settings"]
    m, k, n = g["shape"]
    lines = [
        f"# prefill; f32 GEMM [{m}, {k}] x [{k}, {n}] in our process: {g['gflops']:.1f} GFLOP/s "
        f"(median of {len(g['times_s'])}, {g['gflops_min']:.1f}-{g['gflops_max']:.1f})",
        f"# ours: chunk {s['chunk']}, page table {out['page_table_tokens']} tokens; "
        f"{s['warmup']} warm-up + {s['runs']} timed runs per row; ms/prompt = run / batch",
        "",
        "| engine | precision | length | batch | ms/prompt median [min-max] | tok/s | GFLOP/s "
        "| of GEMM |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in out["rows"]:
        head = f"| {r['engine']} | {r['precision']} | {r['length']} | {r['batch']} |"
        if "error" in r:
            lines.append(f"{head} {r['error'][:80]} | - | - | - |")
            continue
        lines.append(
            f"{head} {summary.spread_text(r['ms_per_prompt'], r['ms_min'], r['ms_max'])} | "
            f"{r['tokens_per_s']:.1f} | {r['gflops']:.1f} | {100 * r['gemm_fraction']:.0f}% |"
        )
    return "\n".join(lines)


def run(a: argparse.Namespace, peer_rows: Callable[..., list[dict]]) -> int:
    """`megaserve bench prefill` on its parsed flags; peer_rows(a, gguf, mode, mode_args) runs
    peers.py in the reference environment and returns its rows."""
    configure("warning")
    chunk = a.chunk or PrefillBench.chunk
    s = PrefillBench(a.lengths, a.batch, a.runs, a.warmup, chunk, a.max_context, a.gemm_shape)
    model = LoadedModel.load(a.checkpoint, progress=False)
    csv = ",".join
    peer_args = ["--lengths", csv(map(str, s.lengths)), "--batch", csv(map(str, s.batches))]
    peer_args += ["--runs", str(s.runs), "--warmup", str(s.warmup)]
    gguf = resolve_checkpoint_path(a.checkpoint)
    out = bench_prefill(model, s, lambda: peer_rows(a, gguf, "prefill", peer_args))
    out["checkpoint"] = a.checkpoint
    print(markdown_table(out))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))
    return 0
