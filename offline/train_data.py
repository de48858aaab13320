"""Stage 1 of training the default model: a BPE tokenizer and the token ids of each corpus split.

``prepare(OUT)`` trains a byte-level BPE (``tokenizers``) on the train split of ``offline.corpus`` and
writes ``OUT/{train,validation,held_out}.bin`` (int16 little-endian token ids, the files of a split
joined by ``<|endoftext|>``), ``tokenizer.json`` + ``tokenizer_config.json`` (the Qwen special tokens
and a ChatML template) and ``manifest.json`` (Python version, file and token counts, sha256 of each
.bin). The outputs are plain files, so the GPU machine that trains (``offline.train``) needs neither this
Python's standard library nor ``tokenizers``.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

import torch

from offline.corpus import DOC_SEPARATOR, SPLITS, read_texts, stdlib_files
from offline.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS

MAX_INT16_VOCAB = 32767  # token ids are stored as int16


def _train_bpe(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer_files(tokenizer_json: str, out: Path, model_max_length: int) -> None:
    """tokenizer.json plus a tokenizer_config.json with the specials and the ChatML template."""
    (out / "tokenizer.json").write_text(tokenizer_json)
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": False,
                "add_prefix_space": False,
                "added_tokens_decoder": added,
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
                "model_max_length": model_max_length,
                "tokenizer_class": "Qwen2Tokenizer",
            },
            indent=2,
        )
        + "\n"
    )


def prepare(
    out_dir: str | Path, vocab_size: int = 8192, root: Path | None = None, max_files: int | None = None
) -> dict[str, Any]:
    """Train the tokenizer on the train split and write the token ids of every split; returns the manifest."""
    if not 260 <= vocab_size <= MAX_INT16_VOCAB:
        raise ValueError(f"--vocab must be in [260, {MAX_INT16_VOCAB}] (got {vocab_size})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = {s: [t for _, t in read_texts(stdlib_files(s, root)[:max_files])] for s in SPLITS}
    if not texts["train"]:
        raise ValueError("the train split is empty: no readable .py files under the stdlib root")
    tok = _train_bpe(texts["train"], vocab_size)
    eot = tok.token_to_id(DOC_SEPARATOR)
    manifest: dict[str, Any] = {
        "python": platform.python_version(),
        "vocab_size": tok.get_vocab_size(),
        "splits": {},
    }
    for split, docs in texts.items():
        ids: list[int] = []
        for enc in tok.encode_batch(docs):
            ids.extend(enc.ids)
            ids.append(eot)
        blob = torch.tensor(ids, dtype=torch.int16).numpy().tobytes()
        (out / f"{split}.bin").write_bytes(blob)
        manifest["splits"][split] = {
            "num_files": len(docs),
            "num_tokens": len(ids),
            "num_chars": sum(len(d) for d in docs),
            "sha256": hashlib.sha256(blob).hexdigest(),
        }
    write_tokenizer_files(tok.to_str(), out, model_max_length=0)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_tokens(data_dir: Path, split: str) -> torch.Tensor:
    raw = (data_dir / f"{split}.bin").read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.int16).to(torch.int64)
