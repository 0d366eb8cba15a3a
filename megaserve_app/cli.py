"""The `megaserve` command line: generate, bench, workers, router, serve."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import sys

from megaserve.errors import BackendError, CheckpointError, MeshError, RequestError
from megaserve.worker_args import add_backend_argument, add_dtype_argument


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated ints: {e}") from e


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint in-process")
    p.add_argument(
        "--checkpoint",
        default="smollm2",
        help="HF directory, .gguf file, or 'smollm2' (the packaged GGUF)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text (no chat template)")
    src.add_argument("--chat", help="one user message, rendered with the chat template")
    src.add_argument("--prompt-ids", type=_ids, help="comma-separated prompt token ids")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--steps-per-call",
        type=int,
        default=1,
        help="decode steps per device call (multi-step decode)",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-context", type=int, default=4096)
    add_dtype_argument(p)
    add_backend_argument(p)
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel devices (Llama family and Qwen3-MoE, XLA step); on CPU forces "
        "tp x ep host devices",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel devices (Qwen3-MoE: num_experts / ep experts each), times --tp",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"token_ids": [...], "text": "..."} for the generated part only',
    )
    p.add_argument("--server", help="generate through a running router (host:port) instead")
    p.add_argument("--model", help="with --server: the model name (default: the only one)")
    p.add_argument("--stop", action="append", help="with --server: a stop string (repeatable)")
    _add_client_auth(p)


def _add_client_auth(p) -> None:
    p.add_argument("--token", default=os.environ.get("MEGASERVE_API_TOKEN"), help="bearer token")
    p.add_argument("--tls-ca", help="CA certificate: connect with TLS")


def cmd_generate(a: argparse.Namespace) -> int:
    if a.server:
        from megaserve_app.client import generate_remote

        return generate_remote(a)
    from megaserve.logs import configure
    from megaserve.model import LoadedModel, serving_dtype
    from megaserve.offline import OfflineGenerator
    from megaserve.parallel.mesh import ParallelConfig, ensure_host_devices
    from megaserve.sampling_params import SamplingParams

    # Log lines (the backend choice) go to stderr: stdout is the text, or the --json object.
    # Always: structlog's default (also after structlog.testing.capture_logs) prints to stdout.
    configure()
    parallel = ParallelConfig(tp=a.tp, ep=a.ep)
    ensure_host_devices(parallel.devices)  # before anything starts JAX's backend
    sampling = SamplingParams(a.temperature, a.top_k, a.top_p, a.min_p, a.seed)
    # tp > 1: weights stay on the host until the runner splits them over the mesh.
    on_device = parallel.devices == 1
    model = LoadedModel.load(
        a.checkpoint, serving_dtype(a.dtype), progress=not a.json, on_device=on_device
    )
    if not on_device:
        parallel.check_model(model.cfg)
    tok = model.tokenizer
    if a.prompt_ids is not None:
        ids = a.prompt_ids
    elif tok is None:
        raise RequestError(f"{a.checkpoint} has no tokenizer; use --prompt-ids")
    elif a.chat is not None:
        ids = tok.encode_chat([{"role": "user", "content": a.chat}])
    else:
        ids = tok.encode(a.prompt, add_special_tokens=True)
    gen = OfflineGenerator(
        model,
        page_size=a.page_size,
        max_context=a.max_context,
        steps_per_call=a.steps_per_call,
        backend=a.backend,
        parallel=parallel,
    )
    stream = gen.stream(ids, a.max_new_tokens, sampling, ignore_eos=a.ignore_eos)
    out: list[int] = []
    if a.json:
        out = list(stream)
        text = tok.decode(_strip_eos(out, model.eos_token_ids)) if tok else ""
        print(json.dumps({"token_ids": out, "text": text}, ensure_ascii=False))
        return 0
    printed = ""
    for t in stream:
        out.append(t)
        if tok is None:
            print(t, end=" ", flush=True)
            continue
        text = tok.decode(_strip_eos(out, model.eos_token_ids), skip_special_tokens=True)
        # Hold back a trailing partial UTF-8 sequence until its last byte arrives.
        if not text.endswith("\ufffd"):
            print(text[len(printed) :], end="", flush=True)
            printed = text
    print()
    return 0


def _decode_worker(a: argparse.Namespace) -> int:
    from decode_service.main import main as worker_main

    return worker_main(a)


def _prefill_worker(a: argparse.Namespace) -> int:
    from prefill_service.main import main as prefill_main

    return prefill_main(a)


def _router(a: argparse.Namespace) -> int:
    from router.main import main as router_main

    return router_main(a)


def _serve(a: argparse.Namespace) -> int:
    from megaserve_app.serve import serve

    return serve(a)


def _chat(a: argparse.Namespace) -> int:
    from megaserve_app.client import chat

    return chat(a)


def _strip_eos(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def main(argv: list[str] | None = None) -> int:
    # kill -USR2 PID: every thread's stack to stderr (a process that hangs says where).
    with contextlib.suppress(ValueError, OSError):  # a stderr with no file (called in-process)
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    if os.environ.pop("MEGASERVE_DIE_WITH_PARENT", None) == "1":
        from megaserve_app.launch import die_with_parent

        die_with_parent()
    parser = argparse.ArgumentParser(prog="megaserve", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_generate(sub)
    from megaserve_app.bench.cli import add_bench

    add_bench(sub)
    from megaserve_app.kernels_cli import add_kernels

    add_kernels(sub)
    w = sub.add_parser("decode-worker", help="run a decode worker (gRPC, continuous batching)")
    from decode_service.main import add_arguments

    add_arguments(w)
    w.set_defaults(func=_decode_worker)
    pw = sub.add_parser("prefill-worker", help="run a prefill worker (gRPC, KV hand-off)")
    from prefill_service.main import add_arguments as add_prefill_arguments

    add_prefill_arguments(pw)
    pw.set_defaults(func=_prefill_worker)
    r = sub.add_parser("router", help="run the public gRPC router (megaserve.v1.Generation)")
    from router.main import add_arguments as add_router_arguments

    add_router_arguments(r)
    r.set_defaults(func=_router)
    sv = sub.add_parser("serve", help="the whole stack locally: Redis, workers, router")
    from megaserve_app.serve import add_arguments as add_serve_arguments

    add_serve_arguments(sv)
    sv.set_defaults(func=_serve)
    ch = sub.add_parser("chat", help="interactive chat with a running router (streams)")
    ch.add_argument("--server", default="127.0.0.1:50051")
    ch.add_argument("--system", help="a system prompt")
    ch.add_argument("--max-new-tokens", type=int, default=256)
    ch.add_argument("--temperature", type=float, default=0.0)
    _add_client_auth(ch)
    ch.set_defaults(func=_chat)
    a = parser.parse_args(argv)
    try:
        if a.cmd == "generate":
            return cmd_generate(a)
        return a.func(a)
    except (CheckpointError, RequestError, BackendError, MeshError) as e:
        print(f"megaserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
