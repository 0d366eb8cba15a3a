"""IncrementalDetokenizer: streamed deltas add up to the full decode for any batching."""

from __future__ import annotations

import json
import random

import gguf
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from megaserve.checkpoint import resolve_checkpoint_path
from megaserve.checkpoint.gguf_file import _fields
from megaserve.tokenizer import TextTokenizer
from router.detokenize import IncrementalDetokenizer
from tests.test_tokenizer_hf_dir import _write as write_wordlevel_dir

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "世界你好，日本語のテキストです。",
    "emoji 😀🎉 family 👩‍👩‍👧‍👦 flag 🏳️‍🌈 skin 👍🏽",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 \u05e9\u05c1",
    "mixed 世界 😀 e\u0301! and  double  spaces\nnew\tline ",
]
PROMPTS = ["", "Tell me a story."]


def _unigram_dir(d, style: str) -> TextTokenizer:
    """A SentencePiece-like Unigram tokenizer with byte fallback, saved and loaded as an HF dir."""
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{b:02X}>", -20.0) for b in range(256)]
    words = ["▁the", "▁hello", "▁world", "▁Hello", "▁story", "▁me", "▁a", "ing", "▁is", "日本"]
    pieces += [(w, -2.0) for w in words]
    chars = "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-\n\t世界你好語é"
    pieces += [(c, -5.0) for c in chars]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    if style == "llama":  # Llama 2: normalizer writes ▁, decoder Replace/ByteFallback/Fuse/Strip
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:  # Metaspace pre-tokenizer and decoder
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always")]
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return TextTokenizer.from_hf_dir(d)


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, TextTokenizer]:
    # Only the GGUF's tokenizer metadata: the weights are not needed here.
    reader = gguf.GGUFReader(str(resolve_checkpoint_path("smollm2")))
    out = {"smollm2": TextTokenizer.from_gguf_fields(_fields(reader))}
    wordlevel = tmp_path_factory.mktemp("wordlevel")
    write_wordlevel_dir(wordlevel, with_jinja=False)
    out["wordlevel"] = TextTokenizer.from_hf_dir(wordlevel)  # no decoder: joins with " "
    for style in ("llama", "metaspace"):
        out[style] = _unigram_dir(tmp_path_factory.mktemp(style), style)
    return out


NAMES = ["smollm2", "wordlevel", "llama", "metaspace"]


def special_ids(tok: TextTokenizer) -> list[int]:
    return sorted(i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special)


def byte_ids(tok: TextTokenizer) -> list[int]:
    """Tokens of one byte: byte-level BPE's single characters, or ByteFallback's <0xXX>."""
    special = set(special_ids(tok))
    out = []
    for i in range(tok.vocab_size):
        t = tok.backend.id_to_token(i)
        if i not in special and (len(t) == 1 or (len(t) == 6 and t.startswith("<0x"))):
            out.append(i)
    return out


def reference(tok: TextTokenizer, prompt: list[int], gen: list[int], skip: bool) -> str:
    """What the generated ids add to the prompt's decode (decode(gen) for an empty prompt)."""
    if not prompt:
        return tok.decode(gen, skip_special_tokens=skip)
    head = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + gen, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]


def stream(tok, prompt, gen, cuts, skip=True) -> list[str]:
    """Deltas of pushing gen split at `cuts`, then flush() as the last element."""
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    bounds = [0, *sorted(cuts), len(gen)]
    out = [d.push(gen[a:b]) for a, b in zip(bounds, bounds[1:])]
    return [*out, d.flush()]


