"""KV pool page copies: exact for any page count, with a bounded number of compiled shapes."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import kv_cache
from kernels.kv_cache import KVPool, pow2_pieces


def test_pow2_pieces_cover_exactly():
    for n in range(0, 130):
        pieces = pow2_pieces(n)
        assert sum(size for _, size in pieces) == n
        assert [s for s, _ in pieces] == list(np.cumsum([0] + [z for _, z in pieces])[:-1])
        assert all(size & (size - 1) == 0 for _, size in pieces)


# 16: dense rows (Hkv * D, as on CPU); 128: rows padded to whole lanes (as on TPU).
@pytest.mark.parametrize("row", [16, 128])
def test_write_then_read_any_count_round_trips_and_compiles_few_shapes(row):
    pool = KVPool.create(2, 80, 4, 2, 8, row=row)
    assert pool.k.shape == (2, 80, 4, row)
    write_fn, read_fn = pool.page_fns()
    writes0, reads0 = write_fn._cache_size(), read_fn._cache_size()
    rng = np.random.default_rng(0)
    free = list(range(1, 80))
    rng.shuffle(free)
    written = {}
    for n in (1, 3, 7, 12, 19, 37):  # 79 pages, scattered, every count different
        pages, free = np.asarray(free[:n], np.int32), free[n:]
        k = rng.normal(size=(2, n, 4, 2, 8)).astype(np.float32)
        v = rng.normal(size=(2, n, 4, 2, 8)).astype(np.float32)
        pool.write_pages(pages, k, v)
        written.update({int(p): (k[:, i], v[:, i]) for i, p in enumerate(pages)})
    pages = list(written)
    rng.shuffle(pages)
    flat = []  # (page, k, v) from two reads of 45 and 34 pages
    for part in (pages[:45], pages[45:]):
        for off, k, v in pool.read_pages(part):
            for i in range(k.shape[1]):
                heads = (2, 4, 2, 8)  # the pool stores [.., Hkv * D] rows: the same bytes
                k_i, v_i = (np.asarray(a[:, i]).reshape(heads) for a in (k, v))
                flat.append((part[off + i], k_i, v_i))
    assert len(flat) == len(written)
    for p, k, v in flat:
        np.testing.assert_array_equal(k, written[p][0])
        np.testing.assert_array_equal(v, written[p][1])
    assert np.all(np.asarray(pool.k[:, 0]) == 0)  # the null page is never written
    assert np.all(np.asarray(pool.k[..., 16:]) == 0)  # padding lanes stay zero
    # Six write counts and two read counts: pieces of 1, 2, 4, 8, 16 and 32 pages only.
    assert write_fn._cache_size() - writes0 <= 6  # (other tests' pools count too)
    assert read_fn._cache_size() - reads0 <= 6


def test_a_row_that_is_neither_dense_nor_lane_padded_is_refused():
    with pytest.raises(ValueError, match="row=100"):
        KVPool.create(2, 8, 4, 2, 8, row=100)
    assert kv_cache.pool_row(3, 64, "tpu") == 256  # SmolLM2: 192 lanes padded to 256
    assert kv_cache.pool_row(3, 64, "cpu") == 192
    assert kv_cache.pool_row(8, 128, "tpu") == 1024


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_pages_are_copied_into_a_cpu_pool_in_place_behind_a_step_in_flight(dtype):
    """On CPU, host pages go straight into the pool's memory (`KVPool._write_in_place`);
    the pool equals one written by the program path (device arrays), also right after a
    program that donated the pool was dispatched and is still running (without the wait
    for it this test fails: that program's output overwrote the pages)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    dt = jnp.dtype(dtype)
    direct, programmed = (KVPool.create(3, 200, 16, 2, 64, dt) for _ in range(2))
    # ~50 ms of work on 5 MB: still running when write_pages is called right after.
    slow = lambda x: lax.fori_loop(0, 60, lambda i, y: y * 0.5 + 1, x)  # noqa: E731
    step = jax.jit(lambda k, v: (slow(k), slow(v)), donate_argnums=(0, 1))
    rng = np.random.default_rng(1)
    for n in (5, 16, 3):
        pages = rng.choice(np.arange(1, 200), n, replace=False).astype(np.int32)
        k = rng.normal(size=(3, n, 16, 2, 64)).astype(np.float32)
        v = rng.normal(size=(3, n, 16, 2, 64)).astype(np.float32)
        for pool in (direct, programmed):
            pool.k, pool.v = step(pool.k, pool.v)
        direct.write_pages(pages, k, v)
        programmed.write_pages(pages, jnp.asarray(k), jnp.asarray(v))
        jax.block_until_ready(programmed.k)
        np.testing.assert_array_equal(
            np.asarray(direct.k[:, pages], np.float32),
            k.astype(dt).reshape(3, n, 16, 128).astype(np.float32),
        )
    for a, b in ((direct.k, programmed.k), (direct.v, programmed.v)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert len(direct.programs_run) == 0  # no write program: numpy copied the pages
    assert len(programmed.programs_run) > 0
