"""lm-eval-harness through the server: each KV-cache variant served by ``nvfp4-serve up`` and scored by lm-eval's
``local-completions`` model, the way a user checks a deployment.

    python -m benchmarks.accuracy.lm_eval_kv [--model DIR] [--docs 48] [--doc-tokens 512] [--chunk 32] \\
        --out docs/benchmarks/lm_eval.json --md docs/benchmarks/lm_eval.md

The task is a local ``loglikelihood_rolling`` task (written here; no downloads) over ``--docs`` windows of the
stdlib held-out split (offline.corpus), ``--doc-tokens`` tokens each. lm-eval scores a document by echoing it
as a prompt: the server prefills it in chunks of ``--chunk`` tokens, and every chunk attends to the earlier ones
read back from the KV cache, stored in the variant's format. So a small chunk puts nearly every scored token
behind cached K/V, as decode and prefix hits do; one chunk per document would score the FP8 workspace only.
Per variant: lm-eval's own aggregates (word and byte perplexity, bits per byte) and, from its logged samples,
bits per byte per document, mean ± standard error over documents, and the paired difference from bf16's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.serving.launch import LaunchedDeployment
from offline.evaluation_report import mean_se

DEFAULT_MODEL = str(Path(__file__).resolve().parents[2] / "svc_common" / "models" / "default")
TASK = "nvfp4_kv_rolling"
_TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


@dataclass(frozen=True)
class Variant:
    name: str
    kv_dtype: str
    calibrated: bool = False
    rotation: str = "none"
    block_select: bool = False


VARIANTS = (
    Variant("bf16", "bf16"),
    Variant("fp8_e4m3 (scale 1.0)", "fp8_e4m3"),
    Variant("fp8_e4m3 calibrated", "fp8_e4m3", calibrated=True),
    Variant("nvfp4 (scale 1.0)", "nvfp4"),
    Variant("nvfp4 calibrated + rotation + block select", "nvfp4", calibrated=True, rotation="hadamard",
            block_select=True),
)


def documents(model_dir: str, num_docs: int, doc_tokens: int) -> list[str]:
    """``num_docs`` windows of ``doc_tokens`` tokens, evenly spaced over the held-out split, as text."""
    from offline.corpus import split_text
    from tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(split_text("held_out"), add_special_tokens=False)
    if len(ids) < num_docs * doc_tokens:
        raise SystemExit(f"the held-out split has {len(ids)} tokens, fewer than --docs x --doc-tokens")
    step = len(ids) // num_docs
    return [tok.decode(ids[i * step: i * step + doc_tokens]) for i in range(num_docs)]


def up_args(v: Variant, model_dir: str, scales: dict[str, str], chunk: int, context: int, device: str) -> list[str]:
    args = ["--model", model_dir, "--num-prefill", "0", "--kv-cache-dtype", v.kv_dtype, "--kv-rotation", v.rotation,
            "--chunked-prefill-size", str(chunk), "--context-length", str(context), "--device", device]
    if v.calibrated:
        args += ["--kv-scales", scales[v.rotation]]
    if v.block_select:
        args += ["--attention-backend", "triton-block-select" if device == "cuda" else "reference-block-select"]
    return args


def score(base_url: str, model_dir: str, task_dir: str, context: int) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of the local task against a running deployment."""
    import httpx
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_id = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
    return lm_eval.simple_evaluate(
        model="local-completions", tasks=[TASK], task_manager=TaskManager(include_path=task_dir), log_samples=True,
        model_args=f"model={model_id},base_url={base_url}/v1/completions,tokenizer={model_dir},"
                   f"tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1,"
                   f"max_length={context}")


def summarize(name: str, out: dict[str, Any], docs: list[str]) -> dict[str, Any]:
    """lm-eval's aggregates and bits per byte per document (from its samples, in document order)."""
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    if [s["doc_id"] for s in samples] != list(range(len(docs))):
        raise RuntimeError(f"{name}: lm-eval logged {len(samples)} samples for {len(docs)} documents")
    bpb = [-float(s["filtered_resps"][0]) / (len(d.encode()) * math.log(2)) for s, d in zip(samples, docs)]
    agg = out["results"][TASK]
    row = {"variant": name, "bits_per_byte_per_doc": bpb}
    row["bits_per_byte"], row["bits_per_byte_se"] = mean_se(torch.tensor(bpb, dtype=torch.float64))
    for key in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        row[f"lm_eval_{key}"] = float(agg[f"{key},none"])
    return row


