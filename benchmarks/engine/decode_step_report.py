"""bench_decode_step's tables: the markdown of docs/benchmarks/engine_decode*.md (``write_md``, also re-rendered
from a JSON with ``--render``) and the printed table (``print_table``), from the rows ``run_shape`` measured."""

from __future__ import annotations

CATEGORY_NAMES = {"gemm": "GEMM", "attention": "attention incl. merge", "kv_write": "K/V write",
                  "norm_rope_act": "norms + rope + activation", "other": "other"}

_COLUMNS_DOC = (
    "One whole decode step (`ModelRunner.decode_logits`: every layer, K/V write, attention, logits) over B "
    "sequences of L cached tokens; the pool holds random valid K/V bytes (no prefill). `graph` = the step replayed "
    "as a CUDA graph, `eager` = the same step without graphs. `attention (graph)` = the decode of all layers alone "
    "(no model, no K/V write) over the same pages, the loop over layers captured as one CUDA graph on a static plan "
    "of the step's table width, as the step's graph runs it (TB/s = K/V bytes of the dtype / that time); "
    "`attention (eager loop)` = the same loop launched from Python layer after layer: at small batches it times "
    "the host, not the kernels. fp8/bf16 attention is FlashInfer's decode, nvfp4 ours. `rest` = graph - attention "
    "(graph): everything else in the step (matmuls, norms, activations, RoPE, K/V write, logits, the staging of "
    "the step's inputs before the replay); `floor` = the weight bytes of one step at the copy bandwidth. `-`: not "
    "measured in this JSON (earlier runs timed the attention as the eager loop only).")
_PROFILE_DOC = (
    "Kernel times of the step (`--profile`: torch profiler, 3 steps averaged) summed by kernel name, in ms per "
    "step: GEMM = the matmuls: cuBLAS's incl. their split-K reduces and the skinny linear's (projections, MLP, "
    "logits; the gated skinny launch includes SiLU-and-multiply); attention = the "
    "decode kernels and their split-KV merge; K/V write = the pool write of the step's token; norms + rope + "
    "activation = the fused Triton kernels (with --no-fused their PyTorch kernels count as other); other = the "
    "rest (embedding, the copies of the step's inputs, elementwise ops). `launch gaps` = step ms - kernel sum: "
    "the time the GPU runs none of the step's kernels (the host's staging before the replay, the gaps between "
    "kernels). Kernels of a CUDA graph replay, measured against `graph ms`; rows marked eager: the profiler saw no "
    "kernel inside the replay, so these are the eager step's kernels against `eager ms`. With programmatic "
    "dependent launch a kernel starts before the one it follows ends and its time includes that wait, so the "
    "sums overlap and the gaps shrink, below 0 where a kernel waits long (the NVFP4 merge behind the decode); "
    "the step ms is the figure to compare.")


