"""Compiled executables on disk under a key of the program's code, statics and argument shapes,
so a warm worker start loads each one without tracing or lowering it: JAX's persistent cache
keys on the lowered module, so a start from it still traces and lowers every program (1.2 s
per SmolLM2 decode program on CPU, most of a warm start).

Only executables compiled in this process are stored: XLA:CPU re-serializes an executable
that was itself deserialized without some of its functions (a later load fails with
`NOT_FOUND: Function ... not found`), so one that JAX's persistent cache answered is not
written again (docs/programs.md has the reproduction; `tests/test_exec_cache.py` the rule)."""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import jax
import jax.extend
import jaxlib
import numpy as np
import structlog

log = structlog.get_logger("megaserve.exec_cache")

# Bump when an entry's layout or what the key covers changes.
ENTRY_VERSION = 1
REPO = Path(__file__).resolve().parent.parent
# The code a program's trace can run: every module of these packages.
SOURCE_DIRS = ("kernels", "megaserve", "decode_service", "prefill_service")

_hits = threading.local()


def _on_event(event: str, **_: Any) -> None:
    # JAX records its cache hits in the compiling thread, so a thread-local flag tells this
    # thread's compile apart from the pool's other threads.
    if event == "/jax/compilation_cache/cache_hits":
        _hits.seen = True


jax.monitoring.register_event_listener(_on_event)


# This cache stays under this (oldest entries dropped first): the shared cache directory
# (`megaserve.compile_cache`) would otherwise grow with every code change.
EXEC_CACHE_MAX_BYTES = 2 * 2**30


def cache_dir() -> Path | None:
    """Beside JAX's persistent cache (the same switch and directory); None when it is off."""
    base = jax.config.jax_compilation_cache_dir
    if not base or not jax.config.jax_enable_compilation_cache:
        return None
    return Path(base) / "megaserve-exec"


