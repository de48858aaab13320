"""The model `nvfp4-serve up` serves when no --model is given: a checkpoint shipped in the package.

A small trained Qwen3 model of Python source: 12.6M parameters (6 layers, hidden 384, 6 query / 2 KV
heads of head_dim 64, SwiGLU 1024, tied embeddings), 2048-token context, its own 8192-token byte-level
BPE with a ChatML template, 25 MB in bf16. ``offline/train.py`` trained it in 94 s on one H200 on the
train split of the Python 3.11 standard library's sources (``offline.corpus``; about 7.5M tokens, 92M
tokens seen, best validation loss 1.95 nats/token); ``training_log.json`` beside it has the curve and
the exact command. It writes Python-like code (``def fib(n):`` gets a docstring and a body); it is not
an instruction-following model, so chat requests get code-flavoured text. The KV-cache accuracy of
this model is in ``docs/benchmarks/accuracy.md``.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "models" / "default"


def default_model_dir() -> str:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the embedded default model is missing from {DEFAULT_MODEL_DIR}; pass --model DIR")
    return str(DEFAULT_MODEL_DIR)
