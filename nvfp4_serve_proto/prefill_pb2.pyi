from nvfp4_serve_proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "prefix_len", "sampling", "expected_layout", "transfer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_len: int
    sampling: _common_pb2.SamplingParams
    expected_layout: _common_pb2.KVLayout
    transfer: TransferOffer
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., prefix_len: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., expected_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., transfer: _Optional[_Union[TransferOffer, _Mapping]] = ...) -> None: ...

class TransferOffer(_message.Message):
    __slots__ = ("endpoint", "ipc_share_id", "grpc_lanes", "refs_all_layers")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    IPC_SHARE_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_LANES_FIELD_NUMBER: _ClassVar[int]
    REFS_ALL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    endpoint: _common_pb2.TransferEndpoint
    ipc_share_id: str
    grpc_lanes: int
    refs_all_layers: bool
    def __init__(self, endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., ipc_share_id: _Optional[str] = ..., grpc_lanes: _Optional[int] = ..., refs_all_layers: _Optional[bool] = ...) -> None: ...

class PrefillMessage(_message.Message):
    __slots__ = ("request_id", "header", "pages", "done", "page_refs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PAGE_REFS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    header: TransferHeader
    pages: KVPageRun
    done: PrefillDone
    page_refs: KVPageRefs
    def __init__(self, request_id: _Optional[str] = ..., header: _Optional[_Union[TransferHeader, _Mapping]] = ..., pages: _Optional[_Union[KVPageRun, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ..., page_refs: _Optional[_Union[KVPageRefs, _Mapping]] = ...) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("layout", "num_tokens", "prefix_len", "first_page", "num_pages", "path", "endpoint", "share_id", "transfer_id", "hold_timeout_s", "lanes")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SHARE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.KVLayout
    num_tokens: int
    prefix_len: int
    first_page: int
    num_pages: int
    path: str
    endpoint: _common_pb2.TransferEndpoint
    share_id: str
    transfer_id: str
    hold_timeout_s: float
    lanes: int
    def __init__(self, layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., prefix_len: _Optional[int] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., path: _Optional[str] = ..., endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., share_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., hold_timeout_s: _Optional[float] = ..., lanes: _Optional[int] = ...) -> None: ...

class PrefillLaneRequest(_message.Message):
    __slots__ = ("transfer_id", "lane")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    lane: int
    def __init__(self, transfer_id: _Optional[str] = ..., lane: _Optional[int] = ...) -> None: ...

class KVPageRun(_message.Message):
    __slots__ = ("layer", "first_page", "num_pages", "k", "k_scales", "v", "v_scales", "padding")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    K_SCALES_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    V_SCALES_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first_page: int
    num_pages: int
    k: bytes
    k_scales: bytes
    v: bytes
    v_scales: bytes
    padding: bytes
    def __init__(self, layer: _Optional[int] = ..., first_page: _Optional[int] = ..., num_pages: _Optional[int] = ..., k: _Optional[bytes] = ..., k_scales: _Optional[bytes] = ..., v: _Optional[bytes] = ..., v_scales: _Optional[bytes] = ..., padding: _Optional[bytes] = ...) -> None: ...

class KVPageRefs(_message.Message):
    __slots__ = ("layer", "first_page", "src_page_ids", "num_layers")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first_page: int
    src_page_ids: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    def __init__(self, layer: _Optional[int] = ..., first_page: _Optional[int] = ..., src_page_ids: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ...) -> None: ...

class KVShareRequest(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: _common_pb2.TransferEndpoint
    def __init__(self, endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ...) -> None: ...

class KVShare(_message.Message):
    __slots__ = ("endpoint", "share_id", "layout", "num_pages", "tensors", "error", "nixl_metadata", "nixl_agent", "nixl_mem_type", "nixl_device_id")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SHARE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_FIELD_NUMBER: _ClassVar[int]
    NIXL_MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    NIXL_DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    endpoint: _common_pb2.TransferEndpoint
    share_id: str
    layout: _common_pb2.KVLayout
    num_pages: int
    tensors: _containers.RepeatedCompositeFieldContainer[SharedTensor]
    error: str
    nixl_metadata: bytes
    nixl_agent: str
    nixl_mem_type: str
    nixl_device_id: int
    def __init__(self, endpoint: _Optional[_Union[_common_pb2.TransferEndpoint, _Mapping]] = ..., share_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., num_pages: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[SharedTensor, _Mapping]]] = ..., error: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ..., nixl_agent: _Optional[str] = ..., nixl_mem_type: _Optional[str] = ..., nixl_device_id: _Optional[int] = ...) -> None: ...

class SharedTensor(_message.Message):
    __slots__ = ("layer", "part", "dtype", "shape", "stride", "storage_offset", "ipc_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "address", "num_bytes")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    part: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    storage_offset: int
    ipc_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    address: int
    num_bytes: int
    def __init__(self, layer: _Optional[int] = ..., part: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., storage_offset: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., address: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class ReleaseTransferRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class ReleaseTransferResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token_id", "num_computed_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    num_computed_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...
