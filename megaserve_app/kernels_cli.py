"""`megaserve kernels compile`: AOT-compile the decode megakernel for a TPU target on any host."""

from __future__ import annotations

import argparse
import json
import sys


def add_kernels(sub) -> None:
    """Registers the `kernels` command group on the top-level subparsers."""
    k = sub.add_parser("kernels", help="device kernels: AOT compilation for TPU")
    ksub = k.add_subparsers(dest="kernels_cmd", required=True)
    c = ksub.add_parser(
        "compile",
        help="compile the decode megakernel for a TPU target (libtpu compile-only topology)",
    )
    c.add_argument("--config", required=True, help="HF-style config.json of the model")
    c.add_argument("--target", default="tpu7x", help="TPU target (tpu7x = TPU v7)")
    c.add_argument("--batch", type=int, default=1, help="decode batch (rows per step)")
    c.add_argument("--context", type=int, default=4096, help="tokens per row, in KV pages")
    c.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    c.add_argument(
        "--no-logits",
        action="store_true",
        help="greedy tokens only (no f32 logits output for sampling in XLA)",
    )
    c.add_argument(
        "--depth-a",
        type=int,
        default=None,
        help="force weight ring A's depth, skipping the VMEM fit (to see the compiler's verdict)",
    )
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_compile)


def cmd_compile(a: argparse.Namespace) -> int:
    """Exit 0 when it compiled, 1 with the compiler's message when not, 2 on a bad request."""
    from kernels.megakernel.aot import CompileRequest, compile_megakernel

    req = CompileRequest(
        config_path=a.config,
        target=a.target,
        batch=a.batch,
        context=a.context,
        page_size=a.page_size,
        emit_logits=not a.no_logits,
        depth_a=a.depth_a,
    )
    try:
        res = compile_megakernel(req)
    except ValueError as e:
        print(f"megaserve kernels compile: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(res))
    else:
        print(
            f"{res['config']} {res['target']} batch {res['batch']} context {res['context']}: "
            f"compiled={res['compiled']} vmem={res['vmem_bytes'] / 2**20:.1f} MiB "
            f"bytes/step={res['hbm_bytes_per_step'] / 1e9:.3f} GB "
            f"floor={res['floor_bytes_per_step'] / 1e9:.3f} GB "
            f"(x{res['bytes_over_floor']}) projected {res['projected_ms_per_step']} ms/step"
        )
    if not res["compiled"]:
        print(res.get("error", "compilation failed"), file=sys.stderr)
        return 1
    return 0
