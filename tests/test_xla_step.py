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
    hlo = r.programs_run.executables["decode", (1, 8, 1)].as_text()
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
    key = ("decode", (1, 8, 4))
    exe = r.programs_run.executables[key]

    def counting(*a):
        calls.append(1)
        return exe(*a)

    r.programs_run.executables[key] = counting
    toks, _ = r.decode(*args)
    assert toks.shape == (4, 1) and len(calls) == 1  # four steps, one executable launch
    assert len(r.programs_run) == 1


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
    assert step_cfg.page_buckets == (4,)  # below MIN_PAGE_WIDTH: one width, the maximum
    assert r.compiled_programs == limit  # 32 shapes requested, 4 x 1 programs built
    assert len(r.programs_run) == limit
    decode_set = {(p.name, p.key) for p in r.programs() if p.name == "decode"}
    assert set(r.programs_run.executables) == decode_set
    jax.clear_caches()


def test_warm_up_covers_every_call(tiny_model):
    """After warm_up, prefill chunks, decode steps of every batch and page width, penalized
    and sampled rows, and page writes/reads compile nothing more."""
    step_cfg = StepConfig.for_limits(4, 32, 16, prefill_rows=2)
    r = _runner(tiny_model, step_cfg, pages=70)
    programs = r.programs() + r.pool.page_programs(16, read=True, write=True)
    n, _ = r.programs_run.warm(p for p in programs if not p.name.startswith("kv_"))
    r.pool.programs_run.warm(p for p in programs if p.name.startswith("kv_"))
    names = {p.name for p in programs}
    assert names == {"decode", "prefill", "pick", "kv_write", "kv_read"}
    # batch 1,2,4 x widths 8,16 + prefill rows 1,2 x chunks 16,32 + pick per batch 1,2,4
    assert n == 3 * 2 + 2 * 2 + 3
    rng = np.random.default_rng(1)
    vocab = tiny_model.cfg.vocab_size
    penal = SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5)
    for rows, width, chunk in ((1, 3, 20), (2, 16, 7)):
        table = np.stack([np.arange(1 + 16 * i, 1 + 16 * i + width) for i in range(rows)])
        toks = rng.integers(0, vocab, (rows, chunk)).astype(np.int32)
        pos = np.tile(np.arange(chunk, dtype=np.int32), (rows, 1))
        batch = TokenBatch.from_padded(toks, pos, table.astype(np.int32))
        hist = [(t.tolist(), []) for t in toks]
        r.prefill(batch, SamplingArrays.build([penal] * rows, hist, vocab))
    for b in (1, 3, 4):
        table = rng.integers(1, 70, (b, int(rng.integers(1, 17)))).astype(np.int32)
        batch = TokenBatch.decode(np.zeros(b, np.int32), np.full(b, 5, np.int32), table)
        r.decode(batch, SamplingArrays.greedy(b))
        hist = [([1, 2], [3])] * b
        r.decode(batch, SamplingArrays.build([penal] * b, hist, vocab), want_logits=True)
    k, v = (rng.normal(size=r.pool.heads_shape(11)).astype(np.float32) for _ in range(2))
    r.pool.write_pages(np.arange(40, 51, dtype=np.int32), k, v)
    r.pool.read_pages(list(range(40, 51)))
    assert r.programs_run.late_compiles == 0 and r.pool.programs_run.late_compiles == 0
