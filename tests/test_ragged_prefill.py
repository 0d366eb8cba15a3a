"""The Pallas ragged prefill kernel: equals its reference in the TPU interpreter on ragged
batches, is what a prefill program lowered for TPU runs, and compiles for tpu7x at real
shapes inside VMEM."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels.paged_attention import _ragged_from_rows, paged_attention_reference
from kernels.ragged_prefill import (
    RaggedPrefillConfig,
    ragged_prefill_attention,
    ragged_prefill_attention_reference,
)


def _ragged_case(hq, hkv, d, row, new, cached, ps=16, bq=16, dtype=jnp.float32, seed=0):
    """A pool, page tables and queries for sequences with `new` tokens after `cached` ones;
    each sequence's rows start at a multiple of bq. Returns (args, valid row mask)."""
    rng = np.random.default_rng(seed)
    kv_len = [c + n for c, n in zip(cached, new)]
    pps = max(-(-k // ps) for k in kv_len) + 1
    n_pages = len(new) * pps + 1
    k = rng.standard_normal((2, n_pages, ps, row)).astype(np.float32)
    v = rng.standard_normal((2, n_pages, ps, row)).astype(np.float32)
    # Pages scattered over the pool, as a busy allocator hands them out.
    table = rng.permutation(np.arange(1, n_pages))[: len(new) * pps].reshape(len(new), pps)
    starts, r = [], 0
    for n in new:
        starts.append(r)
        r += -(-n // bq) * bq
    t = r + bq  # a trailing padding block
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    valid = np.zeros(t, bool)
    for s, n in zip(starts, new):
        valid[s : s + n] = True
    args = (
        jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), 1,
        jnp.asarray(starts, jnp.int32), jnp.asarray(new, jnp.int32),
        jnp.asarray(kv_len, jnp.int32), jnp.asarray(table, jnp.int32), d**-0.5, hkv,
        RaggedPrefillConfig(block_q=bq, pages_per_block=2),
    )  # fmt: skip
    return args, valid


CASES = {
    # (Hq, Hkv, D, row, new tokens, cached tokens)
    "gqa4-d64-lane-padded": (8, 2, 64, 128, [5, 20], [0, 37]),
    "d128-chunks-across-pages": (8, 2, 128, 256, [17, 3, 40], [100, 0, 16]),
    "smollm2-heads-3x64-in-256": (9, 3, 64, 256, [33, 1], [250, 7]),
    "empty-beside-thousands": (4, 1, 128, 128, [24, 16], [0, 2100]),
    "unused-slot": (4, 2, 64, 128, [16, 0, 9], [16, 0, 31]),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference_in_interpreter(case):
    args, valid = _ragged_case(*CASES[case])
    ref = np.asarray(ragged_prefill_attention_reference(*args))
    out = np.asarray(ragged_prefill_attention(*args, interpret=pltpu.InterpretParams()))
    np.testing.assert_allclose(out[valid], ref[valid], rtol=2e-5, atol=2e-5)
    assert np.isfinite(out).all()  # rows past a sequence's tokens: finite, discarded
    assert np.all(out[-args[-1].block_q :] == 0)  # a block no sequence owns: zeros


def test_bf16_within_bf16_tolerance():
    args, valid = _ragged_case(*CASES["d128-chunks-across-pages"], dtype=jnp.bfloat16)
    ref = np.asarray(ragged_prefill_attention_reference(*args), np.float32)
    out = np.asarray(ragged_prefill_attention(*args, interpret=pltpu.InterpretParams()))
    np.testing.assert_allclose(out[valid].astype(np.float32), ref[valid], rtol=3e-2, atol=3e-2)


def test_reference_equals_the_whole_table_attention():
    """The ragged reference agrees with the engines' whole-table reference on padded rows."""
    (q, k, v, layer, starts, new, kv_len, table, scale, hkv, cfg), valid = _ragged_case(
        *CASES["d128-chunks-across-pages"]
    )
    ragged = np.asarray(ragged_prefill_attention_reference(q, k, v, layer, starts, new, kv_len,
                                                           table, scale, hkv, cfg))  # fmt: skip
    for s in range(len(new)):
        n, start = int(new[s]), int(starts[s])
        pos = jnp.arange(int(kv_len[s]) - n, int(kv_len[s]), dtype=jnp.int32)[None]
        whole = paged_attention_reference(
            q[None, start : start + n], k, v, layer, pos, table[s : s + 1], scale, hkv
        )
        np.testing.assert_allclose(ragged[start : start + n], whole[0], rtol=1e-5, atol=1e-5)


def test_padded_rows_adapter_equals_reference():
    """What the prefill program runs on TPU: a [B, T] batch of one sequence per row with
    padding after each row's tokens, through the kernel, equals the whole-table reference."""
    rng = np.random.default_rng(3)
    b, t, hq, hkv, d, ps = 3, 32, 4, 2, 64, 16
    k = jnp.asarray(rng.standard_normal((2, 40, ps, 128)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 40, ps, 128)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, 40))[: b * 8].reshape(b, 8), jnp.int32)
    starts, lens = [0, 45, 70], [32, 7, 20]
    pos = np.full((b, t), -1, np.int32)
    for i, (s, n) in enumerate(zip(starts, lens)):
        pos[i, :n] = np.arange(s, s + n)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.float32)
    pos = jnp.asarray(pos)
    want = paged_attention_reference(q, k, v, 1, pos, table, d**-0.5, hkv)
    got = _ragged_from_rows(q, k, v, pos, table, 1, d**-0.5, hkv, 16, pltpu.InterpretParams())
    keep = np.asarray(pos) >= 0
    np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(want)[keep], rtol=2e-5, atol=2e-5)


