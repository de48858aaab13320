"""Tokenizer, chat templates and incremental detokenization (no torch: the router imports this).

Reads a Hugging Face checkpoint directory: ``tokenizer.json`` (the ``tokenizers`` library) plus the
optional ``tokenizer_config.json`` (special tokens, add_bos_token, chat_template),
``chat_template.jinja``, ``generation_config.json`` and ``config.json`` (extra eos ids).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template (a client error)."""


def _token_str(value: Any) -> str | None:
    """Special-token entries are a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja's built-in tojson this does not HTML-escape, as HF chat templates expect.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _flatten_content(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages, joining list-of-parts content into one string (text parts only)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(
                        f"messages[{i}]: only text content parts are supported (got part type {kind!r})"
                    )
                texts.append(part["text"])
            m["content"] = "\n".join(texts)
        out.append(m)
    return out


class Tokenizer:
    """A HF fast tokenizer with its chat template; build with ``Tokenizer.from_dir``."""

    def __init__(
        self, tokenizer: _HFTokenizer, *, name_or_path: str = "", config: Mapping[str, Any] | None = None,
        chat_template: str | dict[str, str] | None = None, extra_eos_ids: Iterable[int] = (),
    ) -> None:
        config = dict(config or {})
        self._tok = tokenizer
        self.name_or_path = name_or_path
        self.special_tokens: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            token = _token_str(config.get(key))
            if token is not None:
                self.special_tokens[key] = token
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_token_id = None if self.bos_token is None else tokenizer.token_to_id(self.bos_token)
        self.eos_token_id = None if self.eos_token is None else tokenizer.token_to_id(self.eos_token)
        # None: the config is silent and tokenizer.json's post-processor decides (as HF does)
        self.add_bos_token: bool | None = config.get("add_bos_token")
        self.add_eos_token: bool | None = config.get("add_eos_token")
        eos = set(extra_eos_ids)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._chat_template = chat_template
        self._compiled: dict[str, jinja2.Template] = {}
        self._max_token_bytes: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``path/tokenizer.json`` and its companion configs."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {path}: expected a Hugging Face fast-tokenizer file "
                f"(convert slow tokenizers with transformers' AutoTokenizer.save_pretrained)"
            )
        config = _read_json(path / "tokenizer_config.json")
        template: str | dict[str, str] | None = config.get("chat_template")
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template if isinstance(t, Mapping)}
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = _read_json(path / "chat_template.json").get("chat_template")
        extra = _int_ids(_read_json(path / "generation_config.json").get("eos_token_id"))
        extra += _int_ids(_read_json(path / "config.json").get("eos_token_id"))
        return cls(_HFTokenizer.from_file(str(tok_file)), name_or_path=str(path), config=config,
                   chat_template=template, extra_eos_ids=extra)

    # -- ids <-> text ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry (added tokens included): a prompt of N bytes has at least
        N / max_token_bytes tokens (byte-level entries count 2 bytes per byte here, so the bound is loose)."""
        if self._max_token_bytes is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max((len(t.encode("utf-8", "replace")) for t in vocab), default=1) or 1
        return self._max_token_bytes

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while the Rust tokenizer runs (encode does not): a long prompt
        # tokenized in a worker thread leaves the caller's event loop running.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with special tokens, BOS/EOS as tokenizer_config.json says.

        Chat prompts rendered by ``apply_chat_template`` already hold their special tokens:
        encode them with ``add_special_tokens=False``.
        """
        if not add_special_tokens:
            return self._encode(text, add_special_tokens=False)
        if self.add_bos_token is None and self.add_eos_token is None:
            return self._encode(text, add_special_tokens=True)
        ids = self._encode(text, add_special_tokens=False)
        if self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat ----------------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template)

    def _template(self, use_tools: bool) -> jinja2.Template:
        source = self._chat_template
        name = "default"
        if isinstance(source, dict):
            name = "tool_use" if use_tools and "tool_use" in source else "default"
            if name not in source:
                raise ChatTemplateError(
                    f"tokenizer in {self.name_or_path} has named chat templates {sorted(source)} but no 'default'"
                )
            source = source[name]
        if not source:
            raise ChatTemplateError(
                f"tokenizer in {self.name_or_path} has no chat template (tokenizer_config.json chat_template or "
                f"chat_template.jinja); use /v1/completions with a raw prompt instead"
            )
        if name not in self._compiled:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._compiled[name] = env.from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"chat template of {self.name_or_path} does not compile: {e}") from e
        return self._compiled[name]

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` (content: a string or a list of ``{"type": "text", "text": ...}`` parts).

        Extra keyword arguments (e.g. ``enable_thinking``) are passed to the template as variables.
        Raises ``ChatTemplateError`` (a ValueError) when the template rejects the messages.
        """
        template = self._template(bool(tools))
        variables: dict[str, Any] = {**self.special_tokens, **template_kwargs}
        variables.setdefault("bos_token", "")
        variables.setdefault("eos_token", "")
        try:
            return template.render(messages=_flatten_content(messages), tools=tools,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render the messages: {e}") from e


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Invariant: ``text[prefix_offset:read_offset]`` ids decode to complete characters that were
    already emitted; a delta is released only when the decoded tail does not end in U+FFFD, so a
    multi-byte character split over tokens is emitted whole. The concatenation of all deltas
    plus ``flush()`` equals ``tokenizer.decode(generated ids)``.
    """

    # Prompt tokens decoded as left context so that decoders which strip a leading space
    # (SentencePiece/Metaspace) see the same context as in a full decode.
    PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self.PROMPT_CONTEXT:]) if prompt_ids else []
        self._num_context = len(self._ids)
        self.prefix_offset = 0
        self.read_offset = len(self._ids)

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Append one generated id; return the newly completed text ('' while a character is partial)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Text held back at the end of the stream (a trailing partial character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self._ids)
        return new_text[len(prefix_text):]
