from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "prompt_logprobs", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    logprobs: int
    prompt_logprobs: int
    structured: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("kv_dtype", "page_size", "num_layers", "num_kv_heads", "head_dim", "k_scales", "v_scales", "model_fingerprint", "kv_rotation")
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    K_SCALES_FIELD_NUMBER: _ClassVar[int]
    V_SCALES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_ROTATION_FIELD_NUMBER: _ClassVar[int]
    kv_dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    k_scales: _containers.RepeatedScalarFieldContainer[float]
    v_scales: _containers.RepeatedScalarFieldContainer[float]
    model_fingerprint: str
    kv_rotation: str
    def __init__(self, kv_dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., k_scales: _Optional[_Iterable[float]] = ..., v_scales: _Optional[_Iterable[float]] = ..., model_fingerprint: _Optional[str] = ..., kv_rotation: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("role", "num_running", "num_waiting", "outstanding_tokens", "pool_pages_total", "pool_pages_free", "pool_pages_cached", "pool_pages_in_use", "page_size", "max_total_tokens", "layout", "model_path", "host_cache", "attention_backend", "decode_kernel")
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
    HOST_CACHE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DECODE_KERNEL_FIELD_NUMBER: _ClassVar[int]
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
    host_cache: HostCacheStats
    attention_backend: str
    decode_kernel: str
    def __init__(self, role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ..., pool_pages_total: _Optional[int] = ..., pool_pages_free: _Optional[int] = ..., pool_pages_cached: _Optional[int] = ..., pool_pages_in_use: _Optional[int] = ..., page_size: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., model_path: _Optional[str] = ..., host_cache: _Optional[_Union[HostCacheStats, _Mapping]] = ..., attention_backend: _Optional[str] = ..., decode_kernel: _Optional[str] = ...) -> None: ...

class HostCacheStats(_message.Message):
    __slots__ = ("num_pages", "num_used_pages", "max_tokens", "total_bytes", "hit_tokens", "num_loads", "num_stores", "load_bytes", "store_bytes", "load_gbps", "store_gbps", "copy_path")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORES_FIELD_NUMBER: _ClassVar[int]
    LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_GBPS_FIELD_NUMBER: _ClassVar[int]
    STORE_GBPS_FIELD_NUMBER: _ClassVar[int]
    COPY_PATH_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    num_used_pages: int
    max_tokens: int
    total_bytes: int
    hit_tokens: int
    num_loads: int
    num_stores: int
    load_bytes: int
    store_bytes: int
    load_gbps: float
    store_gbps: float
    copy_path: str
    def __init__(self, num_pages: _Optional[int] = ..., num_used_pages: _Optional[int] = ..., max_tokens: _Optional[int] = ..., total_bytes: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., num_loads: _Optional[int] = ..., num_stores: _Optional[int] = ..., load_bytes: _Optional[int] = ..., store_bytes: _Optional[int] = ..., load_gbps: _Optional[float] = ..., store_gbps: _Optional[float] = ..., copy_path: _Optional[str] = ...) -> None: ...

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
