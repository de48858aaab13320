"""Write a random-weight Hugging Face checkpoint (config, safetensors, tokenizer) for tests and benchmarks.

Weights are deterministic per (seed, tensor name), independent of sharding: each tensor draws
from its own generator in fixed-size chunks. Files are streamed one chunk at a time, so a
Qwen3-8B-shaped checkpoint needs memory for one chunk, not for the model.

``device="cuda"`` draws the normal weights on the GPU instead (each tensor from its own CUDA
generator, in larger fixed-size chunks): a different stream from the CPU one, deterministic for a
given seed, GPU model and PyTorch version (CUDA's Philox mapping follows the launch grid), and fast
enough to write the 16 GB of ``--preset qwen3-8b`` in seconds instead of minutes. Everything else
(config, tokenizer, norms, KV scales, file layout) is the same on both devices.

The tokenizer is a byte-level BPE trained on a few Python standard-library sources (present on
every machine; the merges follow that Python version's sources) with the Qwen special tokens
``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2) and a ChatML template.

CLI: ``python -m offline.tiny_model OUT_DIR [--preset qwen3-8b] [--layers N --hidden H --heads A
--kv-heads K --head-dim D --intermediate I --vocab V --arch qwen3|qwen2|llama|mistral --seed S
--shard-mb M --device cpu|cuda --dry-run]`` (also ``nvfp4-serve make-model``); explicit flags
override the preset's values.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import struct
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.model_config import ModelConfig

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ARCHS = {
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
}
_DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float16": (torch.float16, "F16"), "float32": (torch.float32, "F32")}
_MAX_TOKENIZER_VOCAB = 4096
_MIN_VOCAB = 260  # 256 byte tokens + 3 specials + at least one merge
_CHUNK = 1 << 22  # elements drawn per generator call; part of the determinism contract
_CUDA_CHUNK = 1 << 26  # the same for --device cuda (its own stream)
DEVICES = ("cpu", "cuda")
# Shapes of public models, written with random weights (the tokenizer stays the small trained one).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "arch": "qwen3", "num_layers": 36, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "rope_theta": 1e6,
        # 1M-token prompts are allowed (the benchmark's longest point); Qwen3-8B itself says 40960
        "max_position_embeddings": 1048576, "tie_word_embeddings": False, "dtype": "bfloat16",
        "shard_size_bytes": 4 << 30,
    },
}
_CORPUS_FILES = ("this.py", "textwrap.py", "string.py", "colorsys.py", "bisect.py", "heapq.py", "queue.py",
                 "shlex.py", "calendar.py")
_EXTRA_TEXT = (
    "Hello! How can I help you today? The quick brown fox jumps over the lazy dog.\n"
    "Café, naïve, façade, jalapeño, Zürich, Ελληνικά, русский, 日本語, 中文, 한국어, emoji 🙂🚀.\n"
)
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n' + ((call.function or call) | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@functools.lru_cache(maxsize=4)
def _train_tokenizer(vocab_size: int) -> str:
    """tokenizer.json content of a byte-level BPE with ``vocab_size`` ids (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / f).read_text(encoding="utf-8") for f in _CORPUS_FILES if (stdlib / f).is_file()]
    texts.append(_EXTRA_TEXT)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _tensor_bytes(name: str, shape: tuple[int, ...], init: str, dtype: torch.dtype, seed: int,
                  value: float = 0.0, device: str = "cpu") -> Iterator[bytes | memoryview]:
    """Raw little-endian bytes of one tensor, chunk by chunk."""
    numel = math.prod(shape)
    if init == "const":
        yield torch.full((numel,), value, dtype=dtype).view(torch.uint8).numpy().tobytes()
        return
    if device == "cuda" and init == "normal":
        yield from _cuda_normal_bytes(name, numel, dtype, seed)
        return
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    for start in range(0, numel, _CHUNK):
        n = min(_CHUNK, numel - start)
        chunk = (torch.randn(n, generator=gen) * 0.02).to(dtype) if init == "normal" else torch.ones(n, dtype=dtype)
        yield chunk.view(torch.uint8).numpy().tobytes()


