"""Test helpers for the router: a tiny chat checkpoint (weights + byte-level BPE tokenizer +
ChatML template) and a stack of real worker and router processes on one real Redis."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

from megaserve_app.launch import Cluster
from tests.conftest import random_tensors, tiny_llama_config
from tests.redis_server import RedisServer

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

    tok = write_tokenizer(d, vocab)
    hf = tiny_llama_config(vocab_size=tok.get_vocab_size(), max_position_embeddings=2048)
    hf["eos_token_id"] = tok.token_to_id("<|im_end|>")
    (d / "config.json").write_text(json.dumps(hf))
    save_file(random_tensors(hf, seed=seed), str(d / "model.safetensors"))
    return d


def write_tokenizer(d: Path, vocab: int = 384, pad_to: int = 0):
    """A byte-level BPE tokenizer trained on CORPUS (ChatML specials) in d; `pad_to`: filler
    tokens up to that many ids, for a model whose vocabulary is larger. Returns it."""
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
    tok.add_tokens([f"<filler_{i}>" for i in range(pad_to - tok.get_vocab_size())])
    tok.save(str(d / "tokenizer.json"))
    conf = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML}
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    return tok


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
        wait_router_view(router.address, len(decode), len(prefill))
        return router

    def wait_addresses(self, ids, timeout: float = 120.0) -> None:
        """Until Redis holds each worker's current address (a restarted worker re-registered,
        not its dead predecessor's record still within its TTL)."""
        import redis

        from megaserve.state_keys import worker_key

        r = redis.Redis.from_url(self.redis_url)
        end = time.monotonic() + timeout
        while True:
            seen = {i: r.hget(worker_key(i), "address") for i in ids}
            if all(a is not None and a.decode() == self.procs[i].address for i, a in seen.items()):
                return
            if time.monotonic() > end:
                want = {i: self.procs[i].address for i in ids}
                raise TimeoutError(f"registered addresses {seen} != {want} after {timeout} s")
            time.sleep(0.1)


def wait_router_view(address: str, decode: int, prefill: int, timeout: float = 60.0) -> None:
    """Polls the router's ListModels until its view (refreshed from Redis every
    state_refresh_ms) counts `decode` and `prefill` workers for its one model."""
    import grpc

    from megaserve.v1 import generation_pb2 as pb
    from megaserve.v1 import generation_pb2_grpc as pbg

    end = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = pbg.GenerationStub(ch)
        while True:
            models = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
            seen = [(m.name, m.decode_workers, m.prefill_workers) for m in models]
            if len(seen) == 1 and seen[0][1:] == (decode, prefill):
                return
            if time.monotonic() > end:
                raise TimeoutError(
                    f"router {address} sees {seen}, not {decode} decode and {prefill} prefill "
                    f"workers, after {timeout} s"
                )
            time.sleep(0.1)


def decode_counters(st, workers) -> dict[str, int]:
    """Summed over the decode workers: requests imported from the prefill tier, prompt
    tokens the decode workers computed themselves, and Generate calls."""
    from megaserve_app.launch import worker_stats

    stats = [worker_stats(st.procs[w].address) for w in workers]
    return {
        k: sum(getattr(s, k) for s in stats)
        for k in ("imported_requests", "prefill_tokens", "requests")
    }


def counters_moved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def tokens_equal_report(a: list[int], b: list[int]) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at {n}: {a[n : n + 5]} vs {b[n : n + 5]} (lengths {len(a)}, {len(b)})"


async def disagg_generate(d_addr, p_addr, rid, prompt, n, sp, transport=0):
    """What the router does: the hand-off (reserve on D, prefill on P into it), then stream
    n tokens (EOS ignored) from D; returns (ReserveResponse, PrefillResponse, tokens).
    p_addr None: no hand-off, D prefills the prompt itself (co-located; Nones returned)."""
    from megaserve.rpc import decode_pb2
    from router.workers import WorkerClients, handoff

    clients = WorkerClients()
    try:
        sampling = sp.to_proto(decode_pb2.SamplingParams)
        h = None
        if p_addr is not None:
            h = await handoff(clients, d_addr, p_addr, rid, prompt, sampling, transport=transport)
        req = decode_pb2.GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=sampling,
            stopping=decode_pb2.StoppingParams(max_tokens=n, ignore_eos=True),
        )
        toks = [t async for r in clients.decode(d_addr).Generate(req) for t in r.token_ids]
        return (h.reserve, h.prefill, toks) if h else (None, None, toks)
    finally:
        await clients.close()


def solo_generator(checkpoint, page_size: int, max_context: int, prefill_chunk: int):
    """One device, in this process: the tokens a multi-device or disaggregated run must
    give (`OfflineGenerator` over the checkpoint)."""
    from megaserve.model import LoadedModel
    from megaserve.offline import OfflineGenerator

    model = LoadedModel.load(str(checkpoint), progress=False)
    return OfflineGenerator(
        model, page_size=page_size, max_context=max_context, prefill_chunk=prefill_chunk
    )


@contextlib.contextmanager
def mesh_cluster(tmp: Path, checkpoint: Path, name: str, workers: dict, page_size: int):
    """(Cluster, RedisServer): workers {id: (kind, extra flags)} (each a real process forcing
    its own host devices for its --tp/--ep) over a tiny checkpoint, registered in one fresh
    Redis; small pool and context, programs compiled on first use."""
    rs = RedisServer(tmp).start()
    args = ("--kv-budget-mb", "1", "--max-context", "64", "--page-size", str(page_size))
    st = Cluster(
        rs.url, str(checkpoint), name, (*args, "--prefill-chunk", "32", "--warm-up", "none")
    )
    try:
        procs = [st.worker(kind, w, *flags) for w, (kind, flags) in workers.items()]
        for p in procs:
            p.wait_ready()
        st.wait_registered(list(workers))
        yield st, rs
    finally:
        st.stop()
        rs.kill()
