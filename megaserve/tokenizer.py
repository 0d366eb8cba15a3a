"""Tokenizers from HF `tokenizer.json` or GGUF metadata, with the model's chat template."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from megaserve.chat_template import render_chat
from megaserve.errors import CheckpointError


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@dataclass
class TextTokenizer:
    """Encode/decode plus chat-template rendering; special-token strings for the template."""

    backend: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    special: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text. With add_special_tokens, the tokenizer.json post-processor runs
        (as `tokenizer(text)` in transformers, e.g. Llama 3's BOS) and GGUF's add_bos applies."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bos = self.backend.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise CheckpointError("this checkpoint has no chat template; use a plain prompt")
        tokens = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **self.special,
        }
        return render_chat(self.chat_template, messages, add_generation_prompt, tokens)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Template then tokenize; the template already writes any BOS it wants."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    @classmethod
    def from_hf_dir(cls, d: Path) -> TextTokenizer:
        try:
            backend = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise CheckpointError(f"{d / 'tokenizer.json'}: cannot load tokenizer: {e}") from e
        conf: dict = {}
        if (d / "tokenizer_config.json").exists():
            conf = json.loads((d / "tokenizer_config.json").read_text())
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        if (d / "chat_template.jinja").exists():  # transformers 5 writes it beside the config
            template = (d / "chat_template.jinja").read_text()

        def token_str(v):
            return v.get("content") if isinstance(v, dict) else v

        return cls(
            backend,
            template,
            token_str(conf.get("bos_token")),
            token_str(conf.get("eos_token")),
            bool(conf.get("add_bos_token", False)),
        )

    @classmethod
    def from_gguf_fields(cls, f: dict) -> TextTokenizer:
        """Byte-level BPE from `tokenizer.ggml.*`, built the way transformers reads a GGUF."""
        kind = f.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (gpt2)")
        tokens: list[str] = f["tokenizer.ggml.tokens"]
        types: list[int] = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())): i
            for i, t in enumerate(tokens)
        }
        merges = [tuple(m.split(" ")) for m in f["tokenizer.ggml.merges"]]
        backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        # CONTROL (3) tokens stay whole and are special; USER_DEFINED (4) stay whole, not special.
        control = [t for t, ty in zip(tokens, types) if ty == 3 and set(t) <= alphabet]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        user = [t for t, ty in zip(tokens, types) if ty == 4 and t in vocab]
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

        def tok(key):
            i = f.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        return cls(
            backend,
            f.get("tokenizer.chat_template"),
            tok("tokenizer.ggml.bos_token_id"),
            tok("tokenizer.ggml.eos_token_id"),
            bool(f.get("tokenizer.ggml.add_bos_token", False)),
        )
