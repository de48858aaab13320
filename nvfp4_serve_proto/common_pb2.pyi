from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop_token_ids", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("kv_dtype", "page_size", "num_layers", "num_kv_heads", "head_dim", "k_scales", "v_scales", "model_fingerprint")
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    K_SCALES_FIELD_NUMBER: _ClassVar[int]
    V_SCALES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    kv_dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    k_scales: _containers.RepeatedScalarFieldContainer[float]
    v_scales: _containers.RepeatedScalarFieldContainer[float]
    model_fingerprint: str
    def __init__(self, kv_dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., k_scales: _Optional[_Iterable[float]] = ..., v_scales: _Optional[_Iterable[float]] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class TransferEndpoint(_message.Message):
    __slots__ = ("hostname", "boot_id", "device", "kv_transfer")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    boot_id: str
    device: str
    kv_transfer: str
    def __init__(self, hostname: _Optional[str] = ..., boot_id: _Optional[str] = ..., device: _Optional[str] = ..., kv_transfer: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("role", "num_running", "num_waiting", "outstanding_tokens", "pool_pages_total", "pool_pages_free", "pool_pages_cached", "pool_pages_in_use", "page_size", "max_total_tokens", "layout", "model_path")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    role: str
    num_running: int
    num_waiting: int
    outstanding_tokens: int
    pool_pages_total: int
    pool_pages_free: int
    pool_pages_cached: int
    pool_pages_in_use: int
    page_size: int
    max_total_tokens: int
    layout: KVLayout
    model_path: str
    def __init__(self, role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., pool_pages_total: _Optional[int] = ..., pool_pages_free: _Optional[int] = ..., pool_pages_cached: _Optional[int] = ..., pool_pages_in_use: _Optional[int] = ..., page_size: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., model_path: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsResponse(_message.Message):
    __slots__ = ("prometheus_text",)
    PROMETHEUS_TEXT_FIELD_NUMBER: _ClassVar[int]
    prometheus_text: str
    def __init__(self, prometheus_text: _Optional[str] = ...) -> None: ...
