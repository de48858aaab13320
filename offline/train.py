"""Train the small default model: a Qwen3-architecture decoder on the Python standard library's sources.

Two stages, so that the tokenizer and token ids are made once on one machine and the GPU only trains:

    python -m offline.train prepare --out DATA            # BPE tokenizer + token ids of each split (CPU)
    python -m offline.train train --data DATA --out MODEL --device cuda --steps N
    python -m offline.train all --out MODEL               # both, on one machine

``prepare`` (``offline.train_data``) makes the tokenizer and the token ids of each corpus split.
``train`` builds ``engine.model.CausalLM`` itself (the serving definition, so the checkpoint cannot
drift from what the engine runs) with trainable fp32 weights, trains with AdamW under bf16 autocast
on random windows of the train tokens, keeps the weights of the best validation loss and writes an HF
checkpoint (config.json, model.safetensors in bf16, tokenizer with a ChatML template,
``training_log.json``). ``--time-budget-s`` fixes the step count from the measured speed of the first
steps and prints it: rerun with ``--steps N`` (same seed, same data) to reproduce the schedule.

The shipped default model (``svc_common/models/default``) is ``prepare`` on CPython 3.11.7 followed by
``train --device cuda --steps 700`` with the defaults below: 94 s on one H200 at ~0.97M tokens/s,
best validation loss 1.951 at step 600 (its ``training_log.json`` has the curve). GPU kernels are not
bit-deterministic, so a rerun matches the curve, not the bytes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.model import CausalLM
from engine.model_config import ModelConfig
from offline.tiny_model import SPECIAL_TOKENS
from offline.train_data import MAX_INT16_VOCAB, load_tokens, prepare


@dataclass(frozen=True)
class ModelShape:
    """Geometry of the trained model (Qwen3: q/k RMSNorm, GQA, SwiGLU, tied embeddings)."""

    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.head_dim % 16:
            raise ValueError(f"--head-dim must be a multiple of 16 for the NVFP4 cache (got {self.head_dim})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"--heads ({self.num_heads}) must be a multiple of --kv-heads ({self.num_kv_heads})"
            )
        if not 260 <= self.vocab_size <= MAX_INT16_VOCAB:
            raise ValueError(f"--vocab must be in [260, {MAX_INT16_VOCAB}] (got {self.vocab_size})")

    def hf_config(self) -> dict[str, Any]:
        eot = SPECIAL_TOKENS.index("<|endoftext|>")
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": 1e-6,
            "rope_theta": self.rope_theta, "rope_scaling": None, "tie_word_embeddings": True,
            "torch_dtype": "bfloat16", "attention_bias": False, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": self.num_layers, "bos_token_id": eot,
            "eos_token_id": eot, "initializer_range": 0.02, "use_cache": True,
        }


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 2048
    batch_size: int = 64  # sequences per step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.batch_size < 1:
            raise ValueError(
                f"--seq-len must be >= 2 and --batch-size >= 1 (got {self.seq_len}, {self.batch_size})"
            )
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(
                f"--lr must be > 0 and --min-lr-ratio in [0, 1] (got {self.lr}, {self.min_lr_ratio})"
            )


# -- stage 2: training ------------------------------------------------------------------------------------


def sdpa_attention(batch: int, seq_len: int) -> Callable:
    """AttnFn over a flat batch of ``batch`` sequences of ``seq_len`` tokens: causal SDPA with GQA."""

    def attn(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def heads_first(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, seq_len, x.shape[1], x.shape[2]).transpose(1, 2)

        qh, kh, vh = heads_first(q), heads_first(k), heads_first(v.to(q.dtype))
        kh = kh.to(q.dtype)
        group = q.shape[1] // k.shape[1]
        kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        return out.transpose(1, 2).reshape(q.shape)

    return attn


def build_model(shape: ModelShape, device: torch.device, seed: int) -> CausalLM:
    """``CausalLM`` with trainable fp32 weights: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
    torch.manual_seed(seed)
    # the PyTorch ops: the fused Triton kernels have no backward, and under autocast their inputs are bf16
    # activations beside fp32 norm weights
    model = CausalLM(ModelConfig.from_dict(shape.hf_config()), dtype=torch.float32, device=device,
                     fused_ops=False)
    residual_std = 0.02 / math.sqrt(2 * shape.num_layers)
    for name, p in model.named_parameters():
        p.requires_grad_(True)
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, residual_std)
            else:
                p.normal_(0.0, 0.02)
    return model


