"""The executable cache: an entry loads and runs like the executable it was saved from, its
key follows the program's statics and shapes, and only executables compiled in this process
are written (a standalone script reproduced XLA:CPU losing functions when re-serializing a
deserialized executable: `NOT_FOUND: Function copy_bitcast_fusion.5 not found`)."""

from __future__ import annotations

import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import exec_cache
from kernels.exec_cache import LoadedProgram, compile_program, program_key
from kernels.programs import Program, ProgramCache


def _step(scale, pool, rows, s):
    """pool: f32[N, D] (donated); rows: i32[B]; s: {"t": f32[B], "unused": i32[B]}."""
    picked = pool[rows] * scale * s["t"][:, None]
    return pool.at[rows].add(1.0), {"picked": picked, "none": None, "n": rows.sum()}


def _program(scale=2.0, n=16, donate=(0,)) -> Program:
    args = (
        jax.ShapeDtypeStruct((n, 8), jnp.float32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        {
            "t": jax.ShapeDtypeStruct((4,), jnp.float32),
            "unused": jax.ShapeDtypeStruct((4,), jnp.int32),
        },
    )
    return Program("step", (n,), jax.jit(partial(_step, scale), donate_argnums=donate), args)


def _inputs(n=16):
    pool = jnp.arange(n * 8, dtype=jnp.float32).reshape(n, 8)
    return (
        pool,
        jnp.array([3, 0, 7, 3], jnp.int32),
        {
            "t": jnp.array([1.0, 0.5, 2.0, -1.0], jnp.float32),
            "unused": jnp.zeros(4, jnp.int32),
        },
    )


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(exec_cache, "cache_dir", lambda: tmp_path)
    return tmp_path


def test_a_stored_executable_loads_and_runs_like_the_compiled_one(cache_dir):
    p = _program()
    first = compile_program(p)
    assert isinstance(first, jax.stages.Compiled)
    assert len(list(cache_dir.glob("*.bin"))) == 1
    again = compile_program(p)
    assert isinstance(again, LoadedProgram)

    want_pool, want = first(*_inputs())
    pool, rows, s = _inputs()
    got_pool, got = again(pool, np.asarray(rows), s)  # host arrays are put on the device
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert got["none"] is None
    np.testing.assert_array_equal(got_pool, want_pool)
    np.testing.assert_array_equal(got["picked"], want["picked"])
    assert int(got["n"]) == int(want["n"]) == 13
    assert pool.is_deleted()  # the pool was donated, as in the compiled program
    assert again.memory_analysis().temp_size_in_bytes >= 0

    # A ProgramCache warm-up answers from the entry too.
    cache = ProgramCache()
    assert cache.warm([p])[0] == 1
    assert isinstance(cache.executables["step", (16,)], LoadedProgram)


def test_an_executable_answered_by_jax_persistent_cache_is_not_stored(
    cache_dir, tmp_path_factory, monkeypatch
):
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("needs JAX's persistent cache (conftest sets it)")
    was = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        unique = float(time.time_ns() % 10**9)  # a program JAX's cache has never seen
        assert isinstance(compile_program(_program(scale=unique)), jax.stages.Compiled)
        assert len(list(cache_dir.glob("*.bin"))) == 1  # compiled here: stored

        other = tmp_path_factory.mktemp("second")
        monkeypatch.setattr(exec_cache, "cache_dir", lambda: other)
        answered = compile_program(_program(scale=unique))  # JAX's persistent cache hits
        assert isinstance(answered, jax.stages.Compiled)
        assert not list(other.glob("*.bin"))
        np.testing.assert_array_equal(answered(*_inputs())[0], _program(unique).fn(*_inputs())[0])
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", was)


def test_the_key_follows_statics_shapes_and_donation_and_refuses_closures():
    base = program_key(_program())
    assert base is not None and base == program_key(_program())  # rebuilt: the same key
    assert program_key(_program(scale=3.0)) != base
    assert program_key(_program(n=32)) != base
    assert program_key(_program(donate=())) != base
    closure = 2.0
    lam = Program("step", (16,), jax.jit(lambda *a: _step(closure, *a)), _program().args)
    assert program_key(lam) is None

    def local(*a):
        return _step(closure, *a)

    assert program_key(Program("step", (16,), jax.jit(local), _program().args)) is None


def test_an_unreadable_entry_is_dropped_and_compiled_again(cache_dir):
    p = _program(scale=5.0)
    path = cache_dir / f"{program_key(p)}.bin"
    path.write_bytes(b"torn write")
    assert isinstance(compile_program(p), jax.stages.Compiled)
    assert isinstance(compile_program(p), LoadedProgram)  # the entry was written again


def test_the_shared_cache_is_per_user_and_bounded(tmp_path, monkeypatch):
    from megaserve import compile_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.shared_cache_root() == tmp_path / "megaserve" / "jax"
    env = compile_cache.cache_env({"JAX_COMPILATION_CACHE_DIR": "/elsewhere"})
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/elsewhere"  # a chosen directory is kept
    assert int(env["JAX_COMPILATION_CACHE_MAX_SIZE"]) == compile_cache.JAX_CACHE_MAX_BYTES
    # The executable cache drops its oldest entries past its bound.
    for i in range(5):
        f = tmp_path / f"{i}.bin"
        f.write_bytes(b"x" * 100)
        os.utime(f, (i, i))
    exec_cache._prune(tmp_path, 250)
    assert sorted(f.name for f in tmp_path.glob("*.bin")) == ["3.bin", "4.bin"]
