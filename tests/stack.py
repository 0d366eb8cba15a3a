"""Test helpers for the router: a tiny chat checkpoint (weights + byte-level BPE tokenizer +
ChatML template) and a stack of real worker and router processes on one real Redis."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from megaserve.state_keys import worker_key, workers_set
from tests.conftest import REPO, random_tensors, tiny_llama_config

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Serving systems batch requests continuously over a paged KV cache.",
    "Ünïcödé tëxt, 日本語のテキスト, emoji 🙂🚀 and more words to merge.",
] * 20


def make_chat_checkpoint(d: Path, vocab: int = 384, seed: int = 3) -> Path:
    """Writes an HF directory the router and workers load like a real model."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(d / "tokenizer.json"))
    conf = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML}
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    hf = tiny_llama_config(vocab_size=tok.get_vocab_size(), max_position_embeddings=2048)
    hf["eos_token_id"] = tok.token_to_id("<|im_end|>")
    (d / "config.json").write_text(json.dumps(hf))
    save_file(random_tensors(hf, seed=seed), str(d / "model.safetensors"))
    return d


class Proc:
    """A child process whose output is drained in the background (no pipe back-pressure)."""

    def __init__(self, cmd: list[str], name: str):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1",
            # Workers share the tests' persistent compile cache: restarts start warm.
            "JAX_COMPILATION_CACHE_DIR": str(REPO / ".cache" / "jax"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
        }
        self.name, self.lines = name, []
        self.p = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        self._ready = threading.Event()
        self.ready_line = ""
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line)
            if line.startswith("READY"):
                self.ready_line = line
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 120.0) -> str:
        self._ready.wait(timeout)
        if not self.ready_line:
            raise RuntimeError(f"{self.name} did not start:\n" + "".join(self.lines[-40:]))
        return self.ready_line

    @property
    def address(self) -> str:
        return re.search(r"grpc=(\S+)", self.ready_line).group(1)

    def kill9(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()

    def stop(self, timeout: float = 15.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return self.p.returncode


def megaserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "megaserve.cli", *args]


class Stack:
    """Workers and routers as real processes against one Redis; stop() reaps them all."""

    def __init__(self, redis_url: str, checkpoint: Path, max_context: int = 512):
        self.redis_url, self.checkpoint, self.max_context = redis_url, checkpoint, max_context
        self.procs: dict[str, Proc] = {}

    def worker(self, kind: str, worker_id: str, *extra: str) -> Proc:
        cmd = megaserve(
            f"{kind}-worker",
            "--checkpoint",
            str(self.checkpoint),
            "--served-model-name",
            "tiny-chat",
            "--worker-id",
            worker_id,
            "--redis-url",
            self.redis_url,
            "--kv-budget-mb",
            "8",
            "--max-context",
            str(self.max_context),
            "--prefill-chunk",
            "64",
            *extra,
        )
        p = self.procs[worker_id] = Proc(cmd, worker_id)
        return p

    def router(self, name: str, *extra: str) -> Proc:
        cmd = megaserve(
            "router",
            "--port",
            "0",
            "--redis-url",
            self.redis_url,
            "--checkpoint",
            f"tiny-chat={self.checkpoint}",
            *extra,
        )
        p = self.procs[name] = Proc(cmd, name)
        return p

    def wait_registered(self, ids: list[str], timeout: float = 60.0) -> None:
        r = redis.Redis.from_url(self.redis_url)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            members = {
                m.decode() for role in ("decode", "prefill") for m in r.smembers(workers_set(role))
            }
            if all(i in members and r.exists(worker_key(i)) for i in ids):
                return
            time.sleep(0.1)
        raise TimeoutError(f"workers {ids} not registered")

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()


def tokens_equal_report(a: list[int], b: list[int]) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at {n}: {a[n : n + 5]} vs {b[n : n + 5]} (lengths {len(a)}, {len(b)})"
