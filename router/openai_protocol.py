"""OpenAI API shapes: request validation, response models and OpenAI-shaped errors.

Requests are parsed strictly (``"10"`` is not a number, ``true`` is not a token id) and every failure becomes
an ``OpenAIError`` with the status the OpenAI API would use and the offending parameter in ``param``.
Every parameter of the OpenAI, vLLM and SGLang request shapes is implemented or, set to anything but its
neutral value, refused with a 400 naming it (``REFUSED``); other unknown fields are ignored as OpenAI does.

Structured output: ``response_format`` (json_object / json_schema), SGLang's ``regex`` / ``json_schema`` /
``ebnf`` and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_grammar`` / ``guided_choice``, at most one
per request; it becomes ``Constraint`` (kind, spec), compiled by the decode service (xgrammar).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # engine.sampling.MAX_LOGPROBS (the router never imports the engine's torch modules)
# Known parameters this server does not implement: refused (400 naming them) when set to anything but the value
# in the tuple; the text says what to do instead.
REFUSED: dict[str, tuple[Any, str]] = {
    "suffix": (None, "suffix (insertion) is not supported by this server"),
    "use_beam_search": (False, "beam search is not supported by this server"),
    "length_penalty": (1.0, "length_penalty (beam search) is not supported by this server"),
    "bad_words": (None, "bad_words is not supported by this server (use logit_bias with -100)"),
    "allowed_token_ids": (None, "allowed_token_ids is not supported by this server (use logit_bias or regex)"),
    "truncate_prompt_tokens": (None, "truncate_prompt_tokens is not supported by this server"),
    "prompt_logprobs": (None, "prompt_logprobs is not supported by this server (use echo with logprobs)"),
    "return_tokens_as_token_ids": (False, "return_tokens_as_token_ids is not supported (use return_token_ids)"),
    "spaces_between_special_tokens": (True, "spaces_between_special_tokens=false is not supported by this server"),
    "guided_whitespace_pattern": (None, "guided_whitespace_pattern is not supported by this server"),
    "guided_decoding_backend": (None, "guided_decoding_backend cannot be chosen: this server uses xgrammar"),
    "structural_tag": (None, "structural_tag is not supported by this server"),
    "priority": (0, "request priorities are not supported by this server"),
    "functions": (None, "functions (the deprecated API) is not supported by this server (use tools)"),
    "function_call": (None, "function_call (the deprecated API) is not supported by this server (use tools)"),
    "audio": (None, "audio output is not supported by this server"),
    "modalities": (None, "modalities other than text are not supported by this server"),
    "prediction": (None, "predicted outputs are not supported by this server"),
    "store": (False, "store is not supported by this server"),
    "service_tier": (None, "service_tier is not supported by this server"),
    "reasoning_effort": (None, "reasoning_effort is not supported by this server"),
    "web_search_options": (None, "web search is not supported by this server"),
    "continue_final_message": (False, "continue_final_message is not supported by this server"),
    "chat_template": (None, "a per-request chat_template is not supported by this server"),
    "chat_template_kwargs": (None, "chat_template_kwargs is not supported by this server"),
    "documents": (None, "documents are not supported by this server"),
    "mm_processor_kwargs": (None, "multimodal inputs are not supported by this server"),
    "lora_request": (None, "LoRA adapters are not supported by this server"),
}
INT32_MAX = (1 << 31) - 1  # the proto's integer sampling fields are int32: larger values are a 400, not a 500
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error"}


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else
                                                         "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------------------------- requests


class _Request(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    regex: str | None = None  # SGLang
    ebnf: str | None = None  # SGLang
    json_schema: str | dict[str, Any] | None = None  # SGLang: the schema (text or object)
    guided_json: str | dict[str, Any] | None = None  # vLLM
    guided_regex: str | None = None  # vLLM
    guided_grammar: str | None = None  # vLLM
    guided_choice: list[str] | None = None  # vLLM: one of these strings exactly

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", mode="before")
    @classmethod
    def _int_is_a_number(cls, value: Any) -> Any:
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or int(key) > INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids (got {key[:40]!r})")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100] (got {bias} for token {key})")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def unsupported(self) -> OpenAIError | None:
        """The first parameter set to something the server cannot do, as a 400."""
        extra = self.model_extra or {}
        for name, (neutral, why) in REFUSED.items():
            if name in extra and extra[name] != neutral and not (neutral in (False, 0) and extra[name] is None):
                return bad_request(f"{why} (got {name}={str(extra[name])[:60]})", name)
        if self.stream_options is not None and not self.stream:
            return bad_request("stream_options is only allowed with stream=true", "stream_options")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            return bad_request(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                               "min_tokens")
        try:
            self.constraint()
        except OpenAIError as err:
            return err
        return None

    def constraint(self) -> Constraint | None:
        """The structured-output constraint of the request (None: unconstrained); 400 when two are given or
        one is malformed."""
        found: list[tuple[str, Constraint]] = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                found.append(("response_format", Constraint("json_object", "")))
            elif kind == "json_schema":
                js = fmt.get("json_schema")
                schema = js.get("schema", js.get("schema_")) if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                                      "response_format")
                found.append(("response_format", Constraint("json_schema", json.dumps(schema))))
            elif kind != "text":
                raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema' (got "
                                  f"{str(kind)[:40]!r})", "response_format")
        for name, kind in (("regex", "regex"), ("guided_regex", "regex"), ("ebnf", "ebnf"),
                           ("guided_grammar", "ebnf"), ("json_schema", "json_schema"), ("guided_json", "json_schema")):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, dict):
                value = json.dumps(value)
            if not value:
                raise bad_request(f"{name} must not be empty", name)
            found.append((name, Constraint(kind, value)))
        if self.guided_choice is not None:
            if not self.guided_choice or any(not c for c in self.guided_choice):
                raise bad_request("guided_choice must be a non-empty list of non-empty strings", "guided_choice")
            found.append(("guided_choice", Constraint("regex", "|".join(f"({re.escape(c)})"
                                                                        for c in self.guided_choice))))
        if len(found) > 1:
            raise bad_request(f"at most one structured-output constraint per request (got {found[0][0]} and "
                              f"{found[1][0]})", found[1][0])
        return found[0][1] if found else None


@dataclass(frozen=True)
class Constraint:
    """Structured output as the proto's StructuredOutput carries it."""

    kind: str  # "json_schema" | "json_object" | "regex" | "ebnf"
    spec: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class CompletionRequest(_Request):
    """POST /v1/completions. ``prompt``: a string, strings, token ids, or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS etc. on a text prompt
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo: score the prompt
    # vLLM extension: choices also carry the generated ``token_ids`` (streamed: each chunk's new ids) and the
    # ``prompt_token_ids`` (streamed: in the choice's first chunk).
    return_token_ids: bool = False

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: Any) -> Any:
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of "
                             "lists of token ids") from None
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, list) and not p for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    def unsupported(self) -> OpenAIError | None:
        if self.max_tokens == 0 and not self.echo:
            return bad_request("max_tokens: 0 is allowed only with echo=true (scoring the prompt); otherwise it "
                               "must be >= 1", "max_tokens")
        if self.best_of is not None and self.best_of != self.n:
            return bad_request("best_of is not supported by this server (leave it unset or equal to n)", "best_of")
        return super().unsupported()

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: strings to tokenize or token id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; extra keys (tool_calls, tool_call_id, name ...) are passed to the chat template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (text parts joined, content "" when absent)."""
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content part type {part.type!r} is not supported (text only)", "messages")
            content = "\n".join(part.text for part in content)  # type: ignore[misc]
        out = dict(self.model_extra or {})
        out.update(role=self.role, content=content if content is not None else "")
        return out


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # tool calls come back as text: nothing to parallelise
    add_generation_prompt: bool = True
    return_token_ids: bool = False
    echo: bool = False  # vLLM: the last message's content before the reply (refused)

    def unsupported(self) -> OpenAIError | None:
        if self.return_token_ids:
            return bad_request("return_token_ids is supported on /v1/completions only (send the prompt as "
                               "token ids there)", "return_token_ids")
        if self.top_logprobs is not None and not self.logprobs:
            return bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.echo:
            return bad_request("echo is not supported on /v1/chat/completions by this server", "echo")
        if self.tool_choice not in (None, "none", "auto"):
            return bad_request("tool_choice other than 'none' or 'auto' is not supported by this server "
                               "(tool calls are returned as plain text)", "tool_choice")
        return super().unsupported()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


