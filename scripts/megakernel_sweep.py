"""The decode megakernel's report sweep: for each model config, batch and context, the plan's
VMEM, HBM bytes per step against the floor, and the static cost model's compute and HBM time
per TensorCore device (`kernels/megakernel/cost.py`); `--compile` adds the tpu7x verdict
(40-130 s per point on a 2-core host). Prints a Markdown table.

    .venv/bin/python scripts/megakernel_sweep.py [--compile] [CONFIG ...]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.kv_cache import pool_row  # noqa: E402
from kernels.megakernel.aot import CompileRequest, _accounting, compile_megakernel, load_config  # noqa: E402
from kernels.megakernel.plan import make_plan  # noqa: E402

MODELS = ["llama-3.1-8b", "qwen3-30b-a3b", "qwen3-14b"]
BATCHES, CONTEXTS = (1, 8, 32, 64), (4096, 32768)


def row(path: str, batch: int, context: int, compile_it: bool) -> str:
    cfg = load_config(path)
    req = CompileRequest(path, batch=batch, context=context)
    try:
        kv_row = pool_row(cfg.num_kv_heads, cfg.head_dim, "tpu")  # the TPU pool's rows
        pages = math.ceil(context / req.page_size)
        plan = make_plan(cfg, batch, req.page_size, pages, kv_row=kv_row)
    except ValueError as e:  # the VMEM plan refuses: say so, with its figure
        return f"| {Path(path).stem} | {batch} | {context} | refused: {str(e)[:70]} |||||||"
    r = compile_megakernel(req) if compile_it else _accounting(req, cfg, plan)
    total, att = r["cost"]["total"], r["cost"]["attention"]
    compiled = ("yes" if r["compiled"] else "no") if compile_it else "-"
    return (
        f"| {Path(path).stem} | {batch} | {context} | {compiled} | "
        f"{r['vmem_bytes'] / 2**20:.1f} | {r['hbm_bytes_per_step'] / 1e9:.3f} | "
        f"{r['bytes_over_floor']:.4f} | {total['compute_ms']:.3f} | {total['hbm_ms']:.3f} | "
        f"{att['compute_ms']:.3f} / {att['hbm_ms']:.3f} | {total['bound']} | {total['dmas']} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", help="config.json paths (default: the three models)")
    ap.add_argument("--compile", action="store_true", help="also compile each point for tpu7x")
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    paths = args.configs or [str(root / "configs" / "models" / f"{m}.json") for m in MODELS]
    print("| model | batch | context | compiled | VMEM MiB | HBM GB/step | over floor | "
          "compute ms | HBM ms | attention compute / K/V ms | bound | DMAs |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        for context in CONTEXTS:
            for batch in BATCHES:
                print(row(path, batch, context, args.compile), flush=True)


if __name__ == "__main__":
    main()
