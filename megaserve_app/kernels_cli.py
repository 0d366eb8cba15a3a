"""`megaserve kernels compile` (the decode megakernel) and `compile-worker` (a worker's whole
program set): AOT compilation for a TPU target on any host."""

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
    c.add_argument(
        "--topology",
        default=None,
        help="compile over a mesh of this compile-only topology's devices (tpu7x:2x2x1 = 8, "
        "tpu7x:2x2x2 = 16 over 2 processes): the tensor-parallel XLA decode step and prefill "
        "chunk; tp x ep must equal its device count",
    )
    c.add_argument("--tp", type=int, default=1, help="tensor parallelism (with --topology)")
    c.add_argument("--ep", type=int, default=1, help="expert parallelism (with --topology)")
    c.add_argument("--chunk", type=int, default=512, help="prefill tokens per call (--topology)")
    c.add_argument(
        "--megakernel",
        action="store_true",
        help="with --topology: compile the tp megakernel decode step, not the XLA programs",
    )
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_compile)
    add_compile_worker(ksub)
    add_compile_prefill(ksub)


def _run(command: str, make, a: argparse.Namespace) -> dict | None:
    """make()'s report, printed as JSON under --json; None (after naming the error) when the
    request is bad (a ValueError): the caller exits 2."""
    try:
        res = make()
    except ValueError as e:
        print(f"megaserve kernels {command}: error: {e}", file=sys.stderr)
        return None
    if a.json:
        print(json.dumps(res))
    return res


def add_compile_prefill(ksub) -> None:
    c = ksub.add_parser(
        "compile-prefill",
        help="compile the prefill program of one chunk at one context for a TPU target",
    )
    c.add_argument("--config", required=True, help="HF-style config.json of the model")
    c.add_argument("--target", default="tpu7x", help="TPU target (tpu7x = TPU v7)")
    c.add_argument("--chunk", type=int, default=512, help="new tokens per sequence per call")
    c.add_argument("--context", type=int, default=8192, help="tokens per sequence")
    c.add_argument("--batch", type=int, default=1, help="sequences per call")
    c.add_argument("--page-size", type=int, default=16)
    c.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_compile_prefill)


def cmd_compile_prefill(a: argparse.Namespace) -> int:
    """Exit 0 when it compiled, 1 with the compiler's message when not, 2 on a bad request."""
    from megaserve_app.compile_prefill import compile_prefill

    args = (a.config, a.target, a.chunk, a.context, a.batch, a.page_size, a.dtype)
    res = _run("compile-prefill", lambda: compile_prefill(*args), a)
    if res is None:
        return 2
    if not a.json:
        vmem = res["vmem_bytes"]
        print(
            f"{res['config']} {res['target']} batch {res['batch']} chunk {res['chunk']} "
            f"context {res['context']}: compiled={res['compiled']} attention={res['attention']} "
            f"vmem={'-' if vmem is None else f'{vmem / 2**20:.1f} MiB'} "
            f"temp={res['hbm_temp_bytes']} flops={res['flops_per_chunk'] / 1e12:.2f} T "
            f"projected compute {res['projected_compute_ms']} ms vs bandwidth "
            f"{res['projected_bandwidth_ms']} ms ({res['bound']}-bound)"
        )
    if not res["compiled"]:
        print(res.get("error", "compilation failed"), file=sys.stderr)
        return 1
    return 0


def add_compile_worker(ksub) -> None:
    w = ksub.add_parser(
        "compile-worker",
        help="compile every program a decode or prefill worker runs, for a TPU target, "
        "with each program's memory, re-layouts and the per-device memory plan",
    )
    w.add_argument("--config", required=True, help="HF-style config.json of the model")
    w.add_argument("--target", default="tpu7x", help="TPU target (tpu7x = TPU v7)")
    w.add_argument("--role", choices=("decode", "prefill"), required=True)
    w.add_argument("--max-running", type=int, default=64, help="decode batch (decode role)")
    w.add_argument("--max-batch", type=int, default=8, help="prompts per prefill call")
    w.add_argument("--prefill-chunk", type=int, default=256)
    w.add_argument("--max-context", type=int, default=8192)
    w.add_argument("--page-size", type=int, default=16)
    w.add_argument(
        "--kv-budget-mb",
        type=int,
        default=None,
        help="KV pool size (default: what the device has left after weights and margins)",
    )
    w.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    w.add_argument("--backend", choices=("auto", "pallas", "xla"), default="auto")
    w.add_argument("--jobs", type=int, default=2, help="programs compiling at once")
    w.add_argument("--json", action="store_true", help="print one JSON object")
    w.set_defaults(func=cmd_compile_worker)


