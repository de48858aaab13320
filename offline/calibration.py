"""The calibration tool: run text through the model and record amax of K and V per layer.

It writes the scales file ``engine.kv_scales`` defines and loads (its format is documented there).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.kv_rotation import KV_ROTATIONS, head_rotation
from engine.kv_scales import KVScales
from engine.model import AttnFn, causal_attention_no_cache


class AmaxRecorder:
    """Wraps an ``AttnFn`` and keeps the running max of |K| and |V| per layer (K after norm and RoPE)."""

    def __init__(self, num_layers: int) -> None:
        self.k_amax = [0.0] * num_layers
        self.v_amax = [0.0] * num_layers

    def wrap(self, attn: AttnFn) -> AttnFn:
        def recording(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
                raise ValueError(f"layer {layer_id} produced non-finite K/V during calibration")
            self.k_amax[layer_id] = max(self.k_amax[layer_id], float(k.abs().max()))
            self.v_amax[layer_id] = max(self.v_amax[layer_id], float(v.abs().max()))
            return attn(layer_id, q, k, v)

        return recording


def default_calibration_text(num_tokens: int) -> tuple[str, str]:
    """(text, source): the start of the stdlib train split, about enough characters for ``num_tokens``."""
    from offline.corpus import split_text

    return split_text("train", max_chars=12 * num_tokens), "stdlib train split (offline.corpus)"


def calibrate(
    model_dir: str | Path,
    text: str | None = None,
    num_tokens: int = 16384,
    seq_len: int | None = None,
    device: str = "auto",
    dtype: str | None = None,
    source: str | None = None,
    kv_rotation: str = "none",
) -> KVScales:
    """Run up to ``num_tokens`` tokens of ``text`` through the model in windows of ``seq_len`` tokens
    (default: the model's context, at most 2048) and return the per-layer K/V amax.

    ``text`` None reads the stdlib train split. Attention is exact (fp32, no cache), so the scales
    describe the model's unquantized K/V; with ``kv_rotation`` the recorder sees K/V rotated as a server
    started with that ``--kv-rotation`` stores them.
    """
    from engine.loader import load_model
    from tokenization.tokenizer import Tokenizer

    if num_tokens < 1:
        raise ValueError(f"--num-tokens must be >= 1 (got {num_tokens})")
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    loaded = load_model(model_dir, device=dev, dtype=dtype)
    if text is None:
        text, default_source = default_calibration_text(num_tokens)
        source = source or default_source
    ids = Tokenizer.from_dir(model_dir).encode(text, add_special_tokens=False)[:num_tokens]
    if not ids:
        raise ValueError("the calibration text is empty after tokenization")
    window = min(seq_len or 2048, loaded.config.max_context_len)
    recorder = AmaxRecorder(loaded.config.num_hidden_layers)
    rotation = head_rotation(kv_rotation, loaded.config.head_dim, dev, loaded.model.dtype)
    if rotation is not None:
        loaded.model.rotate_kv(rotation)  # the amax of K/V as a server with this --kv-rotation stores them
    with torch.inference_mode():
        for start in range(0, len(ids), window):
            chunk = ids[start : start + window]
            attn = recorder.wrap(causal_attention_no_cache([len(chunk)]))
            loaded.model(torch.tensor(chunk, device=dev), torch.arange(len(chunk), device=dev), attn)
    return KVScales(
        loaded.fingerprint, tuple(recorder.k_amax), tuple(recorder.v_amax), len(ids), source or "user text",
        kv_rotation,
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    from svc_common.cli_help import HelpFormatter, add_version

    p = argparse.ArgumentParser(
        "nvfp4-serve calibrate", formatter_class=HelpFormatter,
        description="Write per-layer KV-cache global scales "
        "(nvfp4: amax / 2688, fp8: amax / 448) for `--kv-scales FILE`.",
    )
    add_version(p)
    p.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face hub id (default: the embedded model)")
    p.add_argument("--out", required=True, metavar="FILE", help="scales file to write (JSON)")
    p.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help="calibration text (default: the Python standard library's train split)",
    )
    p.add_argument("--num-tokens", type=int, default=16384, help="calibration tokens (default 16384)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per forward (default: context, <= 2048)")
    p.add_argument("--device", default="auto", help="cuda, cpu, or auto (cuda when PyTorch sees a GPU)")
    p.add_argument("--kv-rotation", default="none", choices=KV_ROTATIONS,
                   help="record the amax of K/V rotated as a server with this --kv-rotation stores them")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="model dtype (default: bfloat16 on CUDA, float32 on CPU)",
    )
    a = p.parse_args(argv)
    from svc_common.model_source import resolve_model

    try:
        a.model = resolve_model(a.model)  # a hub id becomes its cached snapshot; None the embedded model
        text = Path(a.data).read_text(encoding="utf-8") if a.data else None
        scales = calibrate(
            a.model,
            text,
            a.num_tokens,
            a.seq_len,
            a.device,
            a.dtype,
            source=f"file {a.data}" if a.data else None,
            kv_rotation=a.kv_rotation,
        )
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    scales.save(a.out)
    (nk, nv), (fk, fv) = scales.nvfp4_scales(), scales.fp8_scales()
    print(f"calibrated {scales.num_layers} layers on {scales.num_tokens} tokens ({scales.source}) -> {a.out}")
    for i in range(scales.num_layers):
        print(
            f"  layer {i:3d}  K amax {scales.k_amax[i]:10.4f} (nvfp4 {nk[i]:.3e}, fp8 {fk[i]:.3e})  "
            f"V amax {scales.v_amax[i]:10.4f} (nvfp4 {nv[i]:.3e}, fp8 {fv[i]:.3e})"
        )
    return 0