def _cuda_normal_bytes(name: str, numel: int, dtype: torch.dtype, seed: int) -> Iterator[memoryview]:
    """N(0, 0.02) drawn on the GPU from the tensor's own CUDA generator in ``_CUDA_CHUNK`` pieces."""
    gen = torch.Generator(device="cuda").manual_seed(_tensor_seed(seed, name))
    for start in range(0, numel, _CUDA_CHUNK):
        n = min(_CUDA_CHUNK, numel - start)
        chunk = (torch.randn(n, generator=gen, device="cuda") * 0.02).to(dtype)
        yield memoryview(chunk.view(torch.uint8).cpu().numpy())


def _tensor_specs(cfg: ModelConfig, kv_scales: dict[str, list[float]] | None) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, init) in HF order; init is "normal" (std 0.02), "ones" or "k"/"v" (a kv scale)."""
    hidden, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (cfg.vocab_size, hidden), "normal")]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        specs.append((f"{p}.input_layernorm.weight", (hidden,), "ones"))
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            specs.append((f"{p}.self_attn.{proj}.weight", (rows, hidden), "normal"))
            if cfg.attention_bias:
                specs.append((f"{p}.self_attn.{proj}.bias", (rows,), "normal"))
        specs.append((f"{p}.self_attn.o_proj.weight", (hidden, q), "normal"))
        if cfg.o_proj_bias:
            specs.append((f"{p}.self_attn.o_proj.bias", (hidden,), "normal"))
        if cfg.qk_norm:
            specs.append((f"{p}.self_attn.q_norm.weight", (cfg.head_dim,), "ones"))
            specs.append((f"{p}.self_attn.k_norm.weight", (cfg.head_dim,), "ones"))
        if kv_scales is not None:
            specs.append((f"{p}.self_attn.k_scale", (), "k"))
            specs.append((f"{p}.self_attn.v_scale", (), "v"))
        specs.append((f"{p}.post_attention_layernorm.weight", (hidden,), "ones"))
        specs.append((f"{p}.mlp.gate_proj.weight", (inter, hidden), "normal"))
        specs.append((f"{p}.mlp.up_proj.weight", (inter, hidden), "normal"))
        specs.append((f"{p}.mlp.down_proj.weight", (hidden, inter), "normal"))
    specs.append(("model.norm.weight", (hidden,), "ones"))
    if not cfg.tie_word_embeddings:
        specs.append(("lm_head.weight", (cfg.vocab_size, hidden), "normal"))
    return specs


def _write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], str, int]],
                       chunks: Any) -> None:
    """Stream a safetensors file: 8-byte header length, JSON header (space padded to 8), raw data.

    ``entries`` are (name, shape, safetensors dtype, nbytes); ``chunks(name)`` yields the bytes.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, st_dtype, nbytes in entries:
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, _, _, nbytes in entries:
            written = 0
            for chunk in chunks(name):
                f.write(chunk)
                written += len(chunk)  # bytes: chunks are bytes or 1-D uint8 memoryviews
            assert written == nbytes, f"{name}: wrote {written} bytes, expected {nbytes}"


