"""Engine command-line options shared by every service and the launcher (names follow SGLang)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.host_cache_size import HostCacheSize, host_cache_size_arg
from kernels.backends.registry import available_backends
from kernels.kv_layout import KV_DTYPES


def default_model_dir() -> str:
    from svc_common.default_model import default_model_dir as d

    return d()


def add_engine_args(p: argparse.ArgumentParser) -> None:
    c, s = CacheConfig(), SchedulerConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", "--model-path", dest="model", default=None,
                   help="Hugging Face checkpoint directory, or a hub id such as Qwen/Qwen3-8B (config, tokenizer and "
                        "safetensors downloaded into the hub cache, $HF_HOME; HF_HUB_OFFLINE=1 uses the cache only); "
                        "default: the embedded model")
    g.add_argument("--device", default="auto", help="cuda, cuda:N, cpu, or auto (cuda when PyTorch sees a GPU)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations; auto: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--attention-backend", default="auto", choices=["auto", *available_backends()],
                   help="auto: triton on CUDA, reference on CPU; reference: pure PyTorch; reference-block-select: "
                        "pure PyTorch with the per-block NVFP4 scale choice (amax/6 or amax/4); triton: the fused "
                        "NVFP4 kernels (FlashInfer for fp8/bf16 and prefill when installed); triton-block-select: "
                        "triton with that per-block scale choice in its quantize-on-write kernel (CUDA)")
    g.add_argument("--context-length", "--max-model-len", dest="context_length", type=int, default=None,
                   help="longest prompt + output in tokens; default: the model's (config.json); at most that")
    g.add_argument("--kv-cache-dtype", default=c.kv_dtype, choices=KV_DTYPES,
                   help="KV pool format: nvfp4 (9 bytes per 16 values), fp8_e4m3, bf16")
    g.add_argument("--kv-scales", default=None, metavar="FILE",
                   help="per-layer K/V global scales from `nvfp4-serve calibrate` (nvfp4 pools take its "
                        "nvfp4 scales and its fp8 scales for the FP8 workspace, fp8_e4m3 pools its fp8 "
                        "scales); default: the checkpoint's k_scale/v_scale, else 1.0")
    g.add_argument("--page-size", type=int, default=c.page_size, help="tokens per KV page")
    g.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool capacity in tokens; default: from --mem-fraction-static on CUDA, "
                        f"{c.cpu_default_tokens} on CPU")
    g.add_argument("--mem-fraction-static", type=float, default=c.mem_fraction_static,
                   help="fraction of GPU memory for weights + KV pool (GPU only)")
    g.add_argument("--host-cache-size", type=host_cache_size_arg, default=HostCacheSize(), metavar="SIZE",
                   help="host tier for evicted KV pages (pinned memory on CUDA), in bytes (8GiB, 500MB) or tokens "
                        "(200000tokens); a request whose prefix was evicted loads it back instead of prefilling it "
                        "again; 0: off")
    g.add_argument("--workspace-tokens", type=int, default=None,
                   help="rows of the shared extend workspace (default: the context length, capped by the pool)")
    g.add_argument("--chunked-prefill-size", "--chunk-size", dest="chunk_size", type=int, default=s.chunk_size,
                   help="prompt tokens per extend batch (chunked prefill)")
    g.add_argument("--max-running-requests", type=int, default=s.max_running_requests,
                   help="requests in the running batch at once")
    g.add_argument("--max-waiting-requests", type=int, default=s.max_waiting_requests,
                   help="requests queued for admission; beyond: RESOURCE_EXHAUSTED (HTTP 429)")
    g.add_argument("--local-extend-min-cached-ratio", type=float, default=s.local_extend_min_cached_ratio,
                   help="decode: extend locally when at least this fraction of the prompt is cached here")
    g.add_argument("--seed", type=int, default=0, help="accepted for SGLang compatibility; unused: a request seeds its own sampling with its 'seed' field")
    g.add_argument("--num-layers", type=int, default=None, metavar="N",
                   help="serve only the first N decoder layers of the checkpoint (quick benchmark runs; the "
                        "KV layout and model fingerprint say N, so every service must get the same N)")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="decode eagerly on CUDA (default: decode batches up to --cuda-graph-max-bs replay CUDA graphs)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=256,
                   help="largest decode batch run under a CUDA graph; larger batches run eagerly")


def kv_scales_for(path: str, model_dir: str, kv_dtype: str,
                  num_layers: int | None = None) -> dict[str, tuple[float, ...]]:
    """``CacheConfig`` scale arguments from a ``--kv-scales`` file checked against the model's fingerprint.

    The file is calibrated on the whole checkpoint; with ``num_layers`` its first N layers' scales are kept
    (layer i's K/V depend only on layers < i, so they are the truncated model's own scales)."""
    from engine.kv_scales import KVScales
    from engine.loader import model_fingerprint

    scales = KVScales.load(path, model_fingerprint(model_dir)).cache_scales(kv_dtype)
    if num_layers is None:
        return scales
    return {key: values[:num_layers] for key, values in scales.items()}


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The engine config of parsed engine options. Scale precedence (per layer, K and V): the
    ``--kv-scales`` file, else the checkpoint's k_scale/v_scale, else 1.0 (``engine.engine``)."""
    model_dir = a.model or default_model_dir()
    scales = kv_scales_for(a.kv_scales, model_dir, a.kv_cache_dtype, a.num_layers) if a.kv_scales else {}
    cache = CacheConfig(kv_dtype=a.kv_cache_dtype, page_size=a.page_size, max_total_tokens=a.max_total_tokens,
                        mem_fraction_static=a.mem_fraction_static, workspace_tokens=a.workspace_tokens,
                        host_cache_bytes=a.host_cache_size.num_bytes, host_cache_tokens=a.host_cache_size.num_tokens,
                        **scales)
    sched = SchedulerConfig(max_running_requests=a.max_running_requests, chunk_size=a.chunk_size,
                            max_waiting_requests=a.max_waiting_requests,
                            local_extend_min_cached_ratio=a.local_extend_min_cached_ratio)
    return EngineConfig(model_dir=model_dir, device=a.device, dtype=a.dtype,
                        attention_backend=a.attention_backend, cache=cache, scheduler=sched, seed=a.seed,
                        num_layers=a.num_layers, disable_cuda_graph=a.disable_cuda_graph,
                        cuda_graph_max_bs=a.cuda_graph_max_bs, context_length=a.context_length)


