"""Fixed-length random-token prompts (as ``sglang.bench_serving --dataset-name random-ids``).

Token ids are drawn uniformly from the model's vocabulary less its special tokens: every id the tokenizer
knows (``tokenizer.json``, added tokens included) that is below the model's ``vocab_size``, minus the tokens
flagged special in ``tokenizer.json`` or ``tokenizer_config.json`` and the BOS/EOS/PAD ids. Prompts are
sent as token-id lists, so the server sees exactly ``input_len`` tokens (no BOS is added).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
WARMUP_STREAM = 1  # warmup prompts come from another generator stream than the measured ones


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def candidate_token_ids(tokenizer_dir: str | Path, model_vocab_size: int = 0) -> np.ndarray:
    """The ids random prompts draw from (sorted int64), see the module docstring.

    ``model_vocab_size`` 0 means unknown (the tokenizer's ids are all kept)."""
    from tokenizers import Tokenizer

    root = Path(tokenizer_dir)
    path = root / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {root}: pass --tokenizer DIR (the model's tokenizer)")
    tok = Tokenizer.from_file(str(path))
    vocab: dict[str, int] = tok.get_vocab(with_added_tokens=True)
    special: set[int] = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    cfg = _read_json(root / "tokenizer_config.json")
    for key, entry in (cfg.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and entry.get("special") and str(key).isdigit():
            special.add(int(key))
    for key in _SPECIAL_KEYS:
        content = _token_content(cfg.get(key))
        if content is not None and content in vocab:
            special.add(vocab[content])
    model_cfg = _read_json(root / "config.json")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = model_cfg.get(key)
        special.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    limit = model_vocab_size if model_vocab_size > 0 else max(vocab.values()) + 1
    kept = (i for i in set(vocab.values()) if i not in special and i < limit)
    ids = np.array(sorted(kept), dtype=np.int64)
    if ids.size == 0:
        raise ValueError(f"the tokenizer in {root} has no regular token below vocab_size {model_vocab_size}")
    return ids


def random_prompts(candidates: np.ndarray, num_prompts: int, input_len: int, seed: int,
                   stream: int = 0) -> np.ndarray:
    """``(num_prompts, input_len)`` int32 ids drawn uniformly from ``candidates``; the same (seed, stream)
    gives the same prompts on every machine (numpy's PCG64). An array, not lists: 1000 prompts of 32K
    tokens are 128 MB here, not gigabytes of Python ints."""
    if num_prompts < 0 or input_len < 1:
        raise ValueError(f"need num_prompts >= 0 and input_len >= 1 (got {num_prompts}, {input_len})")
    rng = np.random.default_rng([seed, stream])
    picks = rng.integers(0, candidates.size, size=(num_prompts, input_len))
    return candidates.astype(np.int32)[picks]
