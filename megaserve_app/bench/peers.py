"""Decode and prefill baselines for peer engines (HF transformers, llama.cpp) on a GGUF model.

Why this is long: it runs alone, as a script, in the Python 3.11 reference environment
(torch, transformers, llama-cpp-python; megaserve is not installed there), so the GGUF
conversion, both peers' measurement loops and the one-process-per-row orchestration share
this file instead of importing each other.

Rows carry the raw seconds of each timed run (`times_s`: a whole prefill, or one decode step;
warm-up runs left out), not a summary: the caller (`megaserve_app/bench/prefill.py`,
`decode.py`) summarizes them with the same function as its own runs (`summary.run_stats`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

# A failed GGML_ASSERT otherwise tries to attach gdb and hangs; children inherit this.
os.environ.setdefault("GGML_NO_BACKTRACE", "1")

LLAMA_ENGINE = "llama.cpp"
HF_ENGINE = "transformers"
SEED = 0


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# --------------------------------------------------------------------------- make-f32


def is_fresh(dst: Path, src: Path) -> bool:
    return dst.exists() and dst.stat().st_mtime > src.stat().st_mtime


def out_dtype(tensor, dtype: str):
    """numpy dtype a tensor is written as: 1-D tensors (norms) always stay f32."""
    import numpy as np

    if dtype == "f16" and len(tensor.shape) > 1:
        return np.float16
    return np.float32


def copy_fields(reader, writer, file_type: int) -> None:
    """Copy every KV field (tokenizer included) except the ones GGUFWriter writes itself."""
    import gguf

    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = file_type
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)


def dequantized(tensor, dtype: str):
    """The tensor's data as a float array in numpy (row-major) shape, rows untouched."""
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return data.astype(out_dtype(tensor, dtype), copy=False)