@dataclass(frozen=True)
class SamplingOptions:
    """The validated generation parameters of one request (the same for its n choices but the seed)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-N alternatives with each generated token
    prompt_logprobs: int | None = None  # echo + logprobs: the prompt's
    constraint: Constraint | None = None
    drop_output: bool = False  # max_tokens 0 with echo: the one token the worker generates is not returned

    @property
    def runs_locally(self) -> bool:
        """Whether the decode worker must run the prompt itself (it needs the prompt's logits)."""
        return self.logprobs is not None or self.prompt_logprobs is not None or self.constraint is not None


def parse_request(model_cls: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body into ``model_cls``; every failure is a 400 naming the parameter."""
    try:
        req = model_cls.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] in ("json_invalid", "json_type"):
            raise bad_request(f"request body is not valid JSON: {err['msg']}") from None
        loc = [str(x) for x in err["loc"]]
        if not loc and err["type"] == "model_type":
            raise bad_request("request body must be a JSON object") from None
        param = loc[0] if loc else None
        msg = err["msg"].removeprefix("Value error, ")
        where = ".".join(loc)
        raise bad_request(f"{where}: {msg}" if where else msg, param) from None
    problem = req.unsupported() if isinstance(req, _Request) else None
    if problem is not None:
        raise problem
    return req


# --------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    """The legacy completions shape; the prompt's first token (echo) has no logprob (None)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop token id that ended it (None: EOS)
    token_ids: list[int] | None = None  # only with return_token_ids (absent from the JSON otherwise)
    prompt_token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_token_ids(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("token_ids", "prompt_token_ids"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nvfp4-serve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
