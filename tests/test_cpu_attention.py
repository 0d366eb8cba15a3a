"""The C++ CPU paged attention kernel against the whole-table reference: ragged rows (no
cached tokens beside thousands), decode-shaped calls (one query per sequence), GQA groups,
head_dim 64 and 128, lane-padded pool rows, inputs it must not read outside the pool for,
and the build's failure modes."""

from __future__ import annotations

import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu_attention
from kernels.paged_attention import paged_attention_reference

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="the C++ kernel did not build (log above)"
)

attend = jax.jit(cpu_attention.paged_prefill_attention, static_argnums=(3, 6, 7))


def pool(rng, layers, pages, page_size, hkv, d, lanes):
    """Random K and V pools whose rows are padded with noise to `lanes` (never read)."""
    shape = (layers, pages, page_size, lanes)
    return [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in "kv"]


def assert_matches_reference(q, k, v, pos: np.ndarray, table: np.ndarray, hkv: int) -> None:
    """The kernel on layer 1 equals the reference on live rows and gives 0 on padding."""
    args = (q, k, v, 1, jnp.asarray(pos), jnp.asarray(table), q.shape[-1] ** -0.5, hkv)
    got = np.asarray(attend(*args))
    want = np.asarray(paged_attention_reference(*args))
    live = pos >= 0
    np.testing.assert_allclose(got[live], want[live], rtol=2e-5, atol=2e-5)
    assert not got[~live].any()


@pytest.mark.parametrize("hkv,group,d", [(3, 3, 64), (2, 4, 128), (1, 1, 64)])
def test_kernel_equals_the_reference_on_ragged_rows(hkv, group, d):
    """Row 0: a fresh prompt (cached 0); row 1: 2000 cached tokens, starting mid-page;
    row 2: a short tail then padding; row 3: padding only (output 0). 150 queries: two full
    64-position tiles and a partial one."""
    rng = np.random.default_rng(d + group)
    ps, width, t = 16, 160, 150
    k, v = pool(rng, 2, 700, ps, hkv, d, hkv * d + 32)
    table = rng.permutation(np.arange(1, 700))[: 4 * width].reshape(4, width).astype(np.int32)
    pos = np.full((4, t), -1, np.int32)
    pos[0] = np.arange(t)
    pos[1] = np.arange(2003, 2003 + t)
    pos[2, :37] = np.arange(500, 537)
    q = jnp.asarray(rng.standard_normal((4, t, hkv * group, d)), jnp.float32)
    assert_matches_reference(q, k, v, pos, table, hkv)


@pytest.mark.parametrize(
    "t,hkv,group,d",
    [(1, 3, 3, 64), (1, 8, 4, 128), (1, 1, 20, 64), (1, 2, 16, 64), (5, 3, 3, 64), (3, 1, 7, 8)],
)
def test_decode_shaped_calls_equal_the_reference(t, hkv, group, d):
    """A decode step (T = 1) and a few-token call: items of one 16-row vector or a few
    (G x T rows, G from 3 to 20), rows at context 0, 1, mid-page and 3000 beside a padding
    row."""
    rng = np.random.default_rng(t * 100 + group)
    ps, width = 16, 190
    k, v = pool(rng, 2, 1000, ps, hkv, d, hkv * d + 16)  # rows lane-padded (noise)
    table = rng.permutation(np.arange(1, 1000))[: 5 * width].reshape(5, width).astype(np.int32)
    start = np.asarray([0, 1, 37, 3000, -1])
    pos = np.where(start[:, None] >= 0, start[:, None] + np.arange(t), -1).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((5, t, hkv * group, d)), jnp.float32)
    assert_matches_reference(q, k, v, pos, table, hkv)


@pytest.mark.parametrize("t", [1, 2])
def test_positions_past_the_table_stay_inside_the_pool(t):
    """A position past the page table (a caller's bug) reads no memory outside the pool:
    keys are clipped to the table and page ids to the pool, as XLA's mode="clip" gather;
    the output is finite. T = 1 is the decode items' own loop."""
    rng = np.random.default_rng(0)
    k, v = pool(rng, 1, 4, 8, 1, 16, 16)
    table = jnp.asarray([[1, 2, 999]], jnp.int32)  # 999: not a page of this pool
    pos = jnp.asarray([[5000, 5001][:t]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, t, 2, 16)), jnp.float32)
    out = np.asarray(attend(q, k, v, 0, pos, table, 0.25, 1))
    assert np.isfinite(out).all()


def test_a_bad_layer_is_an_error_naming_it():
    rng = np.random.default_rng(1)
    k, v = pool(rng, 2, 4, 8, 1, 16, 16)
    q = jnp.asarray(rng.standard_normal((1, 2, 1, 16)), jnp.float32)
    pos, table = jnp.asarray([[0, 1]], jnp.int32), jnp.asarray([[1]], jnp.int32)
    with pytest.raises(jax.errors.JaxRuntimeError, match="layer"):
        np.asarray(attend(q, k, v, 7, pos, table, 0.25, 1))


def test_no_compiler_or_a_failed_compile_raises_what_available_catches(tmp_path, monkeypatch):
    """`available` turns these into the XLA path (with a warning), so a host without a
    C++ compiler still serves."""
    monkeypatch.setattr(cpu_attention, "SOURCE", tmp_path / "broken.cc")
    (tmp_path / "broken.cc").write_text("this is not C++\n")
    monkeypatch.setattr(cpu_attention, "_ext_dir", lambda: tmp_path / "ext")
    with pytest.raises(OSError):
        cpu_attention.build(compiler=str(tmp_path / "no-such-compiler"))
    with pytest.raises(subprocess.CalledProcessError, match="returned non-zero"):
        cpu_attention.build()
    assert not list((tmp_path / "ext").glob("*.so")), "a failed build left a library"