def make_config(
    *, arch: str = "qwen3", vocab_size: int = 512, hidden_size: int = 64, intermediate_size: int = 128,
    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
    max_position_embeddings: int = 4096, rope_theta: float = 10000.0, rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False, dtype: str = "bfloat16",
) -> dict[str, Any]:
    """The ``config.json`` content of ``make_tiny_model`` with these options, validated (nothing written)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {_MIN_VOCAB} for the byte-level tokenizer (got {vocab_size})")
    architecture, model_type = ARCHS[arch]
    tok_ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    config: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6 if arch.startswith("qwen") else 1e-5, "rope_theta": rope_theta,
        "rope_scaling": rope_scaling, "tie_word_embeddings": tie_word_embeddings, "torch_dtype": dtype,
        "bos_token_id": tok_ids["<|endoftext|>"], "eos_token_id": tok_ids["<|im_end|>"],
        "initializer_range": 0.02, "use_cache": True,
    }
    if arch in ("qwen3", "llama", "mistral"):
        config["attention_bias"] = False
    if arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    if arch == "llama":
        config["mlp_bias"] = False
    if arch == "mistral":
        config["sliding_window"] = None
    ModelConfig.from_dict(config)  # validates the geometry
    return config


def checkpoint_nbytes(config: dict[str, Any], with_kv_scales: bool = False) -> int:
    """Bytes of the safetensors data ``make_tiny_model`` writes for ``config`` (headers excluded)."""
    itemsize = torch.empty((), dtype=_DTYPES[config["torch_dtype"]][0]).element_size()
    specs = _tensor_specs(ModelConfig.from_dict(config), {"k": [], "v": []} if with_kv_scales else None)
    return sum(math.prod(shape) * (4 if init in ("k", "v") else itemsize) for _, shape, init in specs)


def make_tiny_model(
    out_dir: str | Path, *, arch: str = "qwen3", vocab_size: int = 512, hidden_size: int = 64,
    intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
    head_dim: int = 16, max_position_embeddings: int = 4096, rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None, tie_word_embeddings: bool = False, dtype: str = "bfloat16",
    seed: int = 0, shard_size_bytes: int | None = None, kv_scales: dict[str, list[float]] | None = None,
    device: str = "cpu",
) -> Path:
    """Write a complete random-weight HF checkpoint directory and return its path.

    Removes earlier ``model*.safetensors`` files and index in ``out_dir`` so that a re-run with
    other sharding cannot leave stale shards behind. ``device="cuda"`` draws the weights on the GPU
    (another deterministic stream, see the module docstring).
    """
    config = make_config(
        arch=arch, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta, rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings, dtype=dtype)
    if shard_size_bytes is not None and shard_size_bytes <= 0:
        raise ValueError(f"shard_size_bytes must be positive or None (got {shard_size_bytes})")
    if kv_scales is not None:
        for key in ("k", "v"):
            values = kv_scales.get(key)
            if values is None or len(values) != num_layers or not all(float(s) > 0 for s in values):
                raise ValueError(f"kv_scales[{key!r}] must hold {num_layers} positive floats (got {values!r})")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' needs a CUDA GPU (none is visible here): use --device cpu")
    cfg = ModelConfig.from_dict(config)
    tok_ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok_ids["<|endoftext|>"],
        "eos_token_id": [tok_ids["<|im_end|>"], tok_ids["<|endoftext|>"]],
    }, indent=2) + "\n")
    _write_tokenizer(out, min(vocab_size, _MAX_TOKENIZER_VOCAB), max_position_embeddings)

    torch_dtype, st_dtype = _DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    specs = _tensor_specs(cfg, kv_scales)
    entries = [(name, shape, "F32" if init in ("k", "v") else st_dtype,
                math.prod(shape) * (4 if init in ("k", "v") else itemsize)) for name, shape, init in specs]
    init_of = {name: init for name, _, init in specs}
    shape_of = {name: shape for name, shape, _ in specs}

    def chunks(name: str) -> Iterator[bytes | memoryview]:
        init = init_of[name]
        if init in ("k", "v"):
            assert kv_scales is not None
            layer = int(name.split(".")[2])
            return _tensor_bytes(name, (), "const", torch.float32, seed, float(kv_scales[init][layer]))
        return _tensor_bytes(name, shape_of[name], init, torch_dtype, seed, device=device)

    shards: list[list[tuple[str, tuple[int, ...], str, int]]] = [[]]
    size = 0
    for entry in entries:
        if shard_size_bytes is not None and shards[-1] and size + entry[3] > shard_size_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[3]
    if shard_size_bytes is None:
        _write_safetensors(out / "model.safetensors", shards[0], chunks)
        return out
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(out / fname, shard, chunks)
        weight_map.update({name: fname for name, *_ in shard})
    index = {"metadata": {"total_size": sum(e[3] for e in entries)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def _write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    (out / "tokenizer.json").write_text(_train_tokenizer(vocab_size))
    added = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, tok in enumerate(SPECIAL_TOKENS)}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "tokenizer_class": "Qwen2Tokenizer",
    }, indent=2) + "\n")


# flag -> make_tiny_model keyword; None defaults let the preset fill what the command line leaves out
_FLAGS = (("--arch", "arch", str), ("--layers", "num_layers", int), ("--hidden", "hidden_size", int),
          ("--heads", "num_heads", int), ("--kv-heads", "num_kv_heads", int), ("--head-dim", "head_dim", int),
          ("--intermediate", "intermediate_size", int), ("--vocab", "vocab_size", int),
          ("--max-position-embeddings", "max_position_embeddings", int), ("--rope-theta", "rope_theta", float),
          ("--dtype", "dtype", str))


_NOT_CONFIG = ("seed", "shard_size_bytes", "kv_scales", "device")  # make_tiny_model keywords make_config lacks


def build_arg_parser(prog: str = "python -m offline.tiny_model") -> argparse.ArgumentParser:
    from svc_common.cli_help import HelpFormatter

    parser = argparse.ArgumentParser(prog, formatter_class=HelpFormatter, description="Write a random-weight HF checkpoint for tests/benchmarks "
                                                       "(explicit flags override the --preset's values).")
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="a public model's shape, e.g. qwen3-8b (36 layers, hidden 4096, 32/8 heads, "
                             "head_dim 128, vocab 151936, 1M context, 4 GiB shards; about 16 GB)")
    defaults = _defaults()
    for flag, key, kind in _FLAGS:
        choices = sorted(ARCHS) if key == "arch" else sorted(_DTYPES) if key == "dtype" else None
        parser.add_argument(flag, dest=key, type=kind, choices=choices, default=None,
                            help=f"default {defaults[key]!r} (or the preset's)")
    parser.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None,
                        help="share the embedding and output matrices (default: the preset's, else not)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--shard-mb", type=float, default=None,
                        help="shard size in MiB (default: one file, or the preset's)")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the weights are drawn: cpu (the reference stream) or cuda (another "
                             "deterministic stream, for multi-GB checkpoints)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print config.json and the weight size as JSON; write nothing")
    return parser


def _defaults() -> dict[str, Any]:
    """``make_tiny_model``'s keyword defaults."""
    import inspect

    params = inspect.signature(make_tiny_model).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``make_tiny_model`` keywords of parsed flags: the function's defaults < the preset < explicit flags."""
    kwargs: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
    for _, key, _ in _FLAGS:
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    if args.tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = args.tie_word_embeddings
    if args.shard_mb is not None:
        kwargs["shard_size_bytes"] = int(args.shard_mb * (1 << 20))
    kwargs.update(seed=args.seed, device=args.device)
    return kwargs


def main(argv: list[str] | None = None, prog: str = "python -m offline.tiny_model") -> int:
    """Write the checkpoint and print its path (``--dry-run``: print its config and size instead)."""
    args = build_arg_parser(prog).parse_args(argv)
    kwargs = model_kwargs(args)
    try:
        config = make_config(**{k: v for k, v in kwargs.items() if k not in _NOT_CONFIG})
        if args.dry_run:
            print(json.dumps({"out_dir": args.out_dir, "config": config, "weight_bytes": checkpoint_nbytes(config),
                              "shard_size_bytes": kwargs.get("shard_size_bytes"), "device": args.device,
                              "seed": args.seed}, indent=2))
            return 0
        t0 = time.perf_counter()
        path = make_tiny_model(args.out_dir, **kwargs)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {checkpoint_nbytes(config) / 1e9:.2f} GB of weights ({args.device} stream, seed {args.seed}) "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
