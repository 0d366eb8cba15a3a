"""tokenizer.json + tokenizer_config.json (+ chat_template.jinja) as transformers reads them."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models, pre_tokenizers, processors

from megaserve.tokenizer import TextTokenizer


def _write(d, with_jinja: bool):
    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(d / "tokenizer.json"))
    conf = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>"},
        "chat_template": "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    if with_jinja:
        (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{{ eos_token }}")


def test_post_processor_and_template(tmp_path):
    _write(tmp_path, with_jinja=False)
    t = TextTokenizer.from_hf_dir(tmp_path)
    assert t.encode("hello world") == [2, 3]
    assert t.encode("hello world", add_special_tokens=True) == [0, 2, 3]  # post-processor BOS
    assert t.render_chat([{"role": "user", "content": "hello"}]) == "<s>hello"
    assert t.encode_chat([{"role": "user", "content": "hello"}]) == [0, 2]
    assert t.eos_token == "</s>"


def test_chat_template_jinja_file_wins(tmp_path):
    """transformers 5 saves the template as chat_template.jinja beside the config."""
    _write(tmp_path, with_jinja=True)
    t = TextTokenizer.from_hf_dir(tmp_path)
    assert t.render_chat([{"role": "user", "content": "world"}]) == "world</s>"
