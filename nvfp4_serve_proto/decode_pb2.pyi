from nvfp4_serve_proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "prefill_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prefill_address: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "prompt_tokens", "cached_tokens", "finish_reason", "completion_tokens", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: FinishReason
    completion_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., completion_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("num_pages_freed", "flushed")
    NUM_PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    num_pages_freed: int
    flushed: bool
    def __init__(self, num_pages_freed: _Optional[int] = ..., flushed: _Optional[bool] = ...) -> None: ...

class CheckIntegrityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IntegrityReport(_message.Message):
    __slots__ = ("ok", "message", "num_total", "num_free", "num_cached", "num_in_use")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_USE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    num_total: int
    num_free: int
    num_cached: int
    num_in_use: int
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ..., num_total: _Optional[int] = ..., num_free: _Optional[int] = ..., num_cached: _Optional[int] = ..., num_in_use: _Optional[int] = ...) -> None: ...