def random_cuts(rng: random.Random, n: int) -> list[int]:
    return rng.sample(range(1, n), rng.randint(0, n - 1)) if n > 1 else []


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("prompt_text", PROMPTS)
@pytest.mark.parametrize("text", TEXTS, ids=lambda t: t[:12])
def test_text_token_by_token(toks, name, prompt_text, text):
    tok = toks[name]
    prompt, gen = tok.encode(prompt_text), tok.encode(text)
    out = stream(tok, prompt, gen, range(1, len(gen)))
    want = reference(tok, prompt, gen, True)
    assert "".join(out) == want
    if "\ufffd" not in want:  # valid text: never a replacement character, mid-stream or at flush
        assert not any("\ufffd" in s for s in out)
    assert "".join(out[:-1])  # text streams out before the end
    if name == "smollm2":  # byte-level BPE: the generated ids alone are the exact reference
        assert want == tok.decode(gen, skip_special_tokens=True)
        assert out[-1] == ""  # valid text ends on a complete character: nothing held


@pytest.mark.parametrize("name", NAMES)
def test_text_random_splits(toks, name):
    tok, rng = toks[name], random.Random(1)
    for text in TEXTS:
        for prompt_text in PROMPTS:
            prompt, gen = tok.encode(prompt_text), tok.encode(text)
            want = reference(tok, prompt, gen, True)
            for _ in range(10):
                out = stream(tok, prompt, gen, random_cuts(rng, len(gen)))
                assert "".join(out) == want
                assert "\ufffd" not in "".join(out) or "\ufffd" in want


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_random_id_streams(toks, name, skip):
    """Arbitrary valid ids, rich in single bytes (invalid UTF-8) and special tokens."""
    tok, rng = toks[name], random.Random(NAMES.index(name) * 2 + skip)
    singles, special = byte_ids(tok) or list(range(tok.vocab_size)), special_ids(tok)
    prompts = [[], tok.encode("Tell me a story."), tok.encode("story") + special[-1:]]
    for trial in range(150):
        gen = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            pool = singles if r < 0.5 else special if r < 0.65 else range(tok.vocab_size)
            gen.append(rng.choice(pool))
        prompt = prompts[trial % len(prompts)]
        want = reference(tok, prompt, gen, skip)
        if name == "smollm2":
            assert want == tok.decode(gen, skip_special_tokens=skip)
        for _ in range(3):
            assert "".join(stream(tok, prompt, gen, random_cuts(rng, len(gen)), skip)) == want


def test_special_tokens_skipped_or_kept(toks):
    tok = toks["smollm2"]
    end = tok.backend.token_to_id("<|im_end|>")
    gen = tok.encode("Hi") + [end] + tok.encode(" there 😀")
    assert "".join(stream(tok, [], gen, range(1, len(gen)), skip=True)) == "Hi there 😀"
    kept = stream(tok, [], gen, range(1, len(gen)), skip=False)
    assert "".join(kept) == "Hi<|im_end|> there 😀"
    # a special token between the bytes of one character: skipped, the bytes still join
    emoji = tok.encode("😀")
    assert "".join(stream(tok, [], [emoji[0], end, *emoji[1:]], [1, 2])) == "😀"
    split = stream(tok, [], [emoji[0], end, *emoji[1:]], [1, 2], skip=False)
    assert (
        "".join(split) == tok.decode([emoji[0], end, *emoji[1:]]) == "\ufffd<|im_end|>\ufffd\ufffd"
    )


def test_partial_character_held_back(toks):
    tok = toks["smollm2"]
    ids = tok.encode("a😀b")
    d = IncrementalDetokenizer(tok, [])
    deltas = [d.push([i]) for i in ids]
    assert deltas[0] == "a" and "".join(deltas) + d.flush() == "a😀b"
    assert all("\ufffd" not in s for s in deltas)
    # the stream ends inside a character: flush() gives what the full decode gives
    d = IncrementalDetokenizer(tok, [])
    assert d.push(ids[:1]) == "a" and d.push(ids[1:3]) == ""
    assert d.flush() == tok.decode(ids[1:3]) == "\ufffd"
    # a batch ending inside a character holds all of its text (the window is whole tokens)
    d = IncrementalDetokenizer(tok, [])
    assert d.push(ids[:2]) == "" and d.push(ids[2:4]) == "a😀"


