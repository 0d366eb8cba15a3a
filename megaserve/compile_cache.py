"""Where compiled programs are cached: one directory per user, shared by every checkout."""

from __future__ import annotations

import os
from pathlib import Path

# JAX's persistent cache drops its least recently used entries past this.
JAX_CACHE_MAX_BYTES = 4 * 2**30
# Compiles shorter than this are not worth a disk entry.
MIN_COMPILE_SECS = 0.5


def shared_cache_root() -> Path:
    """`$XDG_CACHE_HOME/megaserve/jax`, else `~/.cache/megaserve/jax`: JAX's persistent cache
    and the executable cache (`kernels.exec_cache`) beside it, shared by every checkout and
    process of this user, so a fresh clone or a restarted worker starts warm. Entries are
    keyed by what they were compiled from (the lowered module; the executable cache also by
    the source digest), never by checkout, so sharing cannot serve a stale program."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megaserve" / "jax"


def cache_env(env: dict[str, str]) -> dict[str, str]:
    """env with the cache settings child processes read (values already set are kept)."""
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(shared_cache_root()))
    env.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(JAX_CACHE_MAX_BYTES))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(MIN_COMPILE_SECS))
    return env


def configure_jax() -> None:
    """The same settings for this process's JAX (the environment's, where set)."""
    import jax

    settings = cache_env(dict(os.environ))
    jax.config.update("jax_compilation_cache_dir", settings["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update(
        "jax_compilation_cache_max_size", int(settings["JAX_COMPILATION_CACHE_MAX_SIZE"])
    )
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(settings["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )
