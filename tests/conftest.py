from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow (e.g. the 1,000-request soak); skipped by default")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow to run it")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    cuda = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight Qwen3-shaped checkpoint with a trained BPE tokenizer (HF format)."""
    from offline.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


@pytest.fixture(scope="module")
def cpu_engine_loop(tiny_model_dir):
    """An EngineLoop thread over a small CPU engine (64 pages of 4 tokens), one per test module."""
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.engine_loop import EngineLoop

    engine = Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32",
                                 cache=CacheConfig(page_size=4, max_total_tokens=256)))
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()
