"""Engine configuration: frozen dataclasses, validated once, passed down (no global mode flags)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kernels.kv_layout import KV_DTYPES


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and the shared extend workspace.

    Pool capacity: ``max_total_tokens`` when given; otherwise on CUDA the pool takes what is left of
    ``mem_fraction_static`` of the GPU's memory after the weights and the workspace, and on CPU it
    defaults to ``cpu_default_tokens``.
    """

    kv_dtype: str = "nvfp4"
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.88
    cpu_default_tokens: int = 65536
    # Rows of the ONE pair of workspace buffers (FP8, or BF16 for a bf16 cache) shared by all layers.
    # Bounds prefix + chunk of every extend batch; None -> min(model context, pool capacity).
    workspace_tokens: int | None = None
    # Per-layer global scales (None -> 1.0): pool format scales and the FP8 workspace/attention scales.
    k_scales: tuple[float, ...] | None = None
    v_scales: tuple[float, ...] | None = None
    ws_k_scales: tuple[float, ...] | None = None
    ws_v_scales: tuple[float, ...] | None = None
    # The host tier (--host-cache-size, engine/host_cache_size.py): evicted pages wait in host memory (pinned on
    # CUDA) until a request's prefix needs them again. At most one of the two is set; both 0: no host tier.
    host_cache_bytes: int = 0
    host_cache_tokens: int = 0

    def __post_init__(self) -> None:
        if self.host_cache_bytes < 0 or self.host_cache_tokens < 0 or (self.host_cache_bytes and self.host_cache_tokens):
            raise ValueError("--host-cache-size takes bytes or tokens, not both, and not below 0 "
                             f"(got {self.host_cache_bytes} bytes, {self.host_cache_tokens} tokens)")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"--max-total-tokens ({self.max_total_tokens}) must hold at least one page ({self.page_size})")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.workspace_tokens is not None and self.workspace_tokens < self.page_size:
            raise ValueError(f"--workspace-tokens must be >= page size, got {self.workspace_tokens}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_running_requests: int = 256
    chunk_size: int = 2048  # prompt tokens per extend batch (chunked prefill)
    max_waiting_requests: int = 4096
    # A request is admitted only if the pool keeps this many free tokens per running request
    # for their decode growth; when growth still runs out, the newest request is retracted.
    decode_reserve_tokens: int = 16
    # Decode service policy: a request whose prompt is cached here at least this fraction runs the
    # extend path locally; otherwise its missing pages are pulled from the prefill service.
    local_extend_min_cached_ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.chunk_size < 1:
            raise ValueError(f"--chunk-size must be >= 1, got {self.chunk_size}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"--max-waiting-requests must be >= 1, got {self.max_waiting_requests}")
        if not 0.0 <= self.local_extend_min_cached_ratio <= 1.0:
            raise ValueError("--local-extend-min-cached-ratio must be in [0, 1], "
                             f"got {self.local_extend_min_cached_ratio}")
        if self.decode_reserve_tokens < 0:
            raise ValueError(f"--decode-reserve-tokens must be >= 0, got {self.decode_reserve_tokens}")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "auto"  # auto -> cuda if available else cpu
    dtype: str = "auto"  # model compute dtype: auto -> bfloat16 on cuda, float32 on cpu
    attention_backend: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    # Serve only the first N decoder layers (quick benchmark runs of a large checkpoint); None -> all.
    num_layers: int | None = None
    # Decode under CUDA graphs (CUDA only): batches up to cuda_graph_max_bs rows replay captured graphs.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    # Longest prompt + output served (--context-length); None -> the model's own (config.json, capped by a
    # sliding window). Larger than the model's is refused at start-up.
    context_length: int | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1 (or left out to serve every layer), got {self.num_layers}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"--context-length must be >= 1 (or left out for the model's), got {self.context_length}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

