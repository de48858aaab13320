from nvfp4_serve_proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "prefix_len", "sampling", "expected_layout")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_len: int
    sampling: _common_pb2.SamplingParams
    expected_layout: _common_pb2.KVLayout
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prefix_len: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., expected_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ...) -> None: ...

class PrefillMessage(_message.Message):
    __slots__ = ("request_id", "header", "pages", "done")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    header: TransferHeader
    pages: KVPageRun
    done: PrefillDone
    def __init__(self, request_id: _Optional[str] = ..., header: _Optional[_Union[TransferHeader, _Mapping]] = ..., pages: _Optional[_Union[KVPageRun, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("layout", "num_tokens", "prefix_len", "first_page", "num_pages")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.KVLayout
    num_tokens: int
    prefix_len: int
    first_page: int
    num_pages: int
    def __init__(self, layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., prefix_len: _Optional[int] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ...) -> None: ...

class KVPageRun(_message.Message):
    __slots__ = ("layer", "first_page", "num_pages", "k", "k_scales", "v", "v_scales")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    K_SCALES_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    V_SCALES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first_page: int
    num_pages: int
    k: bytes
    k_scales: bytes
    v: bytes
    v_scales: bytes
    def __init__(self, layer: _Optional[int] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., k: _Optional[bytes] = ..., k_scales: _Optional[bytes] = ..., v: _Optional[bytes] = ..., v_scales: _Optional[bytes] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token_id", "num_computed_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    num_computed_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...