def write_tensors(reader, writer, dtype: str) -> None:
    import numpy as np

    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape)]  # GGUF dims are reversed numpy dims
        nbytes = int(np.prod(shape)) * np.dtype(out_dtype(t, dtype)).itemsize
        writer.add_tensor_info(t.name, shape, out_dtype(t, dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(dequantized(t, dtype), tensor_endianess=reader.endianess)


def make_full_precision(src: Path, dst: Path, dtype: str) -> None:
    """Write DST: SRC's metadata and tensors, dequantized to f32/f16, same names and order."""
    import gguf

    if is_fresh(dst, src):
        log(f"{dst} is newer than {src}; not rewriting")
        return
    t0 = time.perf_counter()
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    file_type = gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32
    tmp = dst.with_name(dst.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch, endianess=reader.endianess)
    copy_fields(reader, writer, int(file_type))
    write_tensors(reader, writer, dtype)
    writer.close()
    os.replace(tmp, dst)
    log(f"wrote {dst} ({dst.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f}s")


# --------------------------------------------------------------------------- measurement


def random_ids(batch: int, length: int, vocab: int):
    import numpy as np

    return np.random.default_rng(SEED).integers(0, vocab, size=(batch, length), dtype=np.int64)


def hf_load(spec: dict):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[spec["precision"]]
    path = Path(spec["gguf"])
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype, attn_implementation="sdpa"
    )
    proj = model.model.layers[0].self_attn.q_proj
    log(
        f"transformers q_proj: {type(proj).__name__} {proj.weight.dtype}, "
        f"attn={model.config._attn_implementation}"
    )
    return model.eval()


def hf_step(model, tok, past):
    out = model(input_ids=tok, past_key_values=past, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values


def hf_row(spec: dict) -> dict:
    """Prefill `context` random tokens, then time single-token steps fed back by argmax."""
    import torch

    torch.set_num_threads(spec["threads"])
    model = hf_load(spec)
    ids = torch.from_numpy(random_ids(spec["batch"], spec["context"], model.config.vocab_size))
    with torch.inference_mode():
        t0 = time.perf_counter()
        tok, past = hf_step(model, ids, None)
        log(f"transformers prefill {tuple(ids.shape)}: {time.perf_counter() - t0:.1f}s")
        times = []
        for _ in range(spec["warmup"] + spec["steps"]):
            t0 = time.perf_counter()
            tok, past = hf_step(model, tok, past)
            times.append(time.perf_counter() - t0)
    return decode_result(spec, times, HF_ENGINE)


def decode_result(spec: dict, times_s: list[float], engine: str) -> dict:
    """Per-step seconds of `warmup` + `steps` decode steps: the timed ones, as a raw row."""
    return raw_result(spec, times_s[spec["warmup"] :], engine)


def timed_runs(spec: dict, run) -> list[float]:
    """Seconds of each of `runs` calls of run(), after `warmup` untimed calls."""
    for _ in range(spec["warmup"]):
        run()
    times = []
    for _ in range(spec["runs"]):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def raw_result(spec: dict, times_s: list[float], engine: str) -> dict:
    """A row of timed seconds for the caller to summarize."""
    return {
        "engine": engine,
        "precision": spec["precision"],
        "batch": spec["batch"],
        "context": spec["context"],
        "times_s": times_s,
    }


def hf_prefill_row(spec: dict) -> dict:
    """Time whole-prompt forwards of `batch` random prompts (a fresh KV cache each run, the
    last token's logits only, as a serving prefill)."""
    import torch

    torch.set_num_threads(spec["threads"])
    model = hf_load(spec)
    ids = torch.from_numpy(random_ids(spec["batch"], spec["context"], model.config.vocab_size))
    with torch.inference_mode():
        times = timed_runs(spec, lambda: hf_step(model, ids, None))
    return raw_result(spec, times, HF_ENGINE)


def n_ctx_per_seq(spec: dict) -> int:
    return spec["context"] + spec["warmup"] + spec["steps"] + 16


def llama_argmax(ctx, rows: int, vocab: int):
    import llama_cpp
    import numpy as np

    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(rows, vocab))
    return logits.argmax(axis=-1)


def llama_b1_row(spec: dict) -> dict:
    """Batch 1 through the high-level Llama API: eval the prompt, then single-token evals."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=spec["gguf"],
        n_ctx=n_ctx_per_seq(spec),
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        n_batch=512,
        verbose=False,
    )
    vocab = llm.n_vocab()
    t0 = time.perf_counter()
    llm.eval(random_ids(1, spec["context"], vocab)[0].tolist())
    log(f"llama.cpp prefill (1, {spec['context']}): {time.perf_counter() - t0:.1f}s")
    tok = int(llama_argmax(llm.ctx, 1, vocab)[0])
    times = []
    for _ in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        llm.eval([tok])
        tok = int(llama_argmax(llm.ctx, 1, vocab)[0])
        times.append(time.perf_counter() - t0)
    llm.close()
    return decode_result(spec, times, LLAMA_ENGINE)


def llama_context_params(spec: dict, n_batch: int):
    import llama_cpp

    params = llama_cpp.llama_context_default_params()
    params.n_ctx = spec["batch"] * n_ctx_per_seq(spec)
    params.n_batch = n_batch
    params.n_ubatch = n_batch
    params.n_seq_max = spec["batch"]
    params.n_threads = spec["threads"]
    params.n_threads_batch = spec["threads"]
    params.kv_unified = spec["kv_unified"]
    return params


def quiet_llama_logs() -> None:
    """Keep only llama.cpp's error-level log lines (the low-level API logs everything)."""
    import ctypes

    import llama_cpp

    @llama_cpp.llama_log_callback
    def callback(level, text, _user_data):
        if level == 4:  # GGML_LOG_LEVEL_ERROR (continuations of other levels are dropped)
            sys.stderr.write(text.decode(errors="replace"))

    quiet_llama_logs.callback = callback  # keep a reference alive for the C side
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))


class LowLevel:
    """One llama.cpp model + context + batch for B sequences (low-level API)."""

    def __init__(self, spec: dict):
        import llama_cpp

        self.lib = llama_cpp
        self.n_batch = max(512, spec["batch"])
        quiet_llama_logs()
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(spec["gguf"].encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file failed for {spec['gguf']}")
        params = llama_context_params(spec, self.n_batch)
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

    def clear(self) -> None:
        """Forget every sequence's KV (bindings older than the memory API: kv_self_clear)."""
        if hasattr(self.lib, "llama_memory_clear"):
            self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        else:
            self.lib.llama_kv_self_clear(self.ctx)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, pos, seq_id, want_logits); len(entries) <= n_batch."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, want
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def llama_prefill(ll: LowLevel, ids, last_logits: bool = False) -> None:
    """Each sequence's prompt in n_batch chunks; logits only for each prompt's last token
    when `last_logits` (what a serving prefill samples from), else none."""
    last = len(ids[0]) - 1
    entries = [
        (int(t), p, s, last_logits and p == last)
        for s, row in enumerate(ids)
        for p, t in enumerate(row)
    ]
    for i in range(0, len(entries), ll.n_batch):
        ll.decode(entries[i : i + ll.n_batch])


