"""Compile-only TPU targets: libtpu's topology for a target name, its first device and the
abstract mesh lowering needs, and `compile_plan` (one megakernel step at real shapes)."""

from __future__ import annotations

import os
from typing import Any

# libtpu reads these when jax first initialises it; without them it probes GCE metadata and
# prints pages of warnings. Only defaults: a real TPU host's own settings win.
_QUIET_LIBTPU = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_WORKER_ID": "0",
    # Compile-only use touches no chip, so several processes may hold libtpu at once (a test
    # process and the CLI it runs); without this the second fails on /tmp/libtpu_lockfile.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}

# Compile-only topologies by target name; `tpu7x` is TPU v7 (Ironwood), one chip = 2 cores.
TOPOLOGIES = {"tpu7x": "tpu7x:2x2x1", "v6e": "v6e:1x1", "v5e": "v5e:1x1"}


def quiet_env() -> None:
    for k, v in _QUIET_LIBTPU.items():
        os.environ.setdefault(k, v)


def target_device(target: str):
    """(device, its sharding, abstract mesh) of the target's first compile-only TensorCore.

    Lowering needs the chip generation (integer rem/div rules): hence the abstract mesh.
    """
    quiet_env()
    import jax
    from jax.experimental import topologies
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    if target not in TOPOLOGIES:
        raise ValueError(f"target {target!r} is not one of {sorted(TOPOLOGIES)}")
    dev = topologies.get_topology_desc(topology_name=TOPOLOGIES[target], platform="tpu").devices[0]
    mesh = AbstractMesh(
        (1,),
        ("x",),
        (AxisType.Explicit,),
        abstract_device=AbstractDevice(device_kind=dev.device_kind, num_cores=1, platform="tpu"),
    )
    return dev, jax.sharding.SingleDeviceSharding(dev), mesh


def pool_shape(plan: Any, pool_pages: int | None = None) -> tuple[int, ...]:
    """The KV pool the AOT step is compiled for: `pool_pages` pages, by default one null page
    plus every row's pages (each row at a full `pages_per_seq`)."""
    n_pages = pool_pages or plan.batch * plan.pages_per_seq + 1
    return (plan.num_layers, n_pages, plan.page_size, plan.kv_row)  # the kernel's pool layout


def compile_plan(plan: Any, target: str = "tpu7x", pool_pages: int | None = None) -> Any:
    """AOT-compiles one decode step of `plan` on the target's compile-only topology.

    pool_pages: pages in the KV pool (default: every row's pages, `pool_shape`); a smaller
    pool compiles the same kernel when weights plus the full pool exceed the device's HBM.
    Returns the compiled executable; raises whatever the compiler raises (its message names
    the failure, e.g. a VMEM out-of-memory).
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental.layout import Format, Layout

    from kernels.megakernel.pack import abstract_params
    from kernels.megakernel.step import megakernel_step

    _, sharding, mesh = target_device(target)

    def sds(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    mparams = jax.tree.map(sds, abstract_params(plan))
    kv_shape = pool_shape(plan, pool_pages)
    # The pool is pinned to row-major: for a K/V row that is not a lane multiple (SmolLM2,
    # 192) XLA's default layout of a large pool moves the page dim minor, which the kernel's
    # page DMAs cannot use (it then re-lays out the pool around the kernel). A TPU runner
    # allocates the pool with this same Format.
    row_major = Format(Layout(major_to_minor=tuple(range(len(kv_shape)))), sharding)
    kv = jax.ShapeDtypeStruct(kv_shape, plan.kv_dtype, sharding=row_major)
    i32, b = jnp.int32, plan.batch
    args = (
        mparams,
        kv,
        kv,
        jax.ShapeDtypeStruct((b,), i32, sharding=sharding),
        jax.ShapeDtypeStruct((b,), i32, sharding=sharding),
        jax.ShapeDtypeStruct((b, plan.pages_per_seq), i32, sharding=sharding),
    )

    def step(mp, k, v, tok, pos, pt):
        return megakernel_step(plan, mp, k, v, tok, pos, pt)[:4]

    # Compile-only executables cannot be reloaded from the persistent cache (it needs a
    # client): keep them out of it, then restore the caller's setting.
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            traced = jax.jit(
                step,
                donate_argnums=(1, 2),
                out_shardings=(sharding, None, row_major, row_major),
            ).trace(*args)
        return traced.lower().compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was)
