"""Decode-step benchmark: ms/step and the fraction of the memory-bandwidth floor reached."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

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


@dataclass(frozen=True)
class DecodeRow:
    engine: str
    precision: str
    batch: int
    context: int
    ms_per_step: float
    tokens_per_s: float
    bytes_per_step: int
    floor_ms: float
    floor_fraction: float

    def as_dict(self) -> dict:
        return asdict(self)


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
) -> tuple[float, int]:
    """Median ms per decode step at `context` tokens of KV per sequence (contents don't
    matter), and the KV dtype's itemsize; `cfg` may override the model's (e.g. moe_impl)."""
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
    return summary.median_ms(times), pool.k.dtype.itemsize


def bench_ours(
    model: LoadedModel,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    bandwidth: float,
    page_size: int = 16,
    steps_per_call: int = 1,
) -> DecodeRow:
    """Our decode step's ms/step against the bandwidth floor."""
    ms, itemsize = time_decode(
        model, model.cfg, batch, context, steps, warmup, page_size, steps_per_call
    )
    nbytes = step_bytes(model, batch, context, itemsize)
    floor_ms = summary.floor_ms(nbytes, bandwidth)
    prec = {"float32": "f32", "bfloat16": "bf16"}[str(model.params["embed"].dtype)]
    return DecodeRow(
        "megaserve-xla",
        prec,
        batch,
        context,
        ms,
        summary.tokens_per_s(batch, ms),
        nbytes,
        floor_ms,
        summary.floor_fraction(floor_ms, ms),
    )