def llama_prefill_row(spec: dict) -> dict:
    """Time prefills of `batch` random prompts as separate sequences (KV cleared each run)."""
    ll = LowLevel(spec)
    ids = random_ids(spec["batch"], spec["context"], ll.vocab)

    def run():
        ll.clear()
        llama_prefill(ll, ids, last_logits=True)
        ll.lib.llama_synchronize(ll.ctx)

    times = timed_runs(spec, run)
    ll.close()
    return raw_result(spec, times, LLAMA_ENGINE)


def llama_batched_row(spec: dict) -> dict:
    """B sequences (own seq_id each) decoded together, one token per sequence per step."""
    ll = LowLevel(spec)
    batch, context = spec["batch"], spec["context"]
    t0 = time.perf_counter()
    llama_prefill(ll, random_ids(batch, context, ll.vocab))
    log(f"llama.cpp prefill ({batch}, {context}): {time.perf_counter() - t0:.1f}s")
    toks = random_ids(batch, 1, ll.vocab)[:, 0]
    times = []
    for step in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        ll.decode([(int(t), context + step, s, True) for s, t in enumerate(toks)])
        toks = llama_argmax(ll.ctx, batch, ll.vocab)
        times.append(time.perf_counter() - t0)
    ll.close()
    return decode_result(spec, times, LLAMA_ENGINE)


def measure(spec: dict) -> dict:
    if spec.get("mode") == "prefill":
        return hf_prefill_row(spec) if spec["engine"] == HF_ENGINE else llama_prefill_row(spec)
    if spec["engine"] == HF_ENGINE:
        return hf_row(spec)
    if spec["batch"] == 1:
        return llama_b1_row(spec)
    return llama_batched_row(spec)


def error_row(spec: dict, message: str) -> dict:
    return {
        "engine": spec["engine"],
        "precision": spec["precision"],
        "batch": spec["batch"],
        "context": spec["context"],
        "error": message,
    }


def run_row(spec: dict) -> None:
    """Child side: one measurement, one JSON line on stdout (an error row if it raises)."""
    try:
        emit(measure(spec))
    except Exception as exc:  # report any failure as a row
        emit(error_row(spec, f"{type(exc).__name__}: {exc}"))


# --------------------------------------------------------------------------- orchestration