def add_paired(rows: list[dict[str, Any]]) -> None:
    base = rows[0]["bits_per_byte_per_doc"]
    for r in rows:
        r["bpb_delta_vs_bf16"], r["bpb_delta_vs_bf16_se"] = mean_se(
            torch.tensor(r["bits_per_byte_per_doc"], dtype=torch.float64) - torch.tensor(base, dtype=torch.float64))


def render(doc: dict[str, Any]) -> str:
    lines = [f"# lm-eval-harness through the server ({doc['model']})", "",
             (f"Command: `{doc['command']}`. {doc['num_docs']} documents of {doc['doc_tokens']} tokens from the "
             f"stdlib held-out split, a local `loglikelihood_rolling` task scored by lm-eval {doc['lm_eval']}'s "
             f"`local-completions` against `nvfp4-serve up --num-prefill 0` on {doc['device']}, prefilled in chunks "
             f"of {doc['chunk']} tokens: every chunk attends to the earlier ones read back from the KV cache in "
             "the variant's format. Bits per byte per document: mean ± standard error over documents; the paired "
             "difference from bf16's over the same documents. \"calibrated\": scales from `nvfp4-serve "
             "calibrate` (under the rotation where the variant rotates)."), "",
             ("| KV cache | bits per byte (mean ± se) | - bf16's (paired, ± se) | lm-eval word perplexity "
             "| lm-eval byte perplexity | lm-eval bits per byte | serve s |"),
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        lines.append(f"| {r['variant']} | {r['bits_per_byte']:.5f} ± {r['bits_per_byte_se']:.5f} | "
                     f"{r['bpb_delta_vs_bf16']:+.5f} ± {r['bpb_delta_vs_bf16_se']:.5f} | "
                     f"{r['lm_eval_word_perplexity']:.4f} | {r['lm_eval_byte_perplexity']:.5f} | "
                     f"{r['lm_eval_bits_per_byte']:.5f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def _calibrate(model_dir: str, device: str, tmp: str) -> dict[str, str]:
    from offline.calibration import calibrate

    paths = {}
    for rotation in ("none", "hadamard"):
        path = os.path.join(tmp, f"scales-{rotation}.json")
        calibrate(model_dir, None, device=device, kv_rotation=rotation).save(path)
        paths[rotation] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("python -m benchmarks.accuracy.lm_eval_kv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--docs", type=int, default=48)
    p.add_argument("--doc-tokens", type=int, default=512)
    p.add_argument("--chunk", type=int, default=32, help="--chunked-prefill-size of the served deployment")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS],
                   help="a subset of the variants, by name (bf16 first: the others are set against it)")
    p.add_argument("--out", default="docs/benchmarks/lm_eval.json")
    p.add_argument("--md", default="docs/benchmarks/lm_eval.md")
    a = p.parse_args(argv)
    for flag, value in (("--docs", a.docs), ("--doc-tokens", a.doc_tokens), ("--chunk", a.chunk)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    by_name = {v.name: v for v in VARIANTS}
    if a.variants[0] != "bf16" or any(n not in by_name for n in a.variants):
        p.error(f"--variants: names of {list(by_name)}, bf16 first")
    try:
        import lm_eval
    except ImportError:
        raise SystemExit("lm-eval-harness is not installed: pip install -e .[eval]") from None
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    docs = documents(a.model, a.docs, a.doc_tokens)
    context = 2 * a.doc_tokens  # lm-eval's rolling windows: one per document
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_DATASETS_CACHE"] = os.path.join(tmp, "datasets")
        data = Path(tmp) / "docs.jsonl"
        data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        (Path(tmp) / "task.yaml").write_text(_TASK_YAML.format(task=TASK, data=data))
        scales = _calibrate(a.model, a.device, tmp) if any(by_name[n].calibrated for n in a.variants) else {}
        for name in a.variants:
            v = by_name[name]
            t0 = time.perf_counter()
            with LaunchedDeployment(up_args(v, a.model, scales, a.chunk, context, a.device),
                                    Path(tmp) / f"up-{len(rows)}.log") as dep:
                out = score(dep.base_url, a.model, tmp, context)
            rows.append({**summarize(name, out, docs), "seconds": time.perf_counter() - t0})
            print(f"{name}: bits per byte {rows[-1]['bits_per_byte']:.5f}", file=sys.stderr, flush=True)
    add_paired(rows)
    doc = {"model": a.model if a.model != DEFAULT_MODEL else "the embedded model", "device": a.device,
           "lm_eval": lm_eval.__version__, "num_docs": a.docs, "doc_tokens": a.doc_tokens, "chunk": a.chunk,
           "command": " ".join(["python -m benchmarks.accuracy.lm_eval_kv", *(argv or sys.argv[1:])]), "rows": rows}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    md = render(doc)
    Path(a.md).write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
