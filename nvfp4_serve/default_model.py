"""The model `nvfp4-serve up` serves when no --model is given: a checkpoint shipped in the package.

Until a trained model ships (issue: accuracy), this is a random-weight Qwen3-shaped checkpoint made
by ``engine.tiny_model`` (4 layers, hidden 128, 4/2 heads, head_dim 32, a 1024-token BPE): it
exercises every path end to end but its completions are not meaningful text.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "models" / "default"


def default_model_dir() -> str:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the embedded default model is missing from {DEFAULT_MODEL_DIR}; pass --model DIR")
    return str(DEFAULT_MODEL_DIR)