def gguf_precision(path: str) -> str:
    """Most common type among a GGUF's 2-D tensors, lower-cased (q4_1, f32, f16, ...)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # the row itself reports the failure
        log(f"cannot read {path}: {exc}")
        return "unknown"
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    return kinds.most_common(1)[0][0].lower()


def llama_models(args) -> list[tuple[str, str]]:
    paths = [args.gguf] + ([args.f32_gguf] if args.f32_gguf else [])
    return [(gguf_precision(p), p) for p in paths]


def engine_models(args) -> list[tuple[str, str, str]]:
    """(engine, precision, GGUF path) of every peer the --engines list asks for."""
    models = []
    for engine in args.engines.split(","):
        if engine == "transformers":
            models += [(HF_ENGINE, p, args.gguf) for p in args.hf_dtypes.split(",")]
        elif engine in ("llamacpp", "llama.cpp"):
            models += [(LLAMA_ENGINE, p, path) for p, path in llama_models(args)]
        else:
            raise SystemExit(f"unknown engine {engine!r}")
    return models


def common_spec(args) -> dict:
    return {
        "warmup": args.warmup,
        "threads": args.threads,
        "kv_unified": args.llama_kv == "unified",
    }


def build_specs(args) -> list[dict]:
    base = dict(common_spec(args), context=args.context, steps=args.steps)
    return [
        dict(base, engine=e, precision=p, gguf=path, batch=b)
        for e, p, path in engine_models(args)
        for b in parse_ints(args.batch)
    ]


def build_prefill_specs(args) -> list[dict]:
    """One row per engine, precision, prompt length and batch; `context` is the prompt length
    and no decode steps follow it (steps 0 sizes llama.cpp's context to the prompt)."""
    base = dict(common_spec(args), mode="prefill", runs=args.runs, steps=0)
    return [
        dict(base, engine=e, precision=p, gguf=path, batch=b, context=n)
        for e, p, path in engine_models(args)
        for n in parse_ints(args.lengths)
        for b in parse_ints(args.batch)
    ]


def tee_stderr(stream, tail: list[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        tail[:] = (tail + [line.strip()])[-20:]


def collect(stream, lines: list[str]) -> None:
    lines.extend(stream)


def last_error(tail: list[str]) -> str:
    lines = [s for s in tail if s]
    return lines[-1][:300] if lines else "no output"


def wait_child(proc, timeout: float) -> bool:
    """Wait for the child; on timeout kill its whole process group. True if it finished."""
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return False


def spawn(spec: dict, timeout: float) -> dict:
    """Run one row in a child process so crashes and hangs become error rows."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "row", json.dumps(spec)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    out: list[str] = []
    tail: list[str] = []
    readers = [
        threading.Thread(target=collect, args=(proc.stdout, out), daemon=True),
        threading.Thread(target=tee_stderr, args=(proc.stderr, tail), daemon=True),
    ]
    for t in readers:
        t.start()
    finished = wait_child(proc, timeout)
    for t in readers:
        t.join(timeout=5)
    if not finished:
        return error_row(spec, f"timeout after {timeout:.0f}s")
    rows = [line for line in out if line.startswith("{")]
    if rows:
        return json.loads(rows[-1])
    return error_row(spec, f"exit code {proc.returncode}: {last_error(tail)}")


def llama_cpp_missing() -> bool:
    """True when `import llama_cpp` fails here (it is only built with WITH_LLAMA_CPP=1)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        log(f"llama.cpp rows skipped: {exc}")
        return True
    return False


def run_specs(specs: list[dict], timeout: float) -> None:
    """Each spec in its own child process, one JSON row each on stdout; llama.cpp rows say
    "not installed" without a child when the bindings cannot be imported."""
    missing = any(s["engine"] == LLAMA_ENGINE for s in specs) and llama_cpp_missing()
    for spec in specs:
        if missing and spec["engine"] == LLAMA_ENGINE:
            emit(error_row(spec, "not installed"))
            continue
        label = f"{spec['engine']} {spec['precision']} batch={spec['batch']}"
        log(f"{label} context={spec['context']}: start")
        t0 = time.perf_counter()
        row = spawn(spec, timeout)
        log(f"{label}: done in {time.perf_counter() - t0:.1f}s")
        emit(row)


# --------------------------------------------------------------------------- CLI


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def add_make_parser(sub) -> None:
    p = sub.add_parser("make-f32", help="dequantize a GGUF to f32/f16 for llama.cpp")
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--dst", type=Path, required=True)
    p.add_argument("--dtype", choices=["f32", "f16"], default="f32")


def add_engine_arguments(p) -> None:
    """The models, engines and threads every measuring mode takes."""
    p.add_argument("--gguf", required=True, help="quantized GGUF (llama.cpp; HF dequantizes)")
    p.add_argument("--f32-gguf", help="full-precision GGUF from make-f32 (llama.cpp)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engines", default="transformers,llamacpp")
    p.add_argument("--hf-dtypes", default="f32", help="comma list of f32,bf16")
    p.add_argument(
        "--llama-kv",
        choices=["unified", "split"],
        default="unified",
        help="llama.cpp KV layout for batch > 1 (split: one stream per sequence)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per row")


def add_decode_parser(sub) -> None:
    p = sub.add_parser("decode", help="measure decode steps; one JSON row per line")
    add_engine_arguments(p)
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)


def add_prefill_parser(sub) -> None:
    p = sub.add_parser("prefill", help="time whole-prompt prefills; one JSON row per line")
    add_engine_arguments(p)
    p.add_argument("--lengths", default="128,1024,4096,8192", help="prompt tokens")
    p.add_argument("--batch", default="1,4", help="prompts prefilled together")
    p.add_argument("--runs", type=int, default=3, help="timed runs per row")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before them")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_make_parser(sub)
    add_decode_parser(sub)
    add_prefill_parser(sub)
    sub.add_parser("row", help=argparse.SUPPRESS).add_argument("spec")
    args = parser.parse_args(argv)
    if args.cmd == "make-f32":
        make_full_precision(args.src, args.dst, args.dtype)
    elif args.cmd == "decode":
        run_specs(build_specs(args), args.timeout)
    elif args.cmd == "prefill":
        run_specs(build_prefill_specs(args), args.timeout)
    else:
        run_row(json.loads(args.spec))


if __name__ == "__main__":
    main()
