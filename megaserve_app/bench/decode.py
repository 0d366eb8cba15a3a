"""Decode-step benchmark: ms/step of ours and the peers' steps, one statistic for all (the
median [min-max] of the timed steps), and the fraction of the memory-bandwidth floor reached."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels.kv_cache import KVPool
from megaserve.model import LoadedModel
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig
from megaserve.runner.xla import XlaRunner
from megaserve.sampling_params import SamplingArrays
from megaserve_app.bench import summary

ENGINE = "megaserve-xla"


def measure_read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s a jitted reduction reads from an array of `gib` GiB (best of `repeats`).

    This is how a decode step reads weights: one streaming pass, no writes.
    """
    n = int(gib * 2**30) // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    del x
    return n * 4 / best


def step_bytes(model: LoadedModel, batch: int, context: int, kv_itemsize: int) -> int:
    """Bytes one decode step must move: every weight once, each sequence's KV, new KV rows."""
    p = model.params
    weights = sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(p["layers"]))
    weights += int(p["lm_head"].nbytes) + int(p["final_norm"].nbytes)
    weights += batch * int(p["embed"].shape[1]) * p["embed"].dtype.itemsize
    cfg = model.cfg
    row = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_itemsize
    return weights + batch * context * row + batch * row


def time_decode(
    model: LoadedModel,
    cfg,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    page_size: int = 16,
    steps_per_call: int = 1,
) -> tuple[list[float], int]:
    """Seconds per decode step of each timed call (a call runs `steps_per_call` steps) at
    `context` tokens of KV per sequence (contents don't matter), after `warmup` untimed calls,
    and the KV dtype's itemsize; `cfg` may override the model's (e.g. moe_impl)."""
    pages = math.ceil((context + steps_per_call * (steps + warmup) + 1) / page_size)
    pool = KVPool.create(
        cfg.num_layers,
        batch * pages + 1,
        page_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        model.params["embed"].dtype,
    )
    runner = XlaRunner(
        model.family,
        cfg,
        model.params,
        pool,
        StepConfig(max_pages_per_seq=pages, steps_per_call=steps_per_call),
    )
    table = (1 + np.arange(batch * pages, dtype=np.int32)).reshape(batch, pages)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, batch).astype(np.int32)
    pos = np.full(batch, context - 1, np.int32)
    sampling = SamplingArrays.greedy(batch)
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        toks, _ = runner.decode(TokenBatch.decode(tokens, pos, table), sampling)
        dt = time.perf_counter() - t
        tokens, pos = toks[-1], pos + steps_per_call
        if i >= warmup:
            times.append(dt / steps_per_call)
    return times, pool.k.dtype.itemsize


def decode_row(raw: dict, bytes_per_step: int | None, bandwidth: float) -> dict:
    """Any engine's row from its timed steps (`times_s`, seconds each): ms/step as the median
    [min-max] of the steps, tokens/s of the median and, when the bytes a step must move are
    known, the bandwidth floor and the fraction of it reached. Error rows pass through."""
    row = {k: raw[k] for k in ("engine", "precision", "batch", "context")}
    if "error" in raw:
        return row | {"error": raw["error"]}
    stats = summary.run_stats(raw["times_s"])
    row |= stats.fields("ms_per_step")
    row["tokens_per_s"] = summary.tokens_per_s(row["batch"], stats.median_ms)
    if bytes_per_step is not None:
        floor = summary.floor_ms(bytes_per_step, bandwidth)
        row["bytes_per_step"], row["floor_ms"] = bytes_per_step, floor
        row["floor_fraction"] = summary.floor_fraction(floor, stats.median_ms)
    return row | {"times_s": raw["times_s"]}


def bench_ours(
    model: LoadedModel,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    bandwidth: float,
    page_size: int = 16,
    steps_per_call: int = 1,
) -> dict:
    """Our decode step's row (`decode_row`) against the bandwidth floor."""
    times, itemsize = time_decode(
        model, model.cfg, batch, context, steps, warmup, page_size, steps_per_call
    )
    prec = {"float32": "f32", "bfloat16": "bf16"}[str(model.params["embed"].dtype)]
    raw = {"engine": ENGINE, "precision": prec, "batch": batch, "context": context}
    return decode_row(
        raw | {"times_s": times}, step_bytes(model, batch, context, itemsize), bandwidth
    )


def with_peers(ours: list[dict], peers: list[dict], bandwidth: float) -> list[dict]:
    """Our rows, then the peers' raw rows through `decode_row`. A peer shares our floor only
    at our batch and precision: quantized weights move fewer bytes than ours."""
    by_batch = {r["batch"]: r for r in ours}
    rows = list(ours)
    for raw in peers:
        mine = by_batch.get(raw["batch"])
        same = mine is not None and mine["precision"] == raw["precision"]
        rows.append(decode_row(raw, mine["bytes_per_step"] if same else None, bandwidth))
    return rows


def markdown_table(rows: list[dict], bandwidth: float, warmup: int) -> str:
    """The rows as a markdown table under a line naming the bandwidth and the statistic."""
    lines = [
        f"# decode; read bandwidth {bandwidth / 1e9:.1f} GB/s; {warmup} warm-up steps, then "
        "ms/step = median [min-max] of the timed steps, tok/s of the median",
        "",
        "| engine | precision | batch | ctx | ms/step median [min-max] | steps | tok/s "
        "| MB/step | floor ms | of floor |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        head = f"| {r['engine']} | {r['precision']} | {r['batch']} | {r['context']} |"
        if "error" in r:
            lines.append(f"{head} {r['error'][:80]} | - | - | - | - | - |")
            continue
        spread = summary.spread_text(r["ms_per_step"], r["ms_min"], r["ms_max"])
        floor = "- | - | -"
        if "floor_ms" in r:
            floor = (
                f"{r['bytes_per_step'] / 1e6:.0f} | {r['floor_ms']:.1f} | "
                f"{100 * r['floor_fraction']:.0f}%"
            )
        lines.append(f"{head} {spread} | {r['runs']} | {r['tokens_per_s']:.1f} | {floor} |")
    return "\n".join(lines)