def test_prompt_ending_mid_character(toks):
    """Bytes the prompt leaves incomplete do not merge with generated bytes."""
    tok = toks["smollm2"]
    emoji = tok.encode("😀")
    out = stream(tok, tok.encode("x") + emoji[:2], emoji[2:], [])
    assert "".join(out) == tok.decode(emoji[2:]) == "\ufffd"


@pytest.mark.parametrize("name", ["llama", "metaspace"])
def test_leading_space_continues_prompt(toks, name):
    tok = toks[name]
    gen = tok.encode("world")
    assert tok.decode(gen) == "world"
    assert "".join(stream(tok, [], gen, [])) == "world"  # no prompt: as decode(gen)
    assert "".join(stream(tok, tok.encode("hello"), gen, [])) == " world"
    eos = tok.backend.token_to_id("</s>")
    assert "".join(stream(tok, tok.encode("hello") + [eos], gen, [])) == " world"


@pytest.mark.parametrize("name", ["llama", "metaspace"])
def test_byte_fallback_run_invalidated_late(toks, name):
    """E2 82 AC is "€", but a following 80 makes the whole run four U+FFFDs: hold the run."""
    tok = toks[name]
    b = [tok.backend.token_to_id(f"<0x{x:02X}>") for x in (0xE2, 0x82, 0xAC, 0x80)]
    d = IncrementalDetokenizer(tok, tok.encode("hello"))
    assert [d.push([i]) for i in b] == ["", "", "", ""]
    assert d.push(tok.encode("world")) + d.flush() == "\ufffd" * 4 + " world"
    # a skipped special token does not end a run: the bytes still join
    eos = tok.backend.token_to_id("</s>")
    assert "".join(stream(tok, [], [b[0], eos, b[1], b[2]], [1, 2, 3])) == "€"


@pytest.mark.parametrize(("name", "bound"), [("smollm2", 8), ("llama", 32), ("metaspace", 32)])
def test_window_stays_small(toks, name, bound):
    """Bounded by the longest incomplete character or byte-fallback run (the ZWJ family)."""
    tok = toks[name]
    gen = tok.encode(" ".join(TEXTS) * 20)
    d = IncrementalDetokenizer(tok, tok.encode("Tell me a story."))
    out, widest = [], 0
    for i in gen:
        out.append(d.push([i]))
        widest = max(widest, len(d._ids))  # the decode window, what each push costs
    assert "".join(out) + d.flush() == reference(tok, tok.encode("Tell me a story."), gen, True)
    assert widest <= bound


def test_bad_ids_and_push_after_flush(toks):
    tok = toks["smollm2"]
    d = IncrementalDetokenizer(tok, [])
    with pytest.raises(ValueError, match="49152"):
        d.push([49152])
    with pytest.raises(ValueError, match="-1"):
        d.push([-1])
    assert d.push([]) == "" and d.flush() == ""
    with pytest.raises(RuntimeError, match="after flush"):
        d.push([1])


def test_a_models_padding_ids_have_no_text(toks):
    """A model with more ids than its tokenizer (Qwen3: 151,936 against ~151,669) can sample
    a padding id, at a high temperature: it adds no text, as in transformers' decode, and
    the stream goes on; an id past the model's vocabulary is still an error."""
    tok = toks["smollm2"]
    gen = tok.encode(" Hello world")
    d = IncrementalDetokenizer(tok, [], vocab_size=tok.vocab_size + 64)
    out = d.push(gen[:1]) + d.push([tok.vocab_size + 3]) + d.push(gen[1:]) + d.flush()
    assert out == tok.decode(gen, skip_special_tokens=True)
    with pytest.raises(ValueError, match=str(tok.vocab_size + 63)):
        IncrementalDetokenizer(tok, [], vocab_size=tok.vocab_size + 64).push([tok.vocab_size + 64])
