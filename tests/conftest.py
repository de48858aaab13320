from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight Qwen3-shaped checkpoint with a trained BPE tokenizer (HF format)."""
    from engine.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))
