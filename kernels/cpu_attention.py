"""The CPU paged prefill attention kernel (`csrc/paged_prefill_attention.cc`): built on first
use with the host's C++ compiler, registered as an XLA FFI target, called like
`paged_attention`; where it cannot be built the XLA blockwise path runs instead."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import structlog

from kernels.exec_cache import cpu_flags

log = structlog.get_logger("megaserve.cpu_attention")

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_prefill_attention.cc"
TARGET = "megaserve_paged_prefill_attention"
# MEGASERVE_CPU_ATTENTION=xla keeps the XLA blockwise path (A/B runs, and the fallback's tests).
SWITCH = "MEGASERVE_CPU_ATTENTION"
HEAD_DIMS = (8, 16, 32, 64, 128, 256)  # the kernel's instantiations
# -march=native: the library is built on (and for) the machine that runs it. No -ffast-math:
# the kernel's exp rounds with the add-and-subtract trick fast-math would fold away.
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


def _ext_dir() -> Path:
    """Beside the JAX compile cache when one is set (one per user, shared by checkouts)."""
    base = jax.config.jax_compilation_cache_dir
    root = Path(base).parent if base else Path.home() / ".cache" / "megaserve"
    return root / "ext"


def build(compiler: str | None = None) -> Path:
    """The kernel's shared library, compiled once per (source, flags, JAX headers, CPU).

    Raises:
      OSError: no C++ compiler (`CXX`, g++ or c++ on PATH).
      subprocess.CalledProcessError: the compile failed (its stderr in the exception).
    """
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise OSError("no C++ compiler: set CXX or install g++")
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), jax.__version__.encode()):
        key.update(part)
    key.update(cpu_flags().encode())  # -march=native depends on them
    out = _ext_dir() / f"paged_prefill_attention-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: concurrent first uses never load a partial file.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(part)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(part, out)
    log.info("cpu attention kernel built", path=str(out))
    return out


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered in this process (once; never raises)."""
    if os.environ.get(SWITCH, "") == "xla":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("cpu attention kernel unavailable, XLA path", error=detail[-2000:])
        return False
    capsule = jax.ffi.pycapsule(lib.MegaservePagedPrefillAttention)
    jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
    return True


def supports(q: jax.Array, k_cache: jax.Array) -> bool:
    """Whether this call can run the kernel: f32 queries and pool, a head_dim it is built for."""
    f32 = q.dtype == jnp.float32 and k_cache.dtype == jnp.float32
    return f32 and q.shape[-1] in HEAD_DIMS and available()


def paged_prefill_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    positions: jax.Array,
    page_table: jax.Array,
    scale: float,
    num_kv_heads: int,
) -> jax.Array:
    """`paged_attention`'s arguments and result, on the CPU kernel (check `supports` first).

    Args:
      q: f32[B, T, Hq, D] queries (rotated, unscaled).
      k_cache, v_cache: f32[L, num_pages, page_size, row] the pool, new rows written.
      layer: scalar layer index.
      positions: i32[B, T] absolute query positions; -1 marks padding (output 0).
      page_table: i32[B, P].
      scale: softmax scale.
      num_kv_heads: Hkv (the pool row may be lane-padded past Hkv * D).
    Returns:
      f32[B, T, Hq, D].
    """
    if not available():
        raise RuntimeError(f"the CPU attention kernel is not available ({SWITCH}, or the build)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    layer = jnp.asarray(layer, jnp.int32)
    return call(
        q, k_cache, v_cache, layer, positions.astype(jnp.int32), page_table.astype(jnp.int32),
        scale=np.float32(scale), num_kv_heads=np.int64(num_kv_heads),
    )  # fmt: skip
