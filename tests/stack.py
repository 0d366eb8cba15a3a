"""Test helpers for the router: a tiny chat checkpoint (weights + byte-level BPE tokenizer +
ChatML template) and a stack of real worker and router processes on one real Redis."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from megaserve_app.launch import Cluster
from tests.conftest import random_tensors, tiny_llama_config

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


class Stack(Cluster):
    """The tiny chat model's workers and routers (small pools, a 512-token context)."""

    def __init__(
        self, redis_url: str, checkpoint: Path, max_context: int = 512, log_dir: Path | None = None
    ):
        super().__init__(
            redis_url,
            str(checkpoint),
            "tiny-chat",
            ("--kv-budget-mb", "8", "--max-context", str(max_context), "--prefill-chunk", "64"),
            echo=self._log if log_dir else None,
        )
        # Every process's output, restarts appended: what a failed system test is read from.
        self.log_dir = log_dir
        self._log_lock = threading.Lock()

    def _log(self, name: str, line: str) -> None:
        with self._log_lock, open(self.log_dir / f"{name}.log", "a") as f:
            f.write(f"{time.monotonic():.3f} {line}")

    def log_tails(self, n: int = 30) -> str:
        """The last n lines of every process's log (for a failing test's report)."""
        out = []
        for f in sorted(self.log_dir.glob("*.log")) if self.log_dir else []:
            out.append(f"--- {f.name}\n" + "".join(f.read_text().splitlines(True)[-n:]))
        return "\n".join(out)

    def up(self, decode: tuple[str, ...], prefill: tuple[str, ...], config: str):
        """Starts the workers and router "r1" (config: a load-balancing YAML), waits until
        every worker is registered and the router has refreshed its view; returns r1."""
        ws = [self.worker("decode", w) for w in decode]
        ws += [self.worker("prefill", w) for w in prefill]
        router = self.router("r1", "--config", config)
        for p in [*ws, router]:
            p.wait_ready()
        self.wait_registered([*decode, *prefill])
        time.sleep(0.6)  # the router's view refreshes every 200 ms
        return router


def tokens_equal_report(a: list[int], b: list[int]) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at {n}: {a[n : n + 5]} vs {b[n : n + 5]} (lengths {len(a)}, {len(b)})"
