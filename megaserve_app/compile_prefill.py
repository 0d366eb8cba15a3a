"""`megaserve kernels compile-prefill`: the prefill program a prefill worker runs for its
largest call (max batch x chunk tokens at a context), compiled for a target from this host,
with the Pallas attention kernel's VMEM, the program's HBM temp, and the chunk's flops and
bytes against the target's peaks (projected, not measured)."""

from __future__ import annotations

import math
import re
import time
from typing import Any

from kernels.megakernel.cost import TPU7X
from megaserve_app.compile_worker import (
    WorkerTarget,
    _compile_one,
    _pool_pages,
    _setup,
    device_hbm_bytes,
)
from megaserve_app.relayouts import relayout_ops


def chunk_flops(cfg, rows: int, chunk: int, context: int) -> dict[str, int]:
    """Matmul flops of one prefill call: `rows` sequences whose `chunk` new tokens end at
    `context` (the costliest call: the most keys). Attention counts only the causal keys
    (QK and PV: 4 x Hq x D per key per query); MoE layers count top_k experts per token."""
    h, tokens = cfg.hidden_size, rows * chunk
    attn_proj = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h
    moe_layers = set(getattr(cfg, "moe_layers", ()))
    mlp = 0
    for li in range(cfg.num_layers):
        if li in moe_layers:
            mlp += 3 * h * cfg.moe_intermediate_size * cfg.top_k + h * cfg.num_experts
        else:
            mlp += 3 * h * cfg.intermediate_size
    linear = 2 * tokens * (cfg.num_layers * attn_proj + mlp)
    first = context - chunk  # keys seen by query i: first + i + 1
    keys = chunk * first + chunk * (chunk + 1) // 2
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys * rows
    lm_head = 2 * rows * h * cfg.vocab_size  # one position per sequence
    return {"linear": linear, "attention": attention, "lm_head": lm_head}


def chunk_bytes(weight_bytes: int, cfg, rows: int, chunk: int, context: int, row: int,
                dtype_bytes: int, block_q: int) -> int:  # fmt: skip
    """HBM bytes one call moves at least: every weight once, and each query block's K/V
    pages (the kernel reads a sequence's keys once per block of block_q queries)."""
    per_key = 2 * row * dtype_bytes * cfg.num_layers
    q_blocks = math.ceil(chunk / block_q)
    read = sum(min(context, context - chunk + (i + 1) * block_q) for i in range(q_blocks))
    return weight_bytes + rows * (read + chunk) * per_key


def _vmem(hlo: str) -> int | None:
    """The largest scoped VMEM a Mosaic kernel in the compiled program uses."""
    used = re.findall(r'used_scoped_memory_configs":\[\{[^]]*"size":"(\d+)"', hlo)
    return max(map(int, used)) if used else None


def compile_prefill(
    config_path: str, target: str = "tpu7x", chunk: int = 512, context: int = 8192,
    batch: int = 1, page_size: int = 16, dtype: str = "bf16",
) -> dict[str, Any]:  # fmt: skip
    """Compiles the prefill program of the call (batch, chunk) with page tables for
    `context`; returns the JSON-able report. ValueError on a bad request."""
    import jax

    from kernels.megakernel.target import target_device
    from kernels.registry import family_for
    from megaserve.runner.warm import weight_copies

    for name, v in (("chunk", chunk), ("context", context), ("batch", batch)):
        if v < 1:
            raise ValueError(f"--{name}={v} must be >= 1")
    if chunk > context:
        raise ValueError(f"--chunk={chunk} exceeds --context={context}")
    t = WorkerTarget(
        config_path=config_path, target=target, role="prefill", max_batch=batch,
        prefill_chunk=chunk, max_context=context, page_size=page_size, dtype=dtype,
    )  # fmt: skip
    dev, sharding, mesh = target_device(target)
    t0 = time.perf_counter()
    capacity = device_hbm_bytes(dev, target)
    _, runner, pool, _, _, _ = _setup(t, 2)
    weights = sum(weight_copies(runner).values())
    pages = _pool_pages(t, capacity, weights, pool.bytes_per_page)
    programs, runner, pool, _, _, _ = _setup(t, pages)
    key = (max(runner.step_cfg.prefill_batch_buckets), max(runner.step_cfg.token_buckets))
    [program] = [p for p in programs if p.name == "prefill" and p.key == key]
    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # compile-only: no client
    try:
        row = _compile_one(program, sharding, mesh)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was)
    hlo = row.pop("_hlo", "")
    cfg = runner.cfg
    family, _ = family_for(cfg.model_type)
    flops = chunk_flops(cfg, key[0], key[1], context)
    block_q = next(n for n in (128, 64, 32, 16, 8, 1) if key[1] % n == 0)
    hbm = chunk_bytes(weights, cfg, key[0], key[1], context, pool.k.shape[-1],
                      pool.k.dtype.itemsize, block_q)  # fmt: skip
    compute_s = sum(flops.values()) / TPU7X.mxu_flops_per_s
    bandwidth_s = hbm / TPU7X.hbm_bytes_per_s
    return {
        "config": config_path,
        "target": target,
        "batch": key[0],
        "chunk": key[1],
        "context": context,
        "page_size": page_size,
        "dtype": dtype,
        "kv_pool_pages": pages,
        "compiled": row["compiled"],
        **({"error": row["error"]} if not row["compiled"] else {}),
        "attention": "pallas ragged prefill kernel" if "tpu_custom_call" in hlo else "xla",
        "vmem_bytes": _vmem(hlo),
        "hbm_temp_bytes": row.get("hbm_temp_bytes"),
        "relayout_ops": len(relayout_ops(hlo, pool.k.shape, [])) if row["compiled"] else None,
        "flops_per_chunk": sum(flops.values()),
        "flops_by_part": flops,
        "hbm_bytes_per_chunk": hbm,
        "projected_compute_ms": round(1e3 * compute_s, 3),
        "projected_bandwidth_ms": round(1e3 * bandwidth_s, 3),
        "bound": "compute" if compute_s >= bandwidth_s else "bandwidth",
        "peaks_assumed": {
            "mxu_flops_per_s": TPU7X.mxu_flops_per_s,
            "hbm_bytes_per_s": TPU7X.hbm_bytes_per_s,
        },
        "compile_s": row["compile_s"],
        "wall_s": round(time.perf_counter() - t0, 1),
    }
