"""OpenAI API shapes: request validation, response models and OpenAI-shaped errors.

Requests are parsed strictly (``"10"`` is not a number, ``true`` is not a token id) and every failure becomes
an ``OpenAIError`` with the status the OpenAI API would use and the offending parameter in ``param``.
Parameters the engine cannot honour (logprobs, echo, penalties, logit_bias ...) are rejected with a 400 that
says so rather than silently ignored; harmless unknown fields are ignored as the OpenAI API does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

MAX_STOP_STRINGS = 16
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

    model_config = ConfigDict(strict=True, extra="ignore")

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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

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
        """The first parameter set to something the engine cannot do, as a 400."""
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                return bad_request(f"{name} is not supported by this server (leave it unset or {neutral})", name)
        if self.logit_bias:
            return bad_request("logit_bias is not supported by this server", "logit_bias")
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class CompletionRequest(_Request):
    """POST /v1/completions. ``prompt``: a string, strings, token ids, or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None
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
        if self.echo:
            return bad_request("echo is not supported by this server", "echo")
        if self.suffix:
            return bad_request("suffix is not supported by this server", "suffix")
        if self.logprobs is not None:
            return bad_request("logprobs are not supported by this server", "logprobs")
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
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    return_token_ids: bool = False

    def unsupported(self) -> OpenAIError | None:
        if self.return_token_ids:
            return bad_request("return_token_ids is supported on /v1/completions only (send the prompt as "
                               "token ids there)", "return_token_ids")
        if self.logprobs or self.top_logprobs is not None:
            return bad_request("logprobs are not supported by this server", "logprobs")
        if self.tool_choice not in (None, "none", "auto"):
            return bad_request("tool_choice other than 'none' or 'auto' is not supported by this server "
                               "(tool calls are returned as plain text)", "tool_choice")
        if self.response_format and self.response_format.get("type", "text") != "text":
            return bad_request("response_format other than text is not supported by this server",
                               "response_format")
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


def parse_request(model_cls: type[_Request], body: bytes) -> Any:
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
    problem = req.unsupported()
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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
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
    logprobs: None = None
    finish_reason: str | None = None


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
    logprobs: None = None
    finish_reason: str | None = None


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
