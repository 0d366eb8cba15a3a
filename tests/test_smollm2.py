"""Real weights: SmolLM2-135M GGUF against transformers' tokenizer, template and greedy tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megaserve.offline import OfflineGenerator
from megaserve.sampling_params import SamplingParams
from tests.conftest import FIXTURES
from tests.parity import cli_generate_json, rel_err

REF = json.loads((FIXTURES / "smollm2_reference.json").read_text())


@pytest.fixture(scope="module")
def gen(smollm2):
    return OfflineGenerator(smollm2, max_context=1024)


@pytest.mark.parametrize("case", REF["tokenizer_cases"], ids=lambda c: repr(c["text"])[:30])
def test_tokenizer_matches_transformers(smollm2, case):
    tok = smollm2.tokenizer
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.decode(case["ids"]) == case["decoded"]
    assert tok.decode(case["ids"], skip_special_tokens=True) == case["decoded_skip_special"]


@pytest.mark.parametrize("case", REF["chat_template_cases"], ids=lambda c: str(len(c["messages"])))
def test_chat_template_matches_transformers(smollm2, case):
    tok = smollm2.tokenizer
    assert tok.render_chat(case["messages"], True) == case["rendered_add_generation_prompt"]
    assert tok.render_chat(case["messages"], False) == case["rendered_no_generation_prompt"]
    assert tok.encode_chat(case["messages"]) == case["ids_add_generation_prompt"]


def test_special_tokens(smollm2):
    s = REF["special"]
    assert smollm2.eos_token_ids == (s["eos_token_id"],)
    assert smollm2.tokenizer.vocab_size == s["len_tokenizer"]
    assert smollm2.tokenizer.bos_token == s["bos_token"]


def test_last_logits_match_transformers(smollm2, gen):
    logits = np.load(FIXTURES / "smollm2_last_logits.npy")
    for case, ref in zip(REF["cases"], logits):
        assert smollm2.tokenizer.encode_chat(case["messages"]) == case["prompt_ids"]
        _, got = gen.prefill(case["prompt_ids"], SamplingParams())
        assert rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("i", range(len(REF["cases"])))
def test_greedy_64_tokens_match_transformers(gen, i):
    case = REF["cases"][i]
    got = gen.generate(case["prompt_ids"], 64, ignore_eos=True).token_ids
    assert got == case["greedy_ids_ignore_eos"]
    stopped = gen.generate(case["prompt_ids"], 64).token_ids
    assert stopped == case["greedy_ids"]


def test_cli_chat_answer_says_paris():
    out = cli_generate_json(
        "--checkpoint",
        "smollm2",
        "--chat",
        "What is the capital of France?",
        "--temperature",
        "0",
        "--max-new-tokens",
        "64",
    )
    france = REF["cases"][0]
    assert out["token_ids"] == france["greedy_ids"]
    assert "Paris" in out["text"] and out["text"] == france["greedy_text_skip_special"]


def test_plain_prompt(gen):
    case = REF["plain_case"]
    got = gen.generate(case["prompt_ids"], 64, ignore_eos=True).token_ids
    assert got == case["greedy_ids_ignore_eos"]
