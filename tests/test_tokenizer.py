"""Tokenizer: encode/decode, special tokens, chat templates, incremental detokenization."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from offline.tiny_model import make_tiny_model
from tokenization.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

MULTIBYTE = "naïve café — 日本語の文 and emoji 🙂🚀 done"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tok") / "m")


@pytest.fixture
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _with_config(model_dir: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the tokenizer files with tokenizer_config.json entries changed (None deletes)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_encode_decode_round_trip(tok):
    ids = tok.encode(MULTIBYTE)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == MULTIBYTE
    assert tok.encode(MULTIBYTE, add_special_tokens=False) == ids  # add_bos_token is false
    assert tok.vocab_size == 512 and tok.name_or_path.endswith("m")


def test_special_tokens_and_eos_ids(tok):
    assert [tok.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.eos_token_ids == frozenset({0, 2})  # tokenizer_config eos + generation_config list
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_bos_is_added_only_when_the_config_says_so(model_dir, tmp_path):
    tok = Tokenizer.from_dir(_with_config(model_dir, tmp_path, add_bos_token=True, bos_token="<|endoftext|>"))
    assert tok.encode("hello")[0] == 0
    assert tok.encode("hello", add_special_tokens=False) == tok.encode("hello")[1:]


def test_chat_template_renders_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages[:1], add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
    )


def test_chat_template_renders_tools_as_unescaped_json(tok):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "a <b> & ü"}}]
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=tools)
    assert '"description": "a <b> & ü"' in text and text.startswith("<|im_start|>system\n# Tools")


def test_non_text_content_parts_are_rejected(tok):
    with pytest.raises(ChatTemplateError, match="only text content parts"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_template_helpers_and_variables(model_dir, tmp_path):
    template = (
        "{{ bos_token }}{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}"
        "{% endif %}{% for m in messages %}[{{ m.content }}]{% endfor %}|{{ strftime_now('%Y') | length }}"
        "|{{ enable_thinking }}{% if add_generation_prompt %}>{% endif %}"
    )
    tok = Tokenizer.from_dir(_with_config(model_dir, tmp_path, chat_template=template, bos_token="<|endoftext|>"))
    assert tok.apply_chat_template([{"role": "user", "content": "a"}], enable_thinking=False) == (
        "<|endoftext|>[a]|4|False>"
    )
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "a"}])


def test_named_templates_pick_tool_use_when_tools_are_given(model_dir, tmp_path):
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools:{{ tools|length }}"}]
    tok = Tokenizer.from_dir(_with_config(model_dir, tmp_path, chat_template=named))
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "plain"
    assert tok.apply_chat_template([{"role": "user", "content": "a"}], tools=[{"x": 1}]) == "tools:1"


def test_chat_template_file_fallback_and_missing_template(model_dir, tmp_path):
    path = _with_config(model_dir, tmp_path, chat_template=None)
    tok = Tokenizer.from_dir(path)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "z"}]) == "z"


def test_missing_tokenizer_json_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json in {tmp_path}"):
        Tokenizer.from_dir(tmp_path)


def test_incremental_detokenizer_never_emits_partial_characters(tok):
    ids = tok.encode(MULTIBYTE)
    # the tiny BPE splits multi-byte characters over several byte tokens
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in ids]
    assert "" in deltas and not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == MULTIBYTE
    assert detok.output_ids == ids


def test_incremental_detokenizer_with_prompt_and_special_tokens(tok):
    prompt = tok.encode("<|im_start|>user\nschön<|im_end|>\n<|im_start|>assistant\n")
    generated = tok.encode("Grüße 🙂 aus Zürich<|im_end|>")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.push(i) for i in generated) + detok.flush()
    assert text == tok.decode(generated) == "Grüße 🙂 aus Zürich"
    raw = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=False)
    assert "".join(raw.push(i) for i in generated) + raw.flush() == "Grüße 🙂 aus Zürich<|im_end|>"


def test_flush_releases_a_trailing_partial_character(tok):
    ids = tok.encode("ok 🙂")
    cut = next(i for i in range(len(ids), 0, -1) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push(i) for i in ids[:cut])
    assert not text.endswith("\ufffd")
    assert text + detok.flush() == tok.decode(ids[:cut])


def test_tokenizer_module_does_not_import_torch():
    code = "import sys, tokenization.tokenizer; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
