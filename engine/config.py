"""Engine configuration: frozen dataclasses, validated once, passed down (no global mode flags)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.host_cache_size import HostCacheSize, host_cache_size_arg
from engine.kv_rotation import KV_ROTATIONS
from nvfp4_kernels.kv_layout import KV_DTYPES

DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_DEFAULT_TOKENS = 65536


@dataclass(frozen=True)
class Flag:
    """How one config field is spelled on the command line: the only place each flag is declared (the engine's
    flags here, the prefill and decode services' own on their config dataclasses).

    ``svc_common/config_flags.py`` generates from these the argparse flags, the config built from parsed flags and
    the argv the launcher passes to its child services. Type and default come from the field unless given here.
    """

    help: str
    name: str = ""  # default: --<field-name>
    aliases: tuple[str, ...] = ()
    dest: str = ""  # the parsed attribute; default: the name without its dashes
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None  # a callable is asked when the parser is built
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # default: the field's type (int, float, str; bool: a switch)
    default: Any = None  # with has_default: the flag's default; else the field's (None for a required field)
    has_default: bool = False
    # The parsed value as config fields (default: the field itself); {} when the caller derives them.
    to_fields: Callable[[Any], dict[str, Any]] | None = None
    is_path: bool = False  # passed on to child services as an absolute path
    forward_default: bool = True  # passed on to child services when the value is the default (None never is)
    nargs: str | None = None  # argparse's, e.g. "*": a tuple[X, ...] field takes a list of X
    group: str = ""  # the --help group's title; default: the group the generator is given

    def attr(self, field_name: str) -> str:
        """The attribute of the parsed namespace that holds this flag's value."""
        return self.dest or (self.name[2:].replace("-", "_") if self.name else field_name)


def flag(help_text: str, **kw: Any) -> dict[str, Flag]:
    """Field metadata declaring the field's command-line flag."""
    return {"flag": Flag(help_text, **kw)}


def _attention_backends() -> tuple[str, ...]:
    from nvfp4_kernels.backends.registry import available_backends  # torch: asked only when a parser is built

    return ("auto", *available_backends())


def _nvfp4_decode_kernels() -> tuple[str, ...]:
    from nvfp4_kernels.backends.decode_kernels import NVFP4_DECODE_KERNELS

    return NVFP4_DECODE_KERNELS


HOST_COPY_PATHS = ("auto", "direct", "staged")  # engine.host_pool.CopyPath's values, and auto


def _host_cache_fields(size: HostCacheSize) -> dict[str, int]:
    return {"host_cache_bytes": size.num_bytes, "host_cache_tokens": size.num_tokens}


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and the shared extend workspace.

    Pool capacity: ``max_total_tokens`` when given; otherwise on CUDA the pool takes what is left of
    ``mem_fraction_static`` of the GPU's memory after the weights and the workspace, and on CPU it
    defaults to ``cpu_default_tokens``.
    """

    kv_dtype: str = field(default="nvfp4", metadata=flag(
        "KV pool format: nvfp4 (9 bytes per 16 values), fp8_e4m3, bf16", name="--kv-cache-dtype", choices=KV_DTYPES))
    # An orthogonal transform of every head's q/k/v before attention and quantization, undone on the output
    # (engine/kv_rotation.py): exact in real arithmetic, it changes only what quantization loses.
    kv_rotation: str = field(default="none", metadata=flag(
        "rotate K/V (and Q; the output is rotated back) by a randomized Hadamard transform before they are "
        "quantized: spreads outlier channels over the head (NVFP4 loses less; see docs/benchmarks/accuracy.md); "
        "prefill and decode must use the same", choices=KV_ROTATIONS))
    # Per-layer global scales (None -> 1.0): pool format scales and the FP8 workspace/attention scales.
    # --kv-scales names the file they come from; svc_common.engine_args reads it (it needs the model and dtype).
    k_scales: tuple[float, ...] | None = field(default=None, metadata=flag(
        "per-layer K/V global scales from `nvfp4-serve calibrate` (nvfp4 pools take its nvfp4 scales and its fp8 "
        "scales for the FP8 workspace, fp8_e4m3 pools its fp8 scales); default: the checkpoint's k_scale/v_scale, "
        "else 1.0", name="--kv-scales", parse=str, metavar="FILE", to_fields=lambda path: {}, is_path=True))
    v_scales: tuple[float, ...] | None = None
    ws_k_scales: tuple[float, ...] | None = None
    ws_v_scales: tuple[float, ...] | None = None
    page_size: int = field(default=16, metadata=flag("tokens per KV page"))
    max_total_tokens: int | None = field(default=None, metadata=flag(
        f"KV pool capacity in tokens; default: from --mem-fraction-static on CUDA, {CPU_DEFAULT_TOKENS} on CPU"))
    mem_fraction_static: float = field(default=0.88, metadata=flag(
        "fraction of GPU memory for weights + KV pool (GPU only)"))
    cpu_default_tokens: int = CPU_DEFAULT_TOKENS
    # The host tier (--host-cache-size, engine/host_cache_size.py): evicted pages wait in host memory (pinned on
    # CUDA) until a request's prefix needs them again. At most one of the two is set; both 0: no host tier.
    host_cache_bytes: int = field(default=0, metadata=flag(
        "host tier for evicted KV pages (pinned memory on CUDA), in bytes (8GiB, 500MB) or tokens (200000tokens); a "
        "request whose prefix was evicted loads it back instead of prefilling it again; 0: off",
        name="--host-cache-size", parse=host_cache_size_arg, default=HostCacheSize(), has_default=True, metavar="SIZE",
        to_fields=_host_cache_fields, forward_default=False))
    host_cache_tokens: int = 0
    host_copy_path: str = field(default="auto", metadata=flag(
        "how host-tier batches cross (CUDA): direct (one kernel reads/writes the pinned host pages over the bus), "
        "staged (a gather into device memory, then the copy engines, one copy per run of host pages; kernels "
        "beside it keep their SMs), auto (direct where kernels can map the host pages, else staged)",
        choices=HOST_COPY_PATHS))
    # Rows of the ONE pair of workspace buffers (FP8, or BF16 for a bf16 cache) shared by all layers.
    # Bounds prefix + chunk of every extend batch; None -> min(model context, pool capacity).
    workspace_tokens: int | None = field(default=None, metadata=flag(
        "rows of the shared extend workspace (default: the context length, capped by the pool)"))

    def __post_init__(self) -> None:
        if self.host_cache_bytes < 0 or self.host_cache_tokens < 0 or (self.host_cache_bytes and self.host_cache_tokens):
            raise ValueError("--host-cache-size takes bytes or tokens, not both, and not below 0 "
                             f"(got {self.host_cache_bytes} bytes, {self.host_cache_tokens} tokens)")
        if self.host_copy_path not in HOST_COPY_PATHS:
            raise ValueError(f"--host-copy-path must be one of {HOST_COPY_PATHS}, got {self.host_copy_path!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.kv_rotation not in KV_ROTATIONS:
            raise ValueError(f"--kv-rotation must be one of {KV_ROTATIONS}, got {self.kv_rotation!r}")
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

    chunk_size: int = field(default=2048, metadata=flag(
        "prompt tokens per extend batch (chunked prefill)", name="--chunked-prefill-size", aliases=("--chunk-size",),
        dest="chunk_size"))
    max_running_requests: int = field(default=256, metadata=flag("requests in the running batch at once"))
    max_waiting_requests: int = field(default=4096, metadata=flag(
        "requests queued for admission; beyond: RESOURCE_EXHAUSTED (HTTP 429)"))
    # A request is admitted only if the pool keeps this many free tokens per running request
    # for their decode growth; when growth still runs out, the newest request is retracted.
    decode_reserve_tokens: int = 16
    # Decode service policy: a request whose prompt is cached here at least this fraction runs the
    # extend path locally; otherwise its missing pages are pulled from the prefill service.
    local_extend_min_cached_ratio: float = field(default=0.5, metadata=flag(
        "decode: extend locally when at least this fraction of the prompt is cached here"))
    # Overlap scheduling (engine/scheduler.py): decode step k is launched before step k-1's tokens are read.
    disable_overlap_schedule: bool = field(default=False, metadata=flag(
        "read each decode step's tokens before launching the next (default: the next step is launched first, "
        "its input ids taken on the device, so the host's work between steps overlaps the GPU's)"))

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
    # Flags are generated in field order (svc_common/engine_args.py): --help lists them in this order.
    model_dir: str = field(metadata=flag(
        "Hugging Face checkpoint directory, or a hub id such as Qwen/Qwen3-8B (config, tokenizer and safetensors "
        "downloaded into the hub cache, $HF_HOME; HF_HUB_OFFLINE=1 uses the cache only); default: the embedded model",
        name="--model", aliases=("--model-path",)))
    device: str = field(default="auto", metadata=flag(  # auto -> cuda if available else cpu
        "cuda, cuda:N, cpu, or auto (cuda when PyTorch sees a GPU)"))
    dtype: str = field(default="auto", metadata=flag(  # model compute dtype: auto -> bfloat16 on cuda, float32 on cpu
        "weights and activations; auto: bfloat16 on CUDA, float32 on CPU", choices=DTYPES))
    attention_backend: str = field(default="auto", metadata=flag(
        "auto: triton on CUDA, reference on CPU; reference: pure PyTorch; reference-block-select: pure PyTorch with "
        "the per-block NVFP4 scale choice (the E4M3 scale near amax/6 that reconstructs the block best); triton: the fused NVFP4 kernels (FlashInfer for "
        "fp8/bf16 and prefill when installed); triton-block-select: triton with that per-block scale choice in its "
        "quantize-on-write kernel (CUDA)", choices=_attention_backends))
    nvfp4_decode_kernel: str = field(default="auto", metadata=flag(
        "the triton backends' NVFP4 decode kernel: auto (on Hopper for groups of up to 8 query heads per KV head at "
        "head_dim 128: gluon-tma where the pool fits its TMA boxes, else gluon; triton elsewhere), gluon "
        "(explicit-layout kernel with a cp.async ring, sm_89+), gluon-tma (the same fed by TMA, sm_90+; KV heads x "
        "head_dim / 16 a multiple of 16, pages of 16 or 32 tokens), triton (any GPU)",
        choices=_nvfp4_decode_kernels))
    # Longest prompt + output served (--context-length); None -> the model's own (config.json, capped by a
    # sliding window). Larger than the model's is refused at start-up.
    context_length: int | None = field(default=None, metadata=flag(
        "longest prompt + output in tokens; default: the model's (config.json); at most that",
        aliases=("--max-model-len",)))
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = field(default=0, metadata=flag(
        "accepted for SGLang compatibility; unused: a request seeds its own sampling with its 'seed' field"))
    # Serve only the first N decoder layers (quick benchmark runs of a large checkpoint); None -> all.
    num_layers: int | None = field(default=None, metadata=flag(
        "serve only the first N decoder layers of the checkpoint (quick benchmark runs; the KV layout and model "
        "fingerprint say N, so every service must get the same N; default: every layer)", metavar="N"))
    # Decode under CUDA graphs (CUDA only): batches up to cuda_graph_max_bs rows replay captured graphs.
    disable_cuda_graph: bool = field(default=False, metadata=flag(
        "decode eagerly on CUDA (default: decode batches up to --cuda-graph-max-bs replay CUDA graphs)"))
    cuda_graph_max_bs: int = field(default=256, metadata=flag(
        "largest decode batch run under a CUDA graph; larger batches run eagerly"))
    # The decoder's RMSNorms (with the residual adds), SiLU-and-multiply, q/k norm + RoPE and a decode step's
    # projections as Triton kernels on CUDA (nvfp4_kernels/fused_ops.py); the switch keeps the PyTorch ops and
    # cuBLAS, for comparisons.
    disable_fused_ops: bool = field(default=False, metadata=flag(
        "run RMSNorm, SiLU-and-multiply, q/k norm + RoPE and every projection as PyTorch ops (cuBLAS) on CUDA too "
        "(default: fused Triton kernels on CUDA, and a Triton linear for the projections of decode batches up to "
        "64 rows on Hopper GPUs; CPU always uses the PyTorch ops)"))
    # Programmatic dependent launch of the step's small kernels on SM90+ (nvfp4_kernels/programmatic_launch.py):
    # a kernel's launch overlaps the tail of the one before it. Process-wide; the switch is for comparisons.
    disable_pdl: bool = field(default=False, metadata=flag(
        "launch the step's small kernels (norms, activation, q/k norm + RoPE, K/V writes) without programmatic "
        "dependent launch (default: with it on SM90+ GPUs, so each one's launch overlaps the end of the kernel "
        "before it)"))

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1 (or left out to serve every layer), got {self.num_layers}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"--context-length must be >= 1 (or left out for the model's), got {self.context_length}")
        if self.nvfp4_decode_kernel not in _nvfp4_decode_kernels():
            raise ValueError(f"--nvfp4-decode-kernel must be one of {_nvfp4_decode_kernels()}, "
                             f"got {self.nvfp4_decode_kernel!r}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

