"""The XLA decode step: one program per call, KV pool donated (never copied), bounded compiles."""

from __future__ import annotations

import re

import jax
import numpy as np

from kernels.kv_cache import KVPool
from megaserve.runner.batch import TokenBatch
from megaserve.runner.buckets import StepConfig
from megaserve.runner.xla import XlaRunner
from megaserve.sampling_params import SamplingArrays, SamplingParams


def _runner(model, step_cfg: StepConfig, pages: int = 33, page_size: int = 8) -> XlaRunner:
    cfg = model.cfg
    pool = KVPool.create(cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return XlaRunner(model.family, cfg, model.params, pool, step_cfg)


def test_decode_step_donates_pool_in_place(tiny_model):
    r = _runner(tiny_model, StepConfig(max_pages_per_seq=8))
    k_before, v_before = r.pool.k, r.pool.v
    k_ptr, v_ptr = k_before.unsafe_buffer_pointer(), v_before.unsafe_buffer_pointer()
    table = np.arange(1, 9, dtype=np.int32)[None]
    r.decode(
        TokenBatch.decode(np.array([3], np.int32), np.array([0], np.int32), table),
        SamplingArrays.greedy(1),
    )
    # The old arrays were donated: deleted, and the new pool lives in the same buffers.
    assert k_before.is_deleted() and v_before.is_deleted()
    assert r.pool.k.unsafe_buffer_pointer() == k_ptr
    assert r.pool.v.unsafe_buffer_pointer() == v_ptr


def test_decode_program_has_no_pool_copy(tiny_model):
    """The compiled step aliases the pool input to its output and copies no pool-sized buffer."""
    r = _runner(tiny_model, StepConfig(max_pages_per_seq=8))
    table = np.zeros((1, 8), np.int32)
    r.decode(
        TokenBatch.decode(np.array([3], np.int32), np.array([0], np.int32), table),
        SamplingArrays.greedy(1),
    )
    fn = r._decode[(1, False)]
    args = (
        r.params,
        r.pool.k,
        r.pool.v,
        np.zeros(1, np.int32),
        np.zeros(1, np.int32),
        table,
        SamplingArrays.greedy(1).padded(1),
    )
    hlo = fn.lower(*args).compile().as_text()
    assert "input_output_alias" in hlo
    shape = "f32[" + ",".join(map(str, r.pool.k.shape)) + "]"
    copies = [
        ln for ln in hlo.splitlines() if re.search(r"= " + re.escape(shape) + r"\S* copy\(", ln)
    ]
    assert copies == [], copies


def test_one_device_program_per_call(tiny_model):
    r = _runner(tiny_model, StepConfig(max_pages_per_seq=8, steps_per_call=4))
    table = np.arange(1, 9, dtype=np.int32)[None]
    args = (
        TokenBatch.decode(np.array([3], np.int32), np.array([0], np.int32), table),
        SamplingArrays.greedy(1),
    )
    r.decode(*args)
    calls = []
    fn = r._decode[(4, False)]
    orig = fn.__call__

    class Counting:
        def __call__(self, *a, **k):
            calls.append(1)
            return orig(*a, **k)

        def __getattr__(self, n):
            return getattr(fn, n)

    r._decode[(4, False)] = Counting()
    toks, _ = r.decode(*args)
    assert toks.shape == (4, 1) and len(calls) == 1  # four steps, one executable launch
    assert fn._cache_size() == 1


def test_multi_step_equals_single_steps(tiny_model):
    table = np.arange(1, 9, dtype=np.int32)[None]
    outs = []
    for n in (1, 4):
        r = _runner(tiny_model, StepConfig(max_pages_per_seq=8, steps_per_call=n))
        prompt = np.array([[5, 9, 2, 7]], np.int32)
        tok, _ = r.prefill(
            TokenBatch.from_padded(prompt, np.arange(4, dtype=np.int32)[None], table),
            SamplingArrays.greedy(1),
        )
        seq, pos = [int(tok[0])], 4
        while len(seq) < 12:
            toks, _ = r.decode(
                TokenBatch.decode(np.array([seq[-1]], np.int32), np.array([pos], np.int32), table),
                SamplingArrays.build([SamplingParams(temperature=0.8, seed=7)]),
            )
            seq += toks[:, 0].tolist()
            pos += n
        outs.append(seq[:12])
    assert outs[0] == outs[1]


def test_compiled_programs_bounded_by_buckets(tiny_model):
    step_cfg = StepConfig(batch_buckets=(1, 2, 4, 8), max_pages_per_seq=4)
    r = _runner(tiny_model, step_cfg, pages=40)
    rng = np.random.default_rng(0)
    for b in range(1, 9):
        for width in range(1, 5):
            table = rng.integers(1, 40, (b, width)).astype(np.int32)
            r.decode(
                TokenBatch.decode(
                    rng.integers(0, 90, b).astype(np.int32), np.zeros(b, np.int32), table
                ),
                SamplingArrays.greedy(b),
            )
    limit = len(step_cfg.batch_buckets) * len(step_cfg.page_buckets)
    assert r.compiled_programs == limit  # 32 shapes requested, 4 x 3 programs built
    assert r._decode[(1, False)]._cache_size() <= limit
    jax.clear_caches()
