"""Device programs as data: each one named, keyed by its shapes and built from abstract
arguments, so a worker compiles its whole set before it serves and `compile-worker` compiles
the same set for another target; `ProgramCache` holds the executables calls then run."""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from kernels.exec_cache import compile_program


@dataclass(frozen=True)
class Program:
    """One compiled-shape program: `fn` is jitted, `args` its abstract arguments (a tuple of
    pytrees of ShapeDtypeStructs) in call order."""

    name: str  # e.g. decode, prefill, pick, kv_write, kv_read
    key: tuple[int, ...]  # the shape key within the name (batch bucket, chunk, ...)
    fn: Any
    args: tuple

    @property
    def label(self) -> str:
        return label(self.name, self.key)

    def lower(self):
        return self.fn.lower(*self.args)


def label(name: str, key: tuple) -> str:
    """A program's name and shape key as logs and reports print it: decode[8,16,1]."""
    return f"{name}[{','.join(map(str, key))}]"


def abstract(tree: Any, sharding: Any = None) -> Any:
    """ShapeDtypeStructs of a pytree of arrays (numpy, jax or already abstract)."""

    def one(x):
        x = np.asarray(x) if isinstance(x, (int, float, np.generic)) else x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def is_abstract(tree: Any) -> bool:
    """True for a pytree of ShapeDtypeStructs (compile-worker's params: shapes, no weights)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and isinstance(leaves[0], jax.ShapeDtypeStruct)


class ProgramCache:
    """Executables by (name, key). `call` runs the cached one; a miss compiles it there and
    counts it in `late_compiles` (a shape the warm-up set did not hold)."""

    def __init__(self):
        self.executables: dict[tuple, Any] = {}
        self.late_compiles = 0
        self.on_late: Callable[[str], None] | None = None

    def __len__(self) -> int:
        return len(self.executables)

    def warm(self, programs: Iterable[Program], jobs: int | None = None) -> tuple[int, float]:
        """Compiles (or loads from the executable cache or JAX's persistent compilation
        cache) every program not held yet, `jobs` at once (default: this host's cores);
        returns (programs compiled or loaded, seconds)."""
        t0 = time.perf_counter()
        todo = {(p.name, p.key): p for p in programs if (p.name, p.key) not in self.executables}
        # XLA's compile of one program runs mostly on one core and releases the GIL: a cold
        # start compiles on every core (lowering, in Python, stays serial under the GIL).
        jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as ex:
            done = ex.map(compile_program, todo.values())
            for key, exe in zip(todo, done):
                self.executables[key] = exe
        return len(todo), time.perf_counter() - t0

    def call(self, name: str, key: tuple, fn: Any, *args):
        exe = self.executables.get((name, key))
        if exe is None:
            exe = self.executables[name, key] = fn.lower(*args).compile()
            self.late_compiles += 1
            if self.on_late is not None:
                self.on_late(label(name, key))
        return exe(*args)