def test_bad_shapes_are_refused_by_name():
    args, _ = _ragged_case(*CASES["gqa4-d64-lane-padded"])
    with pytest.raises(ValueError, match="block_q=24"):
        ragged_prefill_attention(*args[:-1], RaggedPrefillConfig(block_q=24, pages_per_block=2))
    with pytest.raises(ValueError, match="block_q=12"):
        RaggedPrefillConfig(block_q=12)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        ragged_prefill_attention(*args[:9], 3, args[10])


def test_prefill_program_runs_the_kernel_on_tpu_and_xla_elsewhere():
    """The engines' prefill attention is chosen when the program is lowered."""
    from kernels.paged_attention import paged_attention

    q = jax.ShapeDtypeStruct((2, 64, 8, 128), jnp.float32)
    pool = jax.ShapeDtypeStruct((2, 17, 16, 256), jnp.bfloat16)
    pos = jax.ShapeDtypeStruct((2, 64), jnp.int32)
    table = jax.ShapeDtypeStruct((2, 8), jnp.int32)

    def f(q, k, v, pos, table):
        return paged_attention(q, k, v, 1, pos, table, 0.1, 2)

    tpu = jax.jit(f).trace(q, pool, pool, pos, table).lower(lowering_platforms=("tpu",))
    cpu = jax.jit(f).trace(q, pool, pool, pos, table).lower()
    assert "tpu_custom_call" in tpu.as_text()
    assert "tpu_custom_call" not in cpu.as_text()


@pytest.mark.tpu_compile
def test_compile_prefill_cli_reports_the_kernel_inside_vmem():
    """`megaserve kernels compile-prefill` on SmolLM2 (head_dim 64, lane-padded rows): the
    whole prefill program compiles for tpu7x with the Pallas kernel inside VMEM and no pool
    re-layout (every model at 8k-128k: docs/prefill.md)."""
    import json
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "megaserve_app.cli", "kernels", "compile-prefill", "--config",
         "configs/models/smollm2-135m.json", "--chunk", "256", "--context", "4096", "--json"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["compiled"] and res["attention"] == "pallas ragged prefill kernel"
    assert res["vmem_bytes"] < 64 * 2**20 and res["relayout_ops"] == 0
    assert res["flops_per_chunk"] == sum(res["flops_by_part"].values()) > 0
    bad = subprocess.run(
        [sys.executable, "-m", "megaserve_app.cli", "kernels", "compile-prefill", "--config",
         "configs/models/smollm2-135m.json", "--chunk", "9000", "--context", "4096"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "--chunk=9000" in bad.stderr


@pytest.mark.tpu_compile
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "row", "context"),
    [(32, 8, 128, 1024, 131072)],  # Llama-3.1-8B, 128k
)
def test_compiles_for_tpu7x_inside_vmem(hq, hkv, d, row, context):
    """One layer's kernel at real shapes (chunk 2048 of 4 sequences over a real-size bf16
    pool); the whole prefill program per model is `megaserve kernels compile-prefill`."""
    from kernels.megakernel.target import target_device

    dev, sharding, mesh = target_device("tpu7x")
    ps, seqs = 16, 4

    def a(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    pool = a((32, 36000, ps, row), jnp.bfloat16)
    args = [a((2048, hq, d), jnp.bfloat16), pool, pool, a((), jnp.int32)]
    args += [a((seqs,), jnp.int32)] * 3 + [a((seqs, context // ps), jnp.int32)]

    def f(q, k, v, layer, starts, new, kv_len, table):
        return ragged_prefill_attention(q, k, v, layer, starts, new, kv_len, table, 0.1, hkv)

    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(f).trace(*args)
    compiled = traced.lower().compile()
    used = re.findall(r'used_scoped_memory_configs":\[\{[^]]*"size":"(\d+)"', compiled.as_text())
    assert used and max(map(int, used)) < 64 * 2**20
    assert compiled.memory_analysis().temp_size_in_bytes < 64 * 2**20  # no pool copy