def engine_args_to_argv(a: argparse.Namespace) -> list[str]:
    """The engine options of a parsed namespace as argv (the launcher passes them to child services)."""
    out = []
    for flag, key in [("--model", "model"), ("--device", "device"), ("--dtype", "dtype"),
                      ("--attention-backend", "attention_backend"), ("--kv-cache-dtype", "kv_cache_dtype"),
                      ("--kv-scales", "kv_scales"),
                      ("--page-size", "page_size"), ("--max-total-tokens", "max_total_tokens"),
                      ("--mem-fraction-static", "mem_fraction_static"), ("--workspace-tokens", "workspace_tokens"),
                      ("--chunked-prefill-size", "chunk_size"), ("--max-running-requests", "max_running_requests"),
                      ("--max-waiting-requests", "max_waiting_requests"),
                      ("--local-extend-min-cached-ratio", "local_extend_min_cached_ratio"), ("--seed", "seed"),
                      ("--num-layers", "num_layers"), ("--cuda-graph-max-bs", "cuda_graph_max_bs"),
                      ("--context-length", "context_length"), ("--host-cache-size", "host_cache_size")]:
        v = getattr(a, key)
        if v is not None and not (key == "host_cache_size" and not v.enabled):
            # children may run elsewhere in the tree: pass the scales file as an absolute path
            out += [flag, str(Path(v).resolve()) if key == "kv_scales" else str(v)]
    if a.disable_cuda_graph:
        out.append("--disable-cuda-graph")
    return out
