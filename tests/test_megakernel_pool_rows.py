"""The megakernel over a pool whose rows are padded to 128 lanes, as a TPU worker's pool is
(`kernels.kv_cache.pool_row`): same step as over a dense pool, padding never read."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.megakernel.pack import pack_megakernel
from kernels.megakernel.plan import make_plan
from kernels.megakernel.step import megakernel_step, reference_step
from tests.megakernel_minis import PS, mini_model
from tests.test_megakernel import (
    ONE_STEP_LOGITS,
    PAGE_TABLE,
    POSITIONS,
    TOKENS,
    _pool,
    _row_errors,
)


def test_pool_rows_padded_to_lanes_give_the_same_step():
    """A 192-lane K/V row (3 kv heads of 64, as SmolLM2) in a pool whose rows are padded to
    256 lanes, as a TPU worker's pool is: the kernel DMAs whole padded rows, reads only the
    192 K/V lanes, and writes zeros into the padding; its step equals the reference over the
    same pool and the kernel's own step over a dense pool."""
    m, _ = mini_model("kv192")
    dense = make_plan(m.cfg, 4, PS, 4, block_keys=2 * PS)
    assert (dense.kv, dense.ta, dense.kv_row) == (192, 256, 192)
    plan = replace(dense, kv_row=256)
    mp = pack_megakernel(plan, m.params)
    k, v = _pool(m.cfg, 9)
    pad = ((0, 0), (0, 0), (0, 0), (0, 64))
    kp, vp = jnp.pad(k, pad), jnp.pad(v, pad)
    outs = {}
    for name, pl_, step, pool in (
        ("ref", plan, reference_step, (kp, vp)),
        ("padded", plan, megakernel_step, (kp, vp)),
        ("dense", dense, megakernel_step, (k, v)),
    ):
        fn = jax.jit(partial(step, pl_, mp, interpret=True))
        outs[name] = fn(*pool, TOKENS, POSITIONS, PAGE_TABLE)
    live = POSITIONS >= 0
    (rt, rl, rk, _, _), (pt, plog, pk, pv, _) = outs["ref"], outs["padded"]
    dt, dlog, dk, dv, _ = outs["dense"]
    errors = _row_errors(np.asarray(plog)[live], np.asarray(rl)[live])
    assert (errors <= ONE_STEP_LOGITS["llama"]).all(), errors
    np.testing.assert_array_equal(np.asarray(pt)[live], np.asarray(rt)[live])
    np.testing.assert_array_equal(np.asarray(pt), np.asarray(dt))
    np.testing.assert_array_equal(np.asarray(plog), np.asarray(dlog))
    np.testing.assert_array_equal(np.asarray(pk[..., :192]), np.asarray(dk))
    np.testing.assert_array_equal(np.asarray(pv[..., :192]), np.asarray(dv))
    assert not np.asarray(pk[..., 192:]).any() and not np.asarray(pv[..., 192:]).any()
    assert not np.asarray(rk[..., 192:]).any()
    with pytest.raises(ValueError, match="pool row 200"):
        make_plan(m.cfg, 4, PS, 4, kv_row=200)