def cmd_compile_worker(a: argparse.Namespace) -> int:
    """Exit 0 when every program compiled, 1 (with the compiler's messages) when one did not,
    2 on a bad request."""
    from megaserve_app.compile_worker import WorkerTarget, compile_worker

    t = WorkerTarget(
        config_path=a.config, target=a.target, role=a.role, max_running=a.max_running,
        max_batch=a.max_batch, prefill_chunk=a.prefill_chunk, max_context=a.max_context,
        page_size=a.page_size, kv_budget_mb=a.kv_budget_mb, dtype=a.dtype, backend=a.backend,
        jobs=a.jobs,
    )  # fmt: skip
    res = _run("compile-worker", lambda: compile_worker(t), a)
    if res is None:
        return 2
    if not a.json:
        mem = res["hbm_per_device"]
        for r in res["programs"]:
            print(
                f"{r['name']}{r['key']}: compiled={r['compiled']} temp={r.get('hbm_temp_bytes')} "
                f"relayouts={r['relayout_ops']} {r['compile_s']} s"
            )
        print(
            f"{res['role']} {res['backend']}: {res['program_count']} programs, "
            f"all_compiled={res['all_compiled']} relayout_ops={res['relayout_ops_total']} "
            f"weights={mem['weights'] / 1e9:.2f} GB pool={mem['kv_pool'] / 1e9:.2f} GB "
            f"temp_max={mem['temp_max'] / 1e9:.3f} GB of {mem['capacity'] / 1e9:.0f} GB "
            f"fits={res['fits']} in {res['compile_s']} s"
        )
    for r in res["programs"]:
        if not r["compiled"]:
            print(f"{r['name']}{r['key']}: {r['error']}", file=sys.stderr)
    return 0 if res["all_compiled"] else 1


def cmd_compile(a: argparse.Namespace) -> int:
    """Exit 0 when it compiled, 1 with the compiler's message when not, 2 on a bad request."""
    from kernels.megakernel.aot import CompileRequest, compile_megakernel

    if a.topology or a.tp > 1 or a.ep > 1:
        return cmd_compile_mesh(a)

    req = CompileRequest(
        config_path=a.config,
        target=a.target,
        batch=a.batch,
        context=a.context,
        page_size=a.page_size,
        emit_logits=not a.no_logits,
        depth_a=a.depth_a,
    )
    res = _run("compile", lambda: compile_megakernel(req), a)
    if res is None:
        return 2
    if not a.json:
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


def cmd_compile_mesh(a: argparse.Namespace) -> int:
    """`kernels compile --topology`: exit codes as `cmd_compile`."""
    from megaserve_app.compile_mesh import MeshCompile, compile_mesh

    req = MeshCompile(
        config_path=a.config, topology=a.topology or "tpu7x:2x2x1", tp=a.tp, ep=a.ep,
        batch=a.batch, context=a.context, chunk=a.chunk, page_size=a.page_size,
    )  # fmt: skip
    if a.megakernel:
        from megaserve_app.compile_mesh_megakernel import compile_megakernel_mesh

        res = _run("compile", lambda: compile_megakernel_mesh(req), a)
        if res is not None and not res["compiled"]:
            print(res["error"], file=sys.stderr)
            return 1
        if res is not None and not a.json:
            r = res["decode"]
            print(
                f"{res['topology']} tp={res['tp']} megakernel batch {res['batch']} context "
                f"{res['context']}: vmem={r['vmem_bytes'] / 2**20:.1f} MiB temp="
                f"{r['hbm_temp_bytes']} B bytes/floor={r['bytes_over_floor']} rounds="
                f"{r['collective_rounds']} projected={r['projected_ms']}"
            )
        return 2 if res is None else 0
    res = _run("compile", lambda: compile_mesh(req), a)
    if res is None:
        return 2
    if not a.json:
        mem = res["hbm_per_device"]
        for kind in ("decode", "prefill"):
            r = res[kind]
            print(
                f"{kind}: compiled={r['compiled']} temp={r.get('hbm_temp_bytes')} "
                f"rounds={r.get('collective_rounds')} ici={r.get('ici_bytes_per_device')} B "
                f"projected={r.get('projected_ms')} {r['compile_s']} s"
            )
        print(
            f"{res['topology']} tp={res['tp']} ep={res['ep']} batch {res['batch']} context "
            f"{res['context']}: weights={mem['weights'] / 1e9:.2f} GB pool="
            f"{mem['kv_pool'] / 1e9:.2f} GB per device, fits={res['fits']}"
        )
    for kind in ("decode", "prefill"):
        if not res[kind]["compiled"]:
            print(f"{kind}: {res[kind]['error']}", file=sys.stderr)
    return 0 if res["compiled"] else 1