def write_md(doc: dict, path: str) -> None:
    rows = doc["rows"]
    fp8 = _fp8_rows(rows)
    lines = [
        f"# Engine decode step ({doc['gpu']}, {doc['model']}, {doc['layers']} layers)", "",
        (f"Command: `{doc['command']}`. Copy bandwidth measured: {doc['copy_tb_s']:.2f} TB/s. Decoder norms, "
        f"activation and RoPE: {'fused Triton kernels' if doc.get('fused_ops', True) else 'PyTorch ops'}."
        + (" NVFP4 pool writes: the per-block scale search (triton-block-select)." if doc.get("block_select") else "")),
        "", _COLUMNS_DOC, "",
        ("| B x L | kv | graph ms | eager ms | attention ms (graph) | attention ms (eager loop) | attention TB/s "
         "| rest ms | floor ms | rest / floor | tok/s | vs fp8 |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = f"{r['batch']} x {r['seq_len']}"
        if "error" in r:
            lines.append(f"| {shape} | {_kv(r)} | {r['error']} | | | | | | | | | |")
            continue
        if "graph_ms" not in r:
            lines.append(f"| {shape} | {_kv(r)} | {_ONLY_WITHOUT} | | | | | | | | | |")
            continue
        c = _cells(r, fp8.get(_fp8_key(r)))
        lines.append(f"| {shape} | {_kv(r)} | {c['graph']} | {c['eager']} | {c['attn']} | {c['attn_eager']} | "
                     f"{c['tb_s']} | {c['rest']} | {c['floor']} | {c['over']} | {c['tok_s']} | {c['vs_fp8']} |")
    lines += _back_to_back_lines(rows)
    lines += _rotation_lines(rows)
    lines += _pdl_lines(rows)
    lines += _linear_lines(rows)
    lines += _decode_kernel_lines(rows)
    lines += _category_lines(rows)
    lines += _kernel_lines(rows)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


_ONLY_WITHOUT = "only the step without attention measured (--only-without-attention)"


def _kv(r: dict) -> str:
    """The row's cache dtype, with its --kv-rotation where it has one, "cuBLAS" where its projections all ran
    through cuBLAS (--linear-modes cublas), "no PDL" where run with --pdl-modes off, and "PDL n/a" where asked for
    on a GPU that launches without it."""
    rot = r.get("kv_rotation", "none")
    kv = r["kv_dtype"] if rot == "none" else f"{r['kv_dtype']} + {rot}"
    if r.get("linear") == "cublas":  # --linear-modes cublas (rows before the skinny linear carry no key)
        kv = f"{kv}, cuBLAS"
    if r.get("nvfp4_decode_kernel", "auto") != "auto":  # --nvfp4-decode-kernels: a kernel forced
        kv = f"{kv}, {r['nvfp4_decode_kernel']} decode"
    if not r.get("pdl", True):
        return f"{kv}, no PDL"
    return kv if r.get("pdl_launched", True) else f"{kv}, PDL n/a"


# The settings a row is measured under besides its shape and dtype, with the value rows of older JSONs had.
_SETTINGS = {"kv_rotation": "none", "pdl": True, "linear": "cublas", "nvfp4_decode_kernel": "auto"}


def _settings(r: dict, leave_out: str = "") -> tuple:
    return tuple(r.get(k, v) for k, v in _SETTINGS.items() if k != leave_out)


def _fp8_rows(rows: list[dict]) -> dict[tuple, dict]:
    """The unrotated fp8 row of each shape and PDL mode (``_fp8_key``): the "vs fp8" column's denominator."""
    return {_fp8_key(r): r for r in rows
            if r["kv_dtype"] == "fp8_e4m3" and r.get("kv_rotation", "none") == "none" and "tok_s" in r}


def _fp8_key(r: dict) -> tuple:
    return r["batch"], r["seq_len"], r.get("pdl", True)


def _back_to_back_lines(rows: list[dict]) -> list[str]:
    """Each row's step alone (synchronised: the host's staging before the replay leaves the GPU idle) against the
    same step queued back to back (each staged while the last one runs, as overlap scheduling serves them)."""
    rows = [r for r in rows if r.get("back_to_back_ms") is not None and r.get("attention_graph_ms") is not None
            or r.get("no_attention_back_to_back_ms") is not None]
    if not rows:
        return []
    out = ["", "### Steps back to back (as overlap scheduling serves them)", "",
           ("`alone` = the table's graph step, one at a time; `back to back` = the mean of steps queued without "
            "waiting, each staged on the host while the last one runs; `rest` and `rest / floor` as above, from the "
            "back-to-back step. `without attention` = the same step, back to back, with each layer's decode "
            "attention replaced by one kernel writing its output's shape (benchmarks/engine/attention_stand_in.py): "
            "the rest of the step measured directly rather than as the difference of two large figures, which at "
            "the long shapes moves by ~0.15x of the floor for each 1% the attention varies."), "",
           ("| B x L | kv | step ms alone | step ms back to back | rest ms | rest / floor | step ms without attention "
            "| without attention / floor | tok/s |"),
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b2b, floor = r.get("back_to_back_ms"), r.get("non_attention_floor_ms")
        rest = None if b2b is None or r.get("attention_graph_ms") is None else b2b - r["attention_graph_ms"]
        direct = r.get("no_attention_back_to_back_ms")
        tok_s = "-" if b2b is None else f"{r['batch'] / (b2b * 1e-3):.0f}"
        out.append(f"| {r['batch']} x {r['seq_len']} | {_kv(r)} | {_ms(r.get('graph_ms'))} | {_ms(b2b)} | "
                   f"{_ms(rest)} | {_over(rest, floor)} | {_ms(direct)} | {_over(direct, floor)} | {tok_s} |")
    return out


def _over(ms: float | None, floor: float | None) -> str:
    return "-" if ms is None or not floor else f"{ms / floor:.2f}x"


def _rotation_lines(rows: list[dict]) -> list[str]:
    """Each rotated row's step against the unrotated row of its dtype and shape in the same run."""
    return _same_run_lines(rows, "The rotation's cost per step (same run)", "kv_rotation", "none",
                           ("unrotated", "rotated"))


def _pdl_lines(rows: list[dict]) -> list[str]:
    """Each step launched without programmatic dependent launch against the same step with it (``--pdl-modes``)."""
    return _same_run_lines(rows, "Programmatic dependent launch on / off (same run)", "pdl", True,
                           ("with PDL", "without PDL"))


def _decode_kernel_lines(rows: list[dict]) -> list[str]:
    """Each nvfp4 step with a forced decode kernel against the same step with the GPU's default (auto)."""
    return _same_run_lines(rows, "The NVFP4 decode kernel: forced against the GPU's default (same run)",
                           "nvfp4_decode_kernel", "auto", ("auto", "forced"))


def _linear_lines(rows: list[dict]) -> list[str]:
    """Each step with every projection through cuBLAS against the same step with the skinny linear where it applies
    (``--linear-modes``): the whole step where it was run, and the step without attention, back to back."""
    def same(r: dict) -> tuple:
        return r["kv_dtype"], r["batch"], r["seq_len"], *_settings(r, leave_out="linear")

    skinny = {same(r): r for r in rows if r.get("linear") == "skinny" and "error" not in r}
    pairs = [(r, skinny[same(r)]) for r in rows if r.get("linear") == "cublas" and same(r) in skinny]
    if not pairs:
        return []
    out = ["", "### Projections: the skinny linear against cuBLAS (same run)", "",
           ("| B x L | kv | step ms, skinny | step ms, cuBLAS | without attention ms, skinny | without attention ms, "
            "cuBLAS | cuBLAS / skinny (without attention) |"), "|---|---|---|---|---|---|---|"]
    for c, k in pairs:
        a, b = k.get("no_attention_back_to_back_ms"), c.get("no_attention_back_to_back_ms")
        ratio = "-" if a is None or b is None else f"{b / a:.3f}"
        out.append(f"| {c['batch']} x {c['seq_len']} | {_kv(k)} | {_ms(k.get('back_to_back_ms'))} | "
                   f"{_ms(c.get('back_to_back_ms'))} | {_ms(a)} | {_ms(b)} | {ratio} |")
    return out


def _same_run_lines(rows: list[dict], title: str, key: str, base, names: tuple[str, str]) -> list[str]:
    """The rows whose ``key`` is not ``base`` against the row of the same dtype, shape and other settings whose
    ``key`` is ``base`` (a missing key counts as ``base``): step and attention ms of both, and their ratio."""
    def same(r: dict) -> tuple:  # everything but ``key``: the pair differs in that setting alone
        return r["kv_dtype"], r["batch"], r["seq_len"], *_settings(r, leave_out=key)

    plain = {same(r): r for r in rows if r.get(key, base) == base and "graph_ms" in r}
    pairs = [(r, plain[same(r)]) for r in rows if r.get(key, base) != base and "graph_ms" in r and same(r) in plain]
    if not pairs:
        return []
    a, b = names
    out = ["", f"### {title}", "",
           (f"| B x L | kv | step ms {a} | step ms {b} | {b} / {a} | attention ms {a} | attention ms {b} "
            f"| back to back ms {a} | back to back ms {b} |"), "|---|---|---|---|---|---|---|---|---|"]
    for r, p in pairs:
        out.append(f"| {r['batch']} x {r['seq_len']} | {_kv(r)} | {p['graph_ms']:.3f} | {r['graph_ms']:.3f} | "
                   f"{r['graph_ms'] / p['graph_ms']:.3f} | {p['attention_graph_ms']:.3f} | "
                   f"{r['attention_graph_ms']:.3f} | {_ms(p.get('back_to_back_ms'))} | "
                   f"{_ms(r.get('back_to_back_ms'))} |")
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _cells(r: dict, fp8_row: dict | None) -> dict[str, str]:
    """One measured row's table cells. Rows of older JSONs have ``attention_ms`` (the eager loop) only."""
    attn = r.get("attention_graph_ms")
    rest = None if attn is None else r["graph_ms"] - attn
    floor = r.get("non_attention_floor_ms")
    return {"graph": _ms(r["graph_ms"]), "eager": _ms(r["eager_ms"]), "attn": _ms(attn),
            "attn_eager": _ms(r.get("attention_eager_ms", r.get("attention_ms"))),
            "tb_s": "-" if attn is None else f"{r['kv_read_gb'] / attn:.2f}", "rest": _ms(rest), "floor": _ms(floor),
            "over": _over(rest, floor), "tok_s": f"{r['tok_s']:.0f}",
            "vs_fp8": f"{r['tok_s'] / fp8_row['tok_s']:.2f}x" if fp8_row else "-"}


def _category_lines(rows: list[dict]) -> list[str]:
    """The profiled rows' kernel time per category and launch gaps (``--profile``)."""
    prof = [r for r in rows if r.get("kernel_ms")]
    if not prof:
        return []
    names = [CATEGORY_NAMES[c] for c in CATEGORY_NAMES]
    out = ["", "### Where a step's time goes (kernel ms per step)", "", _PROFILE_DOC, "",
           "| B x L | kv | step ms | " + " | ".join(names) + " | kernel sum | launch gaps |",
           "|---|---|---|" + "---|" * (len(names) + 2)]
    for r in prof:
        cats, eager = r["kernel_ms"], r.get("kernels_from") == "eager"
        step = _profiled_step(r, eager)
        out.append(f"| {r['batch']} x {r['seq_len']} | {_kv(r)} | {step} | "
                   + " | ".join(f"{cats[c]:.2f}" for c in CATEGORY_NAMES)
                   + f" | {cats['total']:.2f} | {r['launch_gaps_ms']:.2f} |")
    return out


def _profiled_step(r: dict, eager: bool) -> str:
    """The step time a profiled row's kernels are set against: the whole step's, or (``profiled``) the step
    without attention's."""
    if r.get("profiled") == "step without attention":
        return (f"{r['no_attention_eager_ms']:.2f} (eager, without attention)" if eager
                else f"{r['no_attention_ms']:.2f} (without attention)")
    return f"{r['eager_ms']:.2f} (eager)" if eager else f"{r['graph_ms']:.2f}"


def _kernel_lines(rows: list[dict]) -> list[str]:
    """Per profiled shape: its top kernels (``--profile``), of a graph replay or, in older JSONs, an eager step."""
    out = []
    for r in rows:
        if not r.get("kernels"):
            continue
        source = "CUDA graph replay" if r.get("kernels_from") == "graph" else "eager step"
        what = "one step without attention" if r.get("profiled") == "step without attention" else "one step"
        title = f"### Kernels of {what}: {r['batch']} x {r['seq_len']}, {_kv(r)} (torch profiler, {source})"
        out += ["", title, "", "| kernel | us per step | launches per step |", "|---|---|---|"]
        out += [f"| `{k['kernel']}` | {k['us']:.1f} | {k['launches']:.0f} |" for k in r["kernels"]]
    return out


def print_table(rows: list[dict], layers: int) -> None:
    print(f"\nengine decode step, Qwen3-8B-shaped, {layers} layers (attention: the decode of all layers in one "
          "CUDA graph; rest = graph - attention)")
    heads = ("graph ms", "eager ms", "attn ms", "attn eager", "attn TB/s", "rest ms", "floor ms", "x floor", "tok/s",
             "vs fp8")
    print(f"{'shape':>12} {'kv':>9} " + " ".join(f"{h:>10}" for h in heads))
    fp8 = _fp8_rows(rows)
    for r in rows:
        shape = f"{r['batch']}x{r['seq_len']}"
        if "error" in r:
            print(f"{shape:>12} {_kv(r):>9}  {r['error']}")
            continue
        if "graph_ms" not in r:
            direct, floor = r.get("no_attention_back_to_back_ms"), r.get("non_attention_floor_ms")
            print(f"{shape:>12} {_kv(r):>9}  without attention, back to back: {_ms(direct)} ms, "
                  f"{_over(direct, floor)} the floor")
            continue
        c = _cells(r, fp8.get(_fp8_key(r)))
        keys = ("graph", "eager", "attn", "attn_eager", "tb_s", "rest", "floor", "over", "tok_s", "vs_fp8")
        print(f"{shape:>12} {_kv(r):>9} " + " ".join(f"{c[k]:>10}" for k in keys))