@functools.cache
def _source_digest() -> str:
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        # .cc: the CPU attention kernel (`kernels/cpu_attention.py`) is called by name.
        for f in sorted([*(REPO / d).rglob("*.py"), *(REPO / d).rglob("*.cc")]):
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def cpu_flags() -> str:
    """The host's ISA flags line: a CPU executable (or library) is machine code for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def _fixed_environment() -> str:
    """What cannot change within a process: versions, backend, flags, host, source."""
    backend = jax.extend.backend.get_backend()
    return repr(
        (
            ENTRY_VERSION,
            jax.__version__,
            jaxlib.__version__,
            backend.platform,
            backend.platform_version,
            [d.device_kind for d in jax.local_devices()],
            os.environ.get("XLA_FLAGS"),
            os.environ.get("LIBTPU_INIT_ARGS"),
            os.environ.get("MEGASERVE_CPU_ATTENTION"),  # which attention CPU programs call
            cpu_flags(),
            _source_digest(),
        )
    )


def _environment() -> str:
    # JAX's config can change while a process runs (tests toggle it): read it per key.
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    return _fixed_environment() + repr(config)


def _single_device(args: Any) -> jax.Device | None:
    """The one device every argument is on (None-sharded ones on the default device), or
    None for a program over several devices (those stay with JAX's own path)."""
    devices = set()
    for leaf in jax.tree.leaves(args):
        s = getattr(leaf, "sharding", None)
        if s is None:
            continue
        if len(s.device_set) != 1:
            return None
        devices |= s.device_set
    if not devices:
        return jax.config.jax_default_device or jax.local_devices()[0]
    return devices.pop() if len(devices) == 1 else None


def program_key(program) -> str | None:
    """A digest of everything the program's executable depends on, or None when some part
    cannot be named reproducibly (a closure, an object printed by address): then no entry."""
    return _key(program, _single_device(program.args))


def _key(program, device) -> str | None:
    fn = program.fn
    info, fun = getattr(fn, "_jit_info", None), getattr(fn, "_fun", None)
    if info is None or fun is None or device is None:
        return None
    statics = []
    while isinstance(fun, functools.partial):
        statics.append((fun.args, sorted(fun.keywords.items())))
        fun = fun.func
    leaves, tree = jax.tree.flatten(program.args)
    shapes = [(x.shape, str(x.dtype), x.weak_type, repr(x.sharding)) for x in leaves]
    name = (getattr(fun, "__module__", None), getattr(fun, "__qualname__", None))
    desc = repr((program.name, program.key, name, statics, info, tree, shapes, repr(device)))
    if " at 0x" in desc or "<lambda>" in desc or "<locals>" in desc:
        return None
    return hashlib.sha256((_environment() + desc).encode()).hexdigest()


class LoadedProgram:
    """A deserialized executable called like the `jax.stages.Compiled` it was saved from:
    the same argument pytree in, the same output pytree back."""

    def __init__(self, exe, device, in_tree, out_tree, kept: list[int], in_dtypes: list[str]):
        self.exe, self.device = exe, device
        self.in_tree, self.out_tree = in_tree, out_tree
        self.kept, self.in_dtypes = kept, [np.dtype(d) for d in in_dtypes]

    def _put(self, x: Any, dtype: np.dtype) -> jax.Array:
        if isinstance(x, jax.Array) and x.dtype == dtype and x.sharding.device_set == {self.device}:
            return x
        return jax.device_put(np.asarray(x, dtype), self.device)

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten((args, {}))
        if tree != self.in_tree:
            raise TypeError(f"arguments {tree} do not match the executable's {self.in_tree}")
        bufs = [self._put(leaves[i], dt) for i, dt in zip(self.kept, self.in_dtypes)]
        outs = self.exe.execute_sharded(bufs).disassemble_into_single_device_arrays()
        return jax.tree.unflatten(self.out_tree, [o[0] for o in outs])

    def memory_analysis(self):
        return self.exe.get_compiled_memory_stats()


def _entry(compiled) -> dict | None:
    """What `load` needs to call the executable again; None for one this cache cannot hold
    (effects, host callbacks, mutable state, several devices)."""
    mesh = compiled._executable
    call = mesh.unsafe_call
    exe = mesh.xla_executable
    if (
        call.ordered_effects
        or call.has_unordered_effects
        or call.has_host_callbacks
        or call.mut
        or len(exe.local_devices()) != 1
    ):
        return None
    kept = sorted(call.kept_var_idx)
    return {
        "exe": jax.extend.backend.get_backend().serialize_executable(exe),
        "in_tree": compiled.in_tree,
        "out_tree": compiled.out_tree,
        "kept": kept,
        "in_dtypes": [str(a.dtype) for a in mesh.in_avals],  # over the kept arguments
    }


def compile_program(program) -> Any:
    """The program's executable: loaded from this cache when an entry matches, else compiled
    (through JAX's persistent cache) and, when compiled here, stored for the next start."""
    root = cache_dir()
    device = _single_device(program.args)
    key = _key(program, device) if root is not None else None
    path = root / f"{key}.bin" if key else None
    if path is not None and path.exists():
        loaded = _load(path, device)
        if loaded is not None:
            return loaded
    _hits.seen = False
    compiled = program.lower().compile()
    if path is not None and not _hits.seen:
        _store(path, compiled, program.label)
    return compiled


def _load(path: Path, device) -> LoadedProgram | None:
    try:
        data = pickle.loads(path.read_bytes())
        exe = jax.extend.backend.get_backend().deserialize_executable(data["exe"], [device])
        return LoadedProgram(
            exe, device, data["in_tree"], data["out_tree"], data["kept"], data["in_dtypes"]
        )
    except Exception as e:  # a torn or foreign entry: drop it and compile instead
        log.warning("exec cache entry unreadable; compiling", path=str(path), error=repr(e))
        path.unlink(missing_ok=True)
        return None


def _store(path: Path, compiled, label: str) -> None:
    try:
        data = _entry(compiled)
        if data is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(pickle.dumps(data))
        os.replace(tmp, path)  # readers see a whole entry or none
        _prune(path.parent, EXEC_CACHE_MAX_BYTES)
    except Exception as e:  # the cache is an optimization: serving goes on without it
        log.warning("exec cache entry not written", program=label, error=repr(e))


def _prune(root: Path, limit: int) -> None:
    """Drops the least recently written entries until the directory holds at most limit
    bytes (loads do not touch an entry: it is rewritten only when recompiled)."""
    entries = []
    for f in root.glob("*.bin"):
        try:
            st = f.stat()
        except OSError:  # another process pruned it
            continue
        entries.append((st.st_mtime, st.st_size, f))
    total = sum(size for _, size, _ in entries)
    for _, size, f in sorted(entries):
        if total <= limit:
            return
        f.unlink(missing_ok=True)
        total -= size
