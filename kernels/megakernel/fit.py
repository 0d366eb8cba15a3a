"""Compiler-verdict VMEM fit of the megakernel: compile a plan for a target and, when the
compiler refuses it for VMEM, shrink it by the overshoot it states and retry; the verdict is
cached per config and shape, so a later call compiles once."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kernels.megakernel.target import TOPOLOGIES, compile_plan

# How the TPU compiler words a kernel that does not fit VMEM (Mosaic's scoped allocation):
# `RESOURCE_EXHAUSTED: ... would exceed memory (size=67108864)`, `CompileTimeScopedVmemOom`,
# "Scoped allocation ... exceeded scoped vmem limit". An HBM refusal (`CompileTimeHbmOom`,
# "Ran out of memory on HBM": weights plus pool beyond the device) is not one: smaller rings
# cannot fix it.
_VMEM_OOM = re.compile(r"ScopedVmemOom|vmem|would exceed memory", re.I)
_HBM_OOM = re.compile(r"HbmOom|on HBM", re.I)
VERDICTS_FILE = "megakernel_vmem_verdicts.json"
# The compiler's measure in a scoped-VMEM refusal: "Scoped allocation with size 2.07M and
# limit 1.00M exceeded scoped vmem limit by 1.07M".
_SCOPED = re.compile(r"Scoped allocation with size ([\d.]+)([KMG]?) and limit ([\d.]+)([KMG]?)")
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def scoped_vmem(error: BaseException | str) -> tuple[int, int] | None:
    """(bytes the kernel's scoped VMEM allocation needs, the limit) from a compiler
    refusal, or None when the message does not say (rounded to the message's 2 decimals)."""
    m = _SCOPED.search(str(error))
    if not m:
        return None
    size, su, limit, lu = m.groups()
    return round(float(size) * _UNIT[su]), round(float(limit) * _UNIT[lu])


def compiler_vmem_bytes(plan: Any, target: str = "tpu7x", limit: int | None = None) -> int | None:
    """The scoped VMEM the compiler wants for `plan`, read from its refusal under `limit`
    (default: the plan's own vmem_bytes()); None when it compiles there or does not say.

    The figure is the allocation at the point the compiler gave up, so it depends on the
    limit (Llama-3.1-8B batch 8: 42.59M under a 1 MiB limit, 51.38M under 51.19 MiB, and it
    compiles under 52 MiB): only a limit near the real need gives the real need.
    """

    try:
        compile_plan(replace(plan, vmem_limit=limit or plan.vmem_bytes()), target)
    except Exception as e:
        need = scoped_vmem(e)
        return need[0] if need else None
    return None


def is_vmem_oom(error: BaseException | str) -> bool:
    """Whether a compiler error (or its message) says the kernel does not fit VMEM."""
    msg = str(error)
    return bool(_VMEM_OOM.search(msg)) and not _HBM_OOM.search(msg)


def verdicts_path() -> Path:
    """Where `compile_fitting` caches its verdicts: `$MEGASERVE_CACHE_DIR`, else the JAX
    compilation cache dir when one is set, else ~/.cache/megaserve."""
    base = os.environ.get("MEGASERVE_CACHE_DIR")
    if not base:
        import jax

        base = jax.config.jax_compilation_cache_dir or str(Path.home() / ".cache" / "megaserve")
    return Path(base) / VERDICTS_FILE


def _verdict_key(cfg: Any, plan_args: dict[str, Any], target: str) -> str:
    """A stable key for one (config fields, batch, page_size, pages_per_seq, dtypes, target,
    compiler version) combination: the verdict of another compiler may differ."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else vars(cfg)
    args = {k: jnp.dtype(v).name if k.endswith("_dtype") else v for k, v in plan_args.items()}
    try:
        from importlib.metadata import version

        libtpu = version("libtpu")
    except Exception:  # no libtpu distribution metadata: the key still names jax
        libtpu = "unknown"
    blob = json.dumps([fields, args, target, jax.__version__, libtpu], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _read_verdicts(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):  # absent or torn: start over, it is only a cache
        return {}


def _write_verdict(path: Path, key: str, verdict: dict[str, Any]) -> None:
    """Adds one verdict to the JSON file, atomically (write a temp file, then rename)."""
    verdicts = _read_verdicts(path) | {key: verdict}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(verdicts, indent=1, sort_keys=True))
    tmp.replace(path)


@dataclass
class Fitted:
    """What `compile_fitting` returns: the executable, the plan it was compiled from, and
    the compiler's refusals on the way (vmem_bytes of each refused plan, its message)."""

    compiled: Any
    plan: Any
    vmem_budget: int
    refused: list[tuple[int, str]]
    from_cache: bool


def compile_fitting(
    cfg: Any,
    batch: int,
    page_size: int,
    pages_per_seq: int,
    *,
    target: str = "tpu7x",
    vmem_budget: int | None = None,
    cache: Path | None | bool = True,
    pool_pages: int | None = None,
    **overrides,
) -> Fitted:
    """Compiles the step for `target`, shrinking the plan until the compiler accepts it.

    `make_plan` fits its own VMEM estimate into `vmem_budget`; the compiler adds internal
    scratch the estimate cannot see. On a VMEM out-of-memory verdict the budget drops just
    below the refused plan's `vmem_bytes()`, so `make_plan` takes one step off the deepest
    ring, and it compiles again. The budget that worked is cached (`verdicts_path()`, or the
    file `cache` names; False: no cache), keyed by the config fields, step shape, dtypes,
    target and compiler version, so the next call compiles once.

    Args:
      pool_pages: as `compile_plan` (not part of the cache key: VMEM does not depend on it).
      overrides: `MegaPlan` fields (dtypes, emit_logits, ring depths, vmem_limit).
    Raises:
      ValueError when even depth-2 rings are refused (the compiler's message included), or
      the compiler's own error when it is not a VMEM out-of-memory.
    """
    from kernels.megakernel.plan import VMEM_BYTES, VMEM_HEADROOM, make_plan

    if target not in TOPOLOGIES:
        raise ValueError(f"target {target!r} is not one of {sorted(TOPOLOGIES)}")
    path = None if cache is False else (verdicts_path() if cache is True else Path(cache))
    key = _verdict_key(
        cfg, {"batch": batch, "page_size": page_size, "pages": pages_per_seq} | overrides, target
    )
    cached = _read_verdicts(path).get(key) if path else None
    budget = vmem_budget if vmem_budget is not None else VMEM_BYTES - VMEM_HEADROOM
    if cached:
        budget = min(budget, int(cached["vmem_budget"]))
    refused: list[tuple[int, str]] = []
    while True:
        try:
            plan = make_plan(cfg, batch, page_size, pages_per_seq, vmem_budget=budget, **overrides)
        except ValueError as e:
            last = refused[-1][1] if refused else "none"
            raise ValueError(f"{e}; the compiler's last refusal: {last}") from e
        try:
            compiled = compile_plan(plan, target, pool_pages)
        except Exception as e:
            if not is_vmem_oom(e):
                raise
            refused.append((plan.vmem_bytes(), f"{type(e).__name__}: {e}"[:2000]))
            # Below the refused plan: make_plan takes at least one step off the deepest ring,
            # more when the compiler says by how much its allocation overshot.
            need = scoped_vmem(e)
            over = need[0] - need[1] if need else 0
            budget = plan.vmem_bytes() - max(1, over)
            continue
        break
    if path and (not cached or refused):
        verdict = {
            "vmem_budget": budget,
            "vmem_bytes": plan.vmem_bytes(),
            "depths": [plan.depth_a, plan.depth_b, plan.depth_kv, plan.depth_e],
            "refused_vmem_bytes": [v for v, _ in refused],
            "config": getattr(cfg, "model_type", "?"),
            "batch": batch,
            "pages_per_seq": pages_per_seq,
        }
        _write_verdict(path, key, verdict)
    return Fitted(compiled, plan, budget, refused, bool(cached) and not refused)
