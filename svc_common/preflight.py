"""What an entry point checks before any process loads weights, each failure one line saying what to change.

``prepare_engine_args`` runs once where the user's flags arrive (``nvfp4-serve up``, each service's main):
it resolves ``--model`` to a directory (a hub id is downloaded or taken from the cache,
``svc_common.model_source``) and refuses, as a ``ValueError``, what would otherwise fail deep inside start-up
with a traceback: ``--device cuda`` where PyTorch has no CUDA, a directory without config.json, weights or
tokenizer, an architecture or head_dim the kernels do not support, a ``--context-length`` past the model's.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from engine.model_config import ModelConfig
from svc_common.model_source import resolve_model

TORCH_PIN = "torch==2.13.0"


def prepare_engine_args(a: argparse.Namespace) -> None:
    """Resolve ``a.model`` in place to the directory every child process gets, then check device and model."""
    a.model = resolve_model(a.model)
    device = check_device(a.device)
    config = check_model(a.model, a.kv_cache_dtype, device, a.attention_backend, a.context_length, a.kv_rotation)
    check_decode_kernel(a.nvfp4_decode_kernel, a.attention_backend, device, config.head_dim,
                        num_kv_heads=config.num_key_value_heads, page_size=a.page_size)


def check_device(device: str) -> str:
    """The device ``--device`` resolves to ("cpu" or "cuda[:N]"); ValueError when it names a GPU this PyTorch
    cannot use."""
    if device == "cpu":
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if torch.version.cuda is None:
        raise ValueError(f"--device {device}: this PyTorch ({torch.__version__}) is a CPU-only build; install the "
                         f"CUDA build (on Linux the PyPI wheel is one: pip install --force-reinstall {TORCH_PIN}, "
                         f"then pip install -e \".[gpu]\"; the README's GPU install) or pass --device cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: "
                         "check nvidia-smi, the driver and CUDA_VISIBLE_DEVICES, or pass --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) visible "
                         f"(CUDA_VISIBLE_DEVICES decides which); pass cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device


def check_decode_kernel(kernel: str, attention_backend: str, device: str, head_dim: int, *,
                        num_kv_heads: int | None = None, page_size: int | None = None) -> None:
    """ValueError unless ``--nvfp4-decode-kernel`` can be served: a kernel other than auto needs a triton backend
    (auto is one on CUDA), and a Gluon kernel a head_dim it has a tiling for, a pool its loads take (where
    ``num_kv_heads`` and ``page_size`` are given) and a GPU new enough (``decode_kernels.kernel_unfit``)."""
    if kernel == "auto":
        return
    on_cuda = device.startswith("cuda")
    if not (attention_backend.startswith("triton") or (attention_backend == "auto" and on_cuda)):
        raise ValueError(f"--nvfp4-decode-kernel {kernel} picks a kernel of the triton backends, and the backend here "
                         f"is {attention_backend} on {device}: use --nvfp4-decode-kernel auto")
    from nvfp4_kernels.backends.decode_kernels import DecodeKernel, kernel_unfit, shape_unfit

    choice = DecodeKernel(kernel)
    if choice is DecodeKernel.TRITON:
        return
    why = shape_unfit(choice, head_dim, num_kv_heads, page_size)  # refused before the GPU is asked
    if why is None:
        import torch

        why = kernel_unfit(choice, head_dim, torch.cuda.get_device_capability(torch.device(device)))
    if why is not None:
        raise ValueError(f"--nvfp4-decode-kernel {why} on {device}: use --nvfp4-decode-kernel auto or triton")


def check_model(model_dir: str, kv_dtype: str, device: str, attention_backend: str,
                context_length: int | None, kv_rotation: str = "none") -> ModelConfig:
    """The model's config after checking that the directory can be served as asked (ValueError otherwise)."""
    from engine.loader import weight_files

    try:
        config = ModelConfig.from_dir(model_dir)
        weight_files(model_dir)
    except (OSError, ValueError, NotImplementedError) as e:
        raise ValueError(f"--model {model_dir}: {e}") from None
    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise ValueError(f"--model {model_dir}: no tokenizer.json (a Hugging Face fast tokenizer); save one with "
                         "transformers' AutoTokenizer.save_pretrained into the directory")
    d = config.head_dim
    if kv_rotation == "hadamard" and d & (d - 1):
        raise ValueError(f"--kv-rotation hadamard needs head_dim a power of two ({model_dir} has {d}); use "
                         "--kv-rotation none for this model")
    if kv_dtype == "nvfp4" and d % 16:
        raise ValueError(f"--kv-cache-dtype nvfp4 needs head_dim divisible by 16 ({model_dir} has {d}); use "
                         "--kv-cache-dtype fp8_e4m3 or bf16 for this model")
    triton = attention_backend.startswith("triton")
    if triton and not device.startswith("cuda"):
        raise ValueError(f"--attention-backend {attention_backend} runs CUDA kernels, and --device is {device}: use "
                         "--attention-backend auto, reference or reference-block-select on the CPU")
    # The Triton NVFP4 kernels' own rule (nvfp4_kernels/backends/triton_nvfp4.py, check_nvfp4_layer).
    triton_nvfp4 = kv_dtype == "nvfp4" and device.startswith("cuda") and (triton or attention_backend == "auto")
    if triton_nvfp4 and (d < 64 or d & (d - 1)):
        raise ValueError(f"the Triton NVFP4 kernels need head_dim a power of two >= 64 ({model_dir} has {d}); use "
                         "--attention-backend reference (slow) or --kv-cache-dtype fp8_e4m3")
    if context_length is not None and context_length > config.max_context_len:
        raise ValueError(f"--context-length {context_length} is longer than {model_dir} supports "
                         f"({config.max_context_len} tokens): pass at most {config.max_context_len}")
    return config
