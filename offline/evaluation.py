"""Accuracy of the quantized KV cache, measured through the engine's real paths on held-out text.

For each context length and each KV variant (bf16, fp8_e4m3 and nvfp4, each with global scales 1.0 or
calibrated, and nvfp4 with per-block scale selection, the Hadamard rotation, or both: ``VARIANTS``), a FRESH
``Engine`` runs windows of held-out
tokens (default: the held-out split of the stdlib corpus, see ``offline.corpus``):

    window = [ context (C tokens) | continuation (M tokens) ]
    teacher forcing: path 1 prefill of the context (FP8 attention for fp8/nvfp4, K/V quantized into the
        pool), then M-1 decode steps over the pool (path 3) fed the TRUE continuation tokens; the M
        next-token distributions give perplexity, KL(bf16 || variant) and top-1 agreement with bf16
    greedy: ``Engine.generate`` of G tokens from the context; agreement = common prefix with bf16's / G

plus the relative error of attention outputs when synthetic outlier-heavy K/V are stored in each format
(``offline.synthetic_kv``). ``nvfp4-serve eval`` writes the JSON and the markdown report
(``offline.evaluation_report``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.attention_paths import ExtendSeq
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.kv_scales import KVScales
from engine.model import AttnFn
from engine.sampling import SamplingParams
from offline.calibration import AmaxRecorder
from offline.evaluation_report import mean_se, render_markdown
from offline.synthetic_kv import synthetic_attention_error


@dataclass(frozen=True)
class KVVariant:
    name: str
    kv_dtype: str
    calibrated: bool = False
    block_select: bool = False
    # nvfp4 only: calibrated pool scales but FP8 workspace (prefill attention) scales left at 1.0
    pool_only: bool = False
    kv_rotation: str = "none"  # --kv-rotation (calibrated variants take scales calibrated under it)


VARIANTS = (
    KVVariant("bf16", "bf16"),
    KVVariant("fp8_e4m3 (scale 1.0)", "fp8_e4m3"),
    KVVariant("fp8_e4m3 calibrated", "fp8_e4m3", calibrated=True),
    KVVariant("nvfp4 (scale 1.0)", "nvfp4"),
    KVVariant("nvfp4 (scale 1.0) + rotation", "nvfp4", kv_rotation="hadamard"),
    KVVariant("nvfp4 (scale 1.0) + rotation + block select", "nvfp4", block_select=True, kv_rotation="hadamard"),
    KVVariant("nvfp4 calibrated pool, workspace 1.0", "nvfp4", calibrated=True, pool_only=True),
    KVVariant("nvfp4 calibrated", "nvfp4", calibrated=True),
    KVVariant("nvfp4 calibrated + block select", "nvfp4", calibrated=True, block_select=True),
    KVVariant("nvfp4 calibrated + rotation", "nvfp4", calibrated=True, kv_rotation="hadamard"),
    KVVariant("nvfp4 calibrated + rotation + block select", "nvfp4", calibrated=True, block_select=True,
              kv_rotation="hadamard"),
)


@dataclass(frozen=True)
class ContextSpec:
    name: str
    context_len: int
    num_windows: int

    def __post_init__(self) -> None:
        if self.context_len < 1 or self.num_windows < 1:
            raise ValueError(f"context {self.name!r}: context_len and num_windows must be >= 1")


@dataclass(frozen=True)
class EvalConfig:
    model_dir: str
    contexts: tuple[ContextSpec, ...] = (ContextSpec("short", 128, 32), ContextSpec("long", 1920, 8))
    continuation_tokens: int = 64  # M: teacher-forced next-token predictions per window
    greedy_tokens: int = 32  # G
    page_size: int = 16
    device: str = "cpu"
    dtype: str = "float32"
    variants: tuple[KVVariant, ...] = field(default=VARIANTS)

    def __post_init__(self) -> None:
        if self.continuation_tokens < 1 or self.greedy_tokens < 1:
            raise ValueError("--continuation-tokens and --greedy-tokens must be >= 1")
        if not self.variants or self.variants[0].kv_dtype != "bf16":
            raise ValueError(
                "the first variant must be the bf16 baseline (KL and agreement are measured against it)"
            )


def make_engine(
    cfg: EvalConfig, variant: KVVariant, scales: KVScales, pool_tokens: int, chunk: int
) -> Engine:
    """A fresh engine for ``variant``; uncalibrated variants get explicit 1.0 scales, not the checkpoint's.
    A calibrated variant needs ``scales`` recorded under its ``kv_rotation``."""
    n = scales.num_layers
    if variant.calibrated and scales.kv_rotation != variant.kv_rotation:
        raise ValueError(f"variant {variant.name!r} runs --kv-rotation {variant.kv_rotation} but its scales were "
                         f"calibrated under {scales.kv_rotation}")
    if variant.calibrated:
        kw = scales.cache_scales(variant.kv_dtype)
        if variant.pool_only:
            kw.update(ws_k_scales=(1.0,) * n, ws_v_scales=(1.0,) * n)
    elif variant.kv_dtype == "bf16":
        kw = {}
    else:
        kw = {"k_scales": (1.0,) * n, "v_scales": (1.0,) * n}
        if variant.kv_dtype == "nvfp4":
            kw.update(ws_k_scales=(1.0,) * n, ws_v_scales=(1.0,) * n)
    cache = CacheConfig(
        kv_dtype=variant.kv_dtype, kv_rotation=variant.kv_rotation, page_size=cfg.page_size,
        max_total_tokens=pool_tokens, **kw
    )
    engine = Engine(
        EngineConfig(
            model_dir=cfg.model_dir,
            device=cfg.device,
            dtype=cfg.dtype,
            attention_backend="reference-block-select" if variant.block_select else "reference",
            cache=cache,
            scheduler=SchedulerConfig(chunk_size=chunk),
        )
    )
    return engine


@torch.inference_mode()
def teacher_forced_logprobs(
    engine: Engine, windows: Sequence[Sequence[int]], context_len: int, recorder: AmaxRecorder | None = None
) -> torch.Tensor:
    """log-probs ``[N, M, V]`` (fp32, CPU) of tokens ``context_len .. context_len+M-1`` of each window.

    Step 0 comes from the prefill of the context (path 1); step t >= 1 from a decode step over the pool
    (path 3) fed the window's true token at position context_len + t - 1. Pages come straight from the
    allocator and go back to it: nothing enters the radix cache. ``recorder`` sees every K/V written.
    """

    def hooked(attn: AttnFn) -> AttnFn:
        return attn if recorder is None else recorder.wrap(attn)

    n, length = len(windows), len(windows[0])
    cont = length - context_len
    if cont < 1 or any(len(w) != length for w in windows):
        raise ValueError("windows must share one length, longer than the context")
    page, dev, model = engine.config.cache.page_size, engine.device, engine.model
    pages = [engine.allocator.allocate(math.ceil(length / page)) for _ in windows]
    out = torch.empty(n, cont, model.config.vocab_size)
    try:
        for i, (w, p) in enumerate(zip(windows, pages)):
            attn = hooked(engine.paths.extend([ExtendSeq(p, 0, context_len)]))
            hidden = model(
                torch.tensor(w[:context_len], device=dev), torch.arange(context_len, device=dev), attn
            )
            out[i, 0] = torch.log_softmax(model.compute_logits(hidden[-1:]), dim=-1)[0].cpu()
        table = torch.tensor(pages, dtype=torch.int32, device=dev)
        for t in range(1, cont):
            pos = context_len + t - 1
            ids = torch.tensor([w[pos] for w in windows], device=dev)
            seq_lens = torch.full((n,), pos + 1, dtype=torch.int32, device=dev)
            slots = torch.cat([engine.pool.slots_for(p, pos, pos + 1) for p in pages]).to(dev)
            attn = hooked(engine.paths.decode(table, seq_lens, slots, engine.model.dtype))
            hidden = model(ids, torch.full((n,), pos, device=dev), attn)
            out[:, t] = torch.log_softmax(model.compute_logits(hidden), dim=-1).cpu()
    finally:
        for p in pages:
            engine.allocator.decref(p)
    return out


def greedy_continuations(
    engine: Engine, prompts: Sequence[Sequence[int]], num_tokens: int
) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return [o.token_ids for o in engine.generate([list(p) for p in prompts], sp)]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(
    lp: torch.Tensor,
    targets: torch.Tensor,
    base_lp: torch.Tensor,
    greedy: list[list[int]],
    base_greedy: list[list[int]],
) -> dict[str, float]:
    """Metrics of one variant against the targets and the bf16 baseline (``lp``: [N, M, V] log-probs)."""
    nll = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    base_nll = -base_lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    kl = (base_lp.exp() * (base_lp - lp)).sum(-1)
    kl_mean, kl_se = mean_se(kl.mean(1))
    dnll, dnll_se = mean_se((nll - base_nll).mean(1))
    prefix = [_common_prefix(g, b) / max(1, len(b)) for g, b in zip(greedy, base_greedy)]
    return {
        "perplexity": math.exp(float(nll.mean())),
        "nll": float(nll.mean()),
        "nll_delta_vs_bf16": dnll,
        "nll_delta_vs_bf16_se": dnll_se,
        "kl_vs_bf16": kl_mean,
        "kl_vs_bf16_se": kl_se,
        "kl_vs_bf16_p99": float(kl.flatten().quantile(0.99)),
        "top1_agreement": float((lp.argmax(-1) == base_lp.argmax(-1)).float().mean()),
        "greedy_agreement": sum(prefix) / len(prefix),
        "greedy_identical": sum(p == 1.0 for p in prefix) / len(prefix),
        "kl_per_window": [float(x) for x in kl.mean(1)],
    }


def evaluate_context(
    cfg: EvalConfig,
    spec: ContextSpec,
    token_ids: Sequence[int],
    scales: KVScales,
    log: Callable[[str], None] = print,
    rotated_scales: KVScales | None = None,
) -> dict[str, Any]:
    """Every variant on ``spec.num_windows`` non-overlapping windows spread evenly over ``token_ids``;
    ``rotated_scales`` (calibrated under --kv-rotation hadamard) serve the calibrated rotated variants."""
    length = spec.context_len + cfg.continuation_tokens
    num = min(spec.num_windows, len(token_ids) // length)
    if num < 1:
        raise ValueError(
            f"context {spec.name!r} needs {length} tokens per window; the text has {len(token_ids)}"
        )
    stride = len(token_ids) // num  # >= length
    windows = [list(token_ids[i * stride : i * stride + length]) for i in range(num)]
    targets = torch.tensor([w[spec.context_len :] for w in windows])
    pool_tokens = num * (length + cfg.greedy_tokens + 4 * cfg.page_size)
    base_lp: torch.Tensor | None = None
    base_greedy: list[list[int]] = []
    rows = []
    recorder = AmaxRecorder(scales.num_layers)  # K/V amax of these windows, seen by the bf16 baseline
    for variant in cfg.variants:
        t0 = time.perf_counter()
        own = rotated_scales if variant.kv_rotation != "none" and rotated_scales is not None else scales
        engine = make_engine(cfg, variant, own, pool_tokens, chunk=spec.context_len)
        lp = teacher_forced_logprobs(engine, windows, spec.context_len, recorder if base_lp is None else None)
        greedy = greedy_continuations(engine, [w[: spec.context_len] for w in windows], cfg.greedy_tokens)
        engine.check_integrity()
        if base_lp is None:
            base_lp, base_greedy = lp, greedy
        row = {
            "variant": variant.name,
            **asdict(variant),
            **compare(lp, targets, base_lp, greedy, base_greedy),
        }
        rows.append(row)
        log(
            f"  {spec.name:6s} {variant.name:34s} ppl {row['perplexity']:8.4f}  KL {row['kl_vs_bf16']:.2e}  "
            f"top1 {row['top1_agreement']:.4f}  greedy {row['greedy_agreement']:.3f}  "
            f"({time.perf_counter() - t0:.0f} s)"
        )
    return {
        "name": spec.name,
        "context_len": spec.context_len,
        "num_windows": num,
        "continuation_tokens": cfg.continuation_tokens,
        "greedy_tokens": cfg.greedy_tokens,
        "num_predictions": num * cfg.continuation_tokens,
        "window_stride": stride,
        "amax": {"k": recorder.k_amax, "v": recorder.v_amax},
        "rows": rows,
    }


def evaluate(
    cfg: EvalConfig,
    scales: KVScales,
    text: str | None = None,
    text_source: str | None = None,
    log: Callable[[str], None] = print,
    rotated_scales: KVScales | None = None,
) -> dict[str, Any]:
    """Every context of ``cfg`` on ``text`` (default: the held-out stdlib split) and the synthetic errors."""
    from engine.loader import model_fingerprint
    from engine.model_config import ModelConfig
    from offline.corpus import split_text
    from tokenization.tokenizer import Tokenizer

    mc = ModelConfig.from_dir(cfg.model_dir)
    fingerprint = model_fingerprint(cfg.model_dir)
    if scales.model_fingerprint != fingerprint:
        raise ValueError(
            f"the KV scales were calibrated for model {scales.model_fingerprint}, "
            f"not for {cfg.model_dir} ({fingerprint})"
        )
    if text is None:
        text, text_source = split_text("held_out"), "stdlib held-out split (offline.corpus)"
    ids = Tokenizer.from_dir(cfg.model_dir).encode(text, add_special_tokens=False)
    contexts = []
    for spec in cfg.contexts:
        longest = mc.max_context_len - cfg.continuation_tokens - cfg.greedy_tokens
        if spec.context_len > longest:
            log(
                f"context {spec.name!r}: {spec.context_len} tokens do not fit the model's "
                f"{mc.max_context_len} "
                f"with the continuation; using {longest}"
            )
            spec = ContextSpec(spec.name, longest, spec.num_windows)
        contexts.append(evaluate_context(cfg, spec, ids, scales, log, rotated_scales))
    return {
        "model": {
            "dir": str(cfg.model_dir),
            "fingerprint": fingerprint,
            "architecture": mc.architecture,
            "num_layers": mc.num_hidden_layers,
            "num_kv_heads": mc.num_key_value_heads,
            "head_dim": mc.head_dim,
            "max_context_len": mc.max_context_len,
        },
        "data": {"source": text_source or "user text", "num_tokens": len(ids)},
        "compute": {
            "device": cfg.device,
            "dtype": cfg.dtype,
            "torch": torch.__version__,
            "attention_backend": "reference",
        },
        "calibration": {
            "num_tokens": scales.num_tokens,
            "source": scales.source,
            "k_amax": list(scales.k_amax),
            "v_amax": list(scales.v_amax),
            **({"rotated_k_amax": list(rotated_scales.k_amax), "rotated_v_amax": list(rotated_scales.v_amax)}
               if rotated_scales is not None else {}),
        },
        "contexts": contexts,
        "synthetic_attention_error": synthetic_attention_error(),
    }


def _scales_for(a: argparse.Namespace, path: str | None, kv_rotation: str, flag: str) -> KVScales:
    """The scales file ``path`` (checked: this model, calibrated under ``kv_rotation``), or calibrate now."""
    if path:
        from engine.loader import model_fingerprint

        scales = KVScales.load(path, model_fingerprint(a.model))
        if scales.kv_rotation != kv_rotation:
            raise ValueError(f"{flag} {path} was calibrated with --kv-rotation {scales.kv_rotation}, "
                             f"{flag} needs --kv-rotation {kv_rotation}")
        return scales
    from offline.calibration import calibrate

    print(f"no {flag}: calibrating (--kv-rotation {kv_rotation}) on {a.calibration_tokens} tokens of the "
          "stdlib train split")
    return calibrate(a.model, num_tokens=a.calibration_tokens, device=a.device, dtype=a.dtype,
                     kv_rotation=kv_rotation)


def main(argv: list[str] | None = None) -> int:
    from svc_common.cli_help import HelpFormatter, add_version

    p = argparse.ArgumentParser(
        "nvfp4-serve eval", description=__doc__, formatter_class=HelpFormatter
    )
    add_version(p)
    p.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face hub id (default: the embedded model)")
    p.add_argument(
        "--kv-scales",
        default=None,
        metavar="FILE",
        help="calibrated scales (default: calibrate now on the stdlib train split)",
    )
    p.add_argument(
        "--data", default=None, metavar="FILE", help="evaluation text (default: stdlib held-out split)"
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    p.add_argument("--markdown", default=None, metavar="FILE", help="write the tables here")
    p.add_argument("--short-context", type=int, default=128, help="tokens of context of each short window")
    p.add_argument("--short-windows", type=int, default=32, help="short windows evaluated")
    p.add_argument("--long-context", type=int, default=1920, help="tokens of context of each long window")
    p.add_argument("--long-windows", type=int, default=8, help="long windows evaluated")
    p.add_argument("--continuation-tokens", type=int, default=EvalConfig.continuation_tokens,
                   help="teacher-forced next-token predictions per window (perplexity, KL)")
    p.add_argument("--greedy-tokens", type=int, default=EvalConfig.greedy_tokens,
                   help="greedy tokens per window compared with the bf16 cache's")
    p.add_argument("--kv-scales-rotated", default=None, metavar="FILE",
                   help="scales calibrated with --kv-rotation hadamard, for the rotated variants (default: "
                        "calibrate them now on the stdlib train split)")
    p.add_argument("--calibration-tokens", type=int, default=16384,
                   help="tokens calibrated on when no --kv-scales (--kv-scales-rotated) file is given")
    p.add_argument("--device", default="cpu", help="cuda or cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model weights and activations")
    a = p.parse_args(argv)
    from svc_common.model_source import resolve_model

    try:
        a.model = resolve_model(a.model)  # a hub id becomes its cached snapshot; None the embedded model
        scales = _scales_for(a, a.kv_scales, "none", "--kv-scales")
        rotated = _scales_for(a, a.kv_scales_rotated, "hadamard", "--kv-scales-rotated")
        cfg = EvalConfig(
            model_dir=a.model,
            contexts=(
                ContextSpec("short", a.short_context, a.short_windows),
                ContextSpec("long", a.long_context, a.long_windows),
            ),
            continuation_tokens=a.continuation_tokens,
            greedy_tokens=a.greedy_tokens,
            device=a.device,
            dtype=a.dtype,
        )
        text = Path(a.data).read_text(encoding="utf-8") if a.data else None
        results = evaluate(cfg, scales, text, text_source=a.data, rotated_scales=rotated)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    md = render_markdown(results)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(md)
    print(md)
    return 0
