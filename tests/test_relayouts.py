"""The re-layout check compile-worker reports, on programs compiled for tpu7x: a grouped
matmul over one layer's slice of stacked experts re-lays the slice out (flagged), the same
matmul over the whole stack with other layers' groups empty does not (XLA's ragged matmul or
megablox gmm), nor does a pool's in-place page write."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.tpu_compile

# A layer of experts (64 MB) larger than VMEM: smaller ones are re-tiled into VMEM instead.
L, E, D, I = 4, 64, 1024, 512  # layers, experts, hidden, expert width


def _hlo(fn, *shapes):
    import jax

    from kernels.megakernel.target import target_device

    _, sharding, _ = target_device("tpu7x")
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    return jax.jit(fn, donate_argnums=(0,)).trace(*args).lower().compile().as_text()


def _experts(layer_slice: bool, gmm: bool = False) -> str:
    import jax
    import jax.numpy as jnp

    from kernels.megakernel.ring_forward import stack_gmm

    def f(x, w, sizes):
        for li in range(3):
            if gmm:
                y = stack_gmm(x, w, sizes, li)
            elif layer_slice:
                y = jax.lax.ragged_dot(x, w[li], sizes, preferred_element_type=jnp.float32)
            else:
                every = jnp.zeros((L * E,), jnp.int32).at[li * E : (li + 1) * E].set(sizes)
                flat = w.reshape(L * E, D, I)
                y = jax.lax.ragged_dot(x, flat, every, preferred_element_type=jnp.float32)
            x = jnp.tile(y.astype(x.dtype), (1, D // I))
        return x

    bf16 = jnp.bfloat16
    return _hlo(f, ((256, D), bf16), ((L, E, D, I), bf16), ((E,), jnp.int32))


def test_a_layer_slice_relaid_for_a_grouped_matmul_is_flagged():
    from megaserve_app.relayouts import relayout_ops

    found = relayout_ops(_experts(True), (1, 1), [(L, E, D, I)])
    assert found and all(f"{E},{D},{I}" in line for line in found), found


def test_the_whole_stack_with_empty_groups_is_not():
    from megaserve_app.relayouts import relayout_ops

    assert relayout_ops(_experts(False), (1, 1), [(L, E, D, I)]) == []


def test_the_ring_prefill_grouped_matmul_is_not():
    """`stack_gmm` (megablox gmm over the whole stack, as the TPU ring prefill runs it)."""
    from megaserve_app.relayouts import relayout_ops

    assert relayout_ops(_experts(False, gmm=True), (1, 1), [(L, E, D, I)]) == []


def test_in_place_page_writes_are_not_flagged_but_a_pool_copy_is():
    import jax.numpy as jnp

    from megaserve_app.relayouts import relayout_ops

    pool = (2, 64, 16, 256)

    def write(k, rows, pages):  # k: [L, P, S, kv]; rows: [n, S, kv] into pages i32[n]
        return k.at[1, pages].set(rows)

    def copy(k, rows, pages):  # the pool, plus a transposed copy of it
        return k.at[1, pages].set(rows), jnp.swapaxes(k, 2, 3) * 2

    shapes = [(pool, jnp.bfloat16), ((4, 16, 256), jnp.bfloat16), ((4,), jnp.int32)]
    assert relayout_ops(_hlo(write, *shapes), pool, []) == []
    assert relayout_ops(_hlo(copy, *shapes), pool, [])


_ENTRY = """HloModule m

%fused_scatter (p0: bf16[128,512]) -> bf16[128,512] {
  ROOT %s = bf16[128,512]{1,0:T(8,128)(2,1)} scatter(%p0, %i, %u)
}

ENTRY %main (pool: bf16[2,4,16,512], table: bf16[4096,2048]) -> bf16[128,512] {
  %pool = bf16[2,4,16,512]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %table = bf16[4096,2048]{1,0:T(8,128)(2,1)} parameter(1)
  %flat = bf16[128,512]{1,0:T(8,128)(2,1)} bitcast(%pool)
  %scatter_fusion = bf16[128,512]{1,0:T(8,128)(2,1)} fusion(%flat, %x), kind=kCustom, \
calls=%fused_scatter
  %gather.update = ((bf16[4096,2048]{1,0:T(8,128)(2,1)}, s32[64]{0}), \
bf16[64,2048]{1,0:T(16,128)(2,1)}) custom-call-update(%gather.start, %table)
  %relaid = bf16[128,512]{0,1:T(8,128)(2,1)} copy(%flat)
  ROOT %out = bf16[128,512]{1,0:T(8,128)(2,1)} add(%scatter_fusion, %relaid)
}
"""


def test_views_and_pass_through_operands_are_not_relayouts():
    """A scatter into the pool through a flattening bitcast keeps the pool's layout, and an
    async gather's result tuple that carries the embedding table through makes no copy of
    it; a copy that changes the flattened pool's tiling is still flagged."""
    from megaserve_app.relayouts import relayout_ops

    found = relayout_ops(_ENTRY, (2, 4, 16, 512), [(4096, 2048)])
    assert [line.split(" =")[0] for line in found] == ["%relaid"], found
