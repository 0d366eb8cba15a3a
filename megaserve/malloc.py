"""glibc malloc settings for a worker that moves large transient buffers (KV pushes)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Serves allocations under `mmap_threshold` bytes from the heap and keeps up to
    `trim_threshold` bytes of freed heap memory; False where there is no glibc to set.

    Why: a KV push moves 11.8 MB messages (the sender's encoded chunk, gRPC's received
    bytes, the aligned copy jax makes of a payload). glibc serves each from a fresh mmap
    once the size passes its threshold, so every one is faulted in and zeroed page by page
    (~2900 faults) and unmapped when freed; its dynamic threshold only follows the largest
    freed size per arena, and gRPC's, jax's and Python's threads allocate from several.
    Reusing freed heap memory instead measured 188.7 MB pushes in 182 ms (median of six
    runs' medians, 177-197) against 200 (187-279) (`megaserve bench disagg --raw-only`,
    docs/benchmarks.md). The cost: up to `trim_threshold` bytes freed at the top of the heap
    stay with the process instead of going back to the system.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt to call
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