def lm_loss(model: CausalLM, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Mean next-token cross entropy of ``tokens [B, S+1]``."""
    b, s1 = tokens.shape
    s = s1 - 1
    tokens = tokens.to(device, non_blocking=True)
    ids = tokens[:, :-1].reshape(-1)
    positions = torch.arange(s, device=device).repeat(b)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        hidden = model(ids, positions, sdpa_attention(b, s))
        logits = model.compute_logits(hidden)
    return F.cross_entropy(logits.float(), tokens[:, 1:].reshape(-1))


def _windows(tokens: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return torch.stack([tokens[i : i + length] for i in starts.tolist()])


def _lr_at(step: int, total: int, tc: TrainConfig) -> float:
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, total - tc.warmup_steps))
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def eval_loss(model: CausalLM, tokens: torch.Tensor, tc: TrainConfig, device: torch.device) -> float:
    """Mean loss over fixed, evenly spaced windows (the same windows at every evaluation)."""
    n = min(tc.eval_batches * tc.batch_size, max(1, (tokens.numel() - 1) // (tc.seq_len + 1)))
    span = tokens.numel() - tc.seq_len - 1
    starts = torch.linspace(0, max(0, span), n).long()
    losses = []
    for i in range(0, n, tc.batch_size):
        losses.append(
            float(lm_loss(model, _windows(tokens, starts[i : i + tc.batch_size], tc.seq_len + 1), device))
        )
    return sum(losses) / len(losses)


def train(
    data_dir: str | Path,
    out_dir: str | Path,
    shape: ModelShape = ModelShape(),
    tc: TrainConfig = TrainConfig(),
    steps: int | None = None,
    time_budget_s: float | None = None,
    device: str = "auto",
    log: Callable[[str], None] = print,
    command: str | None = None,
) -> dict[str, Any]:
    """Train on ``data_dir`` (from ``prepare``) and write the checkpoint to ``out_dir``; returns the log."""
    if (steps is None) == (time_budget_s is None):
        raise ValueError("give exactly one of --steps and --time-budget-s")
    data_dir = Path(data_dir)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    if manifest["vocab_size"] > shape.vocab_size:
        raise ValueError(
            f"the tokenizer in {data_dir} has {manifest['vocab_size']} ids; --vocab is {shape.vocab_size}"
        )
    if tc.seq_len > shape.max_position_embeddings:
        raise ValueError(
            f"--seq-len {tc.seq_len} exceeds --max-position-embeddings {shape.max_position_embeddings}"
        )
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    train_tokens, val_tokens = load_tokens(data_dir, "train"), load_tokens(data_dir, "validation")
    if train_tokens.numel() <= tc.seq_len + 1:
        raise ValueError(f"{train_tokens.numel()} train tokens cannot fill one window of {tc.seq_len + 1}")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(shape, dev, tc.seed)
    num_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=dev.type == "cuda",
    )
    gen = torch.Generator().manual_seed(tc.seed)
    log(f"model: {num_params / 1e6:.2f}M parameters, {shape}; {train_tokens.numel()} train tokens on {dev}")

    total = steps if steps is not None else 10**9
    curve: list[dict[str, float]] = []
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None
    tokens_per_step = tc.batch_size * tc.seq_len
    t0 = time.perf_counter()
    t_measure = 0.0
    step = 0
    while step < total:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, total, tc)
        starts = torch.randint(0, train_tokens.numel() - tc.seq_len - 1, (tc.batch_size,), generator=gen)
        loss = lm_loss(model, _windows(train_tokens, starts, tc.seq_len + 1), dev)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        step += 1
        if step == 3:
            _sync(dev)
            t_measure = time.perf_counter()
        if time_budget_s is not None and step == 13:
            _sync(dev)
            per_step = (time.perf_counter() - t_measure) / 10
            overhead = 1.0 + 0.5 * tc.eval_batches / tc.eval_every  # evaluation steps cost forward passes
            total = max(step + 1, int(time_budget_s / (per_step * overhead)))
            log(
                f"{per_step * 1e3:.1f} ms/step -> {total} steps in the {time_budget_s:.0f} s budget "
                f"(reproduce with --steps {total})"
            )
        if step % tc.eval_every == 0 or step == total:
            val = eval_loss(model, val_tokens, tc, dev)
            elapsed = time.perf_counter() - t0
            curve.append(
                {
                    "step": step,
                    "train_loss": round(loss.item(), 4),
                    "val_loss": round(val, 4),
                    "elapsed_s": round(elapsed, 1),
                }
            )
            log(
                f"step {step:5d}  train {loss.item():.3f}  val {val:.3f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  "
                f"{step * tokens_per_step / elapsed:,.0f} tok/s"
            )
            if best is None or val < best[0]:
                best = (val, step, copy.deepcopy({k: v.detach() for k, v in model.state_dict().items()}))
    _sync(dev)
    elapsed = time.perf_counter() - t0
    assert best is not None
    model.load_state_dict(best[2])
    summary = {
        "command": command,
        "shape": asdict(shape),
        "train": asdict(tc),
        "steps": total,
        "best_step": best[1],
        "best_val_loss": round(best[0], 4),
        "num_params": num_params,
        "tokens_seen": total * tokens_per_step,
        "tokens_per_s": round(total * tokens_per_step / elapsed),
        "elapsed_s": round(elapsed, 1),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "data": manifest,
        "curve": curve,
    }
    export_checkpoint(model, shape, data_dir, Path(out_dir), summary)
    log(
        f"done: {total} steps, {summary['tokens_seen'] / 1e6:.1f}M tokens, "
        f"{summary['tokens_per_s']:,} tok/s, "
        f"best val loss {best[0]:.3f} at step {best[1]}; checkpoint in {out_dir}"
    )
    return summary


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def export_checkpoint(
    model: CausalLM,
    shape: ModelShape,
    data_dir: Path,
    out: Path,
    summary: dict[str, Any],
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write the HF checkpoint: fused parameters are split back into HF tensor names."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    tensors = {}
    for hf_name, (param_name, start, stop) in model.checkpoint_targets().items():
        t = params[param_name].detach()
        t = t if start is None else t[start:stop]
        tensors[hf_name] = t.to("cpu", dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = shape.hf_config()
    config["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": [config["eos_token_id"]]}, indent=2
        )
        + "\n"
    )
    shutil.copyfile(data_dir / "tokenizer.json", out / "tokenizer.json")
    tok_cfg = json.loads((data_dir / "tokenizer_config.json").read_text())
    tok_cfg["model_max_length"] = shape.max_position_embeddings
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "training_log.json").write_text(json.dumps(summary, indent=1) + "\n")


# -- CLI --------------------------------------------------------------------------------------------------


def _add_train_args(p: argparse.ArgumentParser) -> None:
    s, t = ModelShape(), TrainConfig()
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="pick the step count from the measured speed (printed: rerun with --steps N)")
    for flag, default in [("--hidden", s.hidden_size), ("--intermediate", s.intermediate_size),
                          ("--layers", s.num_layers), ("--heads", s.num_heads),
                          ("--kv-heads", s.num_kv_heads), ("--head-dim", s.head_dim),
                          ("--max-position-embeddings", s.max_position_embeddings),
                          ("--seq-len", t.seq_len), ("--batch-size", t.batch_size),
                          ("--warmup-steps", t.warmup_steps), ("--eval-every", t.eval_every),
                          ("--eval-batches", t.eval_batches), ("--seed", t.seed)]:
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--weight-decay", type=float, default=t.weight_decay)


def _configs(a: argparse.Namespace, vocab: int) -> tuple[ModelShape, TrainConfig]:
    shape = ModelShape(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                       num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                       max_position_embeddings=a.max_position_embeddings)
    tc = TrainConfig(seq_len=a.seq_len, batch_size=a.batch_size, lr=a.lr, warmup_steps=a.warmup_steps,
                     weight_decay=a.weight_decay, eval_every=a.eval_every, eval_batches=a.eval_batches,
                     seed=a.seed)
    return shape, tc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        "python -m offline.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_prep = sub.add_parser("prepare", help="tokenizer + token ids of the stdlib corpus")
    p_prep.add_argument("--out", required=True)
    p_prep.add_argument("--vocab", type=int, default=ModelShape.vocab_size)
    p_train = sub.add_parser("train", help="train on a prepared data directory")
    p_train.add_argument("--data", required=True)
    p_train.add_argument("--out", required=True)
    _add_train_args(p_train)
    p_all = sub.add_parser("all", help="prepare into OUT/data, then train into OUT")
    p_all.add_argument("--out", required=True)
    p_all.add_argument("--vocab", type=int, default=ModelShape.vocab_size)
    _add_train_args(p_all)
    a = parser.parse_args(argv)
    if a.cmd == "prepare":
        print(json.dumps(prepare(a.out, a.vocab), indent=2))
        return 0
    data = Path(a.data) if a.cmd == "train" else Path(a.out) / "data"
    if a.cmd == "all":
        prepare(data, a.vocab)
    shape, tc = _configs(a, json.loads((data / "manifest.json").read_text())["vocab_size"])
    train(
        data,
        a.out,
        shape,
        tc,
        steps=a.steps,
        time_budget_s=a.time_budget_s,
        device=a.device,
        command="python -m offline.train " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
