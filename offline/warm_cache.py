"""`nvfp4-serve warm-cache`: compile, on a machine without a GPU, the kernels the engine compiles when it starts
and on first use, for a GPU named by ``--arch`` and ``--num-sms`` (default: H200), so that a server on that GPU
finds them in its caches (the GPU image runs it at build time).

Triton (into TRITON_CACHE_DIR): the engine's own launches run on CPU tensors shaped as on the GPU, with Triton's
driver replaced by one that compiles for the target and launches nothing (``offline/triton_target_driver.py``)
and the NVFP4 decode planned for the target's SM count and compute capability (``DeviceTarget``):

    nvfp4_decode_tma_kernel             ``DecodeGraphRunner.warm_kernels``'s call: every (batch bucket, width
      (Hopper; nvfp4_decode_gluon_      bucket) of --cuda-graph-max-bs (capped by --max-running-requests) and
      kernel where TMA does not fit;    the page tables of --context-length
      else nvfp4_decode_kernel),
      merge_kernel
    nvfp4_decode_gluon_kernel           with the TMA kernel: once, for the eager launches (``eager_config``)
    nvfp4_quantize_kernel               write_kv of 1..16 tokens: every class Triton specializes the row count
                                        into (1, a multiple of 16, other), hence every batch and chunk size
    nvfp4_to_fp8_kernel                 gather_workspace of 1..16 cached tokens, the same classes
    kv_write_kernel                     the fp8_e4m3 / bf16 pool write of 1..16 tokens, the same classes
    skinny_linear_kernel                Hopper: the decode's bias-free projections (q/k/v, o, gate/up gated,
                                        down) at each row class of 1..64 rows that takes them

and, where gcc, Python's headers and a libcuda.so.1 to link against are found (the CUDA toolkit's stub library
serves: TRITON_LIBCUDA_PATH), every variant's host launcher stub and Triton's driver helpers, which a GPU
otherwise builds at a kernel's first load (``offline/triton_host_launchers.py``; --no-host-launchers skips them).

FlashInfer (into FLASHINFER_WORKSPACE_BASE's cache, when flashinfer imports): the FA2 modules of the prefill
on FP8 (nvfp4, fp8_e4m3 pools) or BF16 (bf16 pools) workspace K/V and of the fp8/bf16 decode, built by nvcc
for FLASHINFER_CUDA_ARCH_LIST taken from --arch (``nvfp4_kernels.backends.flashinfer_backend.jit_specs``).

Not covered (compiled on first use as before): eager decode batches larger than --cuda-graph-max-bs, the
decode shapes of a server run with --disable-cuda-graph (no start-up warm-up there either).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model_config import ModelConfig
from svc_common.cli_help import HelpFormatter
from svc_common.config_flags import argparse_kwargs, flag_name, iter_flags

# The engine flags that decide which kernel variants the engine asks for (engine/config.py declares them).
_ENGINE_FIELDS = ("model_dir", "dtype", "attention_backend", "nvfp4_decode_kernel", "context_length", "kv_dtype", "page_size",
                  "max_running_requests", "cuda_graph_max_bs", "disable_pdl")
_BACKENDS = ("auto", "triton", "triton-block-select")
_DTYPES = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ROW_CLASSES = range(1, 17)  # token counts whose row counts (tokens * Hk) reach every specialization class
DEFAULT_ARCH, DEFAULT_NUM_SMS = "sm_90a", 132  # H200 (and H100 SXM)


class WarmCacheError(ValueError):
    """A flag the command cannot use; printed as one line."""


@dataclass(frozen=True)
class WarmPlan:
    """What to compile: the model's attention geometry, the engine's flags and the target GPU."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtypes: tuple[str, ...]
    page_size: int
    max_batch: int  # the decode graphs' largest batch bucket
    max_width: int  # pages of the longest sequence
    block_select: bool
    capability: tuple[int, int]
    num_sms: int
    hidden_size: int = 0  # the decoder layer's fused ops (norms, SiLU-and-multiply, q/k norm + RoPE)
    intermediate_size: int = 0
    qk_norm: bool = False
    host_launchers: bool = False  # Triton's host launcher stubs too (offline/triton_host_launchers.py)
    nvfp4_decode_kernel: str = "auto"  # the engine's --nvfp4-decode-kernel
    pdl: bool = True  # not --disable-pdl: the small kernels' variants with programmatic dependent launch (SM90+)
    # (out features, in features, gated) of each bias-free projection of a decoder layer (``_projections``)
    projections: tuple[tuple[int, int, bool], ...] = ()


def build_parser(prog: str = "nvfp4-serve warm-cache") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, formatter_class=HelpFormatter, description=__doc__.split("\n\n")[0])
    for f, kind, spec in iter_flags(EngineConfig):
        if f.name not in _ENGINE_FIELDS:
            continue
        kw = argparse_kwargs(f, kind, spec)
        if f.name == "model_dir":
            kw["help"] = "model directory with config.json (weights are not read); default: the embedded model"
        elif f.name == "kv_dtype":
            kw.update(nargs="+", default=[kw["default"]], help="KV pool formats to compile for (one or more)")
        elif f.name == "attention_backend":
            kw.update(choices=list(_BACKENDS), help="the engine's --attention-backend (auto: triton on CUDA)")
        elif f.name == "dtype":
            kw.update(choices=list(_DTYPES), help="the model's compute dtype (auto: bfloat16, as on CUDA)")
        p.add_argument(flag_name(f, spec), *spec.aliases, **kw)
    from offline.tiny_model import PRESETS

    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a model shape of `nvfp4-serve make-model --preset` instead of --model")
    p.add_argument("--arch", default=DEFAULT_ARCH, help="target GPU architecture, sm_XY or sm_XYa "
                   f"(default: {DEFAULT_ARCH}, H100/H200; sm_100a B200, sm_120a RTX 50)")
    p.add_argument("--num-sms", type=int, default=DEFAULT_NUM_SMS,
                   help=f"the target GPU's SM count: the NVFP4 decode's split-KV geometry (default: "
                        f"{DEFAULT_NUM_SMS}, H200)")
    p.add_argument("--no-host-launchers", action="store_true",
                   help="skip Triton's host launcher stubs (default: built where gcc, Python's headers and a "
                        "libcuda.so.1 to link against are found; else the reason is printed)")
    return p


def parse_arch(arch: str) -> tuple[int, int]:
    """``sm_90a`` -> (9, 0); ``sm_100a`` -> (10, 0); ``sm_120`` -> (12, 0)."""
    m = re.fullmatch(r"sm_?(\d+)(\d)a?", arch)
    if not m or int(m.group(1)) < 7:
        raise WarmCacheError(f"--arch must name an NVIDIA GPU architecture like sm_90a, got {arch!r}")
    return int(m.group(1)), int(m.group(2))


def model_config(model: str | None, preset: str | None) -> ModelConfig:
    """The model's config: a ``--preset`` shape, a directory's config.json, or the embedded model's."""
    if preset and model:
        raise WarmCacheError("give --model or --preset, not both")
    if preset:
        from offline.tiny_model import PRESETS, make_config

        names = inspect.signature(make_config).parameters
        return ModelConfig.from_dict(make_config(**{k: v for k, v in PRESETS[preset].items() if k in names}))
    if not model:
        from svc_common.default_model import default_model_dir

        model = default_model_dir()
    if not (Path(model) / "config.json").is_file():
        raise WarmCacheError(f"--model {model}: no config.json there (a model directory, or use --preset)")
    return ModelConfig.from_dir(model)


def plan_from_args(a: argparse.Namespace) -> WarmPlan:
    from engine.decode_graphs import max_width_pages
    from engine.engine import served_context_len
    from engine.startup_error import StartupError
    from nvfp4_kernels.backends.decode_kernels import DecodeKernel, kernel_unfit

    capability = parse_arch(a.arch)
    if a.num_sms < 1:
        raise WarmCacheError(f"--num-sms must be >= 1, got {a.num_sms}")
    for name, value in (("--cuda-graph-max-bs", a.cuda_graph_max_bs), ("--page-size", a.page_size),
                        ("--max-running-requests", a.max_running_requests), ("--context-length", a.context_length)):
        if value is not None and value < 1:
            raise WarmCacheError(f"{name} must be >= 1, got {value}")
    mc = model_config(a.model, a.preset)
    if a.nvfp4_decode_kernel != "auto":
        why = kernel_unfit(DecodeKernel(a.nvfp4_decode_kernel), mc.head_dim, capability, mc.num_key_value_heads,
                           a.page_size)
        if why is not None:
            raise WarmCacheError(f"--nvfp4-decode-kernel {why} (--arch {a.arch}): use auto or triton")
    try:
        context = served_context_len(a.context_length, mc.max_context_len, a.model or a.preset or "the model")
    except StartupError as e:
        raise WarmCacheError(str(e)) from e
    return WarmPlan(mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, _DTYPES[a.dtype],
                    tuple(dict.fromkeys(a.kv_cache_dtype)), a.page_size,
                    min(a.cuda_graph_max_bs, a.max_running_requests), max_width_pages(context, a.page_size),
                    a.attention_backend == "triton-block-select", capability, a.num_sms, mc.hidden_size,
                    mc.intermediate_size, mc.qk_norm, not a.no_host_launchers, a.nvfp4_decode_kernel,
                    not a.disable_pdl, _projections(mc))


def _projections(mc: ModelConfig) -> tuple[tuple[int, int, bool], ...]:
    """(out, in, gated) of each projection of the model's own decoder layer (built on the meta device: shapes, no
    memory) that ``ModelOps.linear`` or, gated, ``gate_up_silu_mul`` runs: q/k/v merged, o, gate/up, down; those
    with a bias left out (cuBLAS runs them)."""
    from engine.model import DecoderLayer

    layer = DecoderLayer(mc, torch.bfloat16, torch.device("meta"))
    attn, mlp = layer.self_attn, layer.mlp
    linears = ((attn.qkv_proj, False), (attn.o_proj, False), (mlp.gate_up_proj, True), (mlp.down_proj, False))
    return tuple((*lin.weight.shape, gated) for lin, gated in linears if lin.bias is None)


def _cache_files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file()} if root.is_dir() else set()


def warm_triton(plan: WarmPlan) -> tuple[dict[str, tuple[int, int]], list[str] | None]:
    """Compile the Triton kernels of ``plan`` into TRITON_CACHE_DIR; ({kernel: (launches, variants compiled)},
    the kernel of each host launcher stub built, or None where ``plan`` builds none)."""
    from nvfp4_kernels import programmatic_launch
    from nvfp4_kernels.skinny_linear import skinny_capability
    from nvfp4_kernels.triton.kv_write import kv_write_kernel
    from nvfp4_kernels.triton.nvfp4_decode import merge_kernel
    from nvfp4_kernels.triton.nvfp4_quantize import nvfp4_quantize_kernel, nvfp4_to_fp8_kernel
    from nvfp4_kernels.triton.skinny_linear import skinny_linear_kernel
    from offline.triton_target_driver import TritonTarget, compile_for

    dense = [kv for kv in plan.kv_dtypes if kv in ("fp8_e4m3", "bf16")]
    skinny = skinny_capability(plan.capability) and bool(plan.projections)
    kernels = [*_model_op_kernels(), *([kv_write_kernel] if dense else []),
               *([skinny_linear_kernel] if skinny else [])]
    with (compile_for(TritonTarget(plan.capability), plan.host_launchers) as drv,
          programmatic_launch.for_target(plan.capability, plan.pdl)):  # the launch keywords the GPU will use
        if "nvfp4" in plan.kv_dtypes:
            _warm_nvfp4(plan)
            kernels += [*_decode_kernels(plan), merge_kernel, nvfp4_quantize_kernel, nvfp4_to_fp8_kernel]
        for kv in dense:  # their decode and prefill are FlashInfer's (warm_flashinfer); the pool write is ours
            _warm_dense_write(plan, kv)
        _warm_model_ops(plan)
        if skinny:
            _warm_skinny(plan)
    return _report(drv.launches, kernels), drv.stubs


def _decode_config(plan: WarmPlan):
    """The NVFP4 decode config the engine plans on the target (``default_decode_config``)."""
    from nvfp4_kernels.backends.triton_backend import default_decode_config

    return default_decode_config(plan.head_dim, plan.capability, plan.num_qo_heads // plan.num_kv_heads,
                                 _kernel_choice(plan), num_kv_heads=plan.num_kv_heads, page_size=plan.page_size)


def _decode_kernels(plan: WarmPlan) -> list:
    """The NVFP4 decode kernels the engine launches on the target (``_decode_config``): with the TMA kernel, also
    the cp.async one its eager launches use (``decode_choice.eager_config``)."""
    from nvfp4_kernels.backends.triton_backend import DecodeKernel

    kernel = _decode_config(plan).kernel
    if kernel is DecodeKernel.GLUON_TMA:
        from nvfp4_kernels.triton.nvfp4_decode_gluon import nvfp4_decode_gluon_kernel
        from nvfp4_kernels.triton.nvfp4_decode_tma import nvfp4_decode_tma_kernel

        return [nvfp4_decode_tma_kernel, nvfp4_decode_gluon_kernel]
    if kernel is DecodeKernel.GLUON:
        from nvfp4_kernels.triton.nvfp4_decode_gluon import nvfp4_decode_gluon_kernel

        return [nvfp4_decode_gluon_kernel]
    from nvfp4_kernels.triton.nvfp4_decode import nvfp4_decode_kernel

    return [nvfp4_decode_kernel]


def _kernel_choice(plan: WarmPlan):
    """--nvfp4-decode-kernel as a DecodeKernel, None for auto."""
    from nvfp4_kernels.backends.triton_backend import DecodeKernel

    return None if plan.nvfp4_decode_kernel == "auto" else DecodeKernel(plan.nvfp4_decode_kernel)


def _warm_nvfp4(plan: WarmPlan) -> None:
    """The NVFP4 decode for every graph shape, the quantize and the workspace dequant for every row class."""
    from engine.decode_graphs import batch_buckets, width_buckets
    from engine.kv_pool import KVPool
    from nvfp4_kernels.backends.triton_backend import (
        DecodeKernel,
        DeviceTarget,
        TritonBackend,
        TritonBlockSelectBackend,
    )

    pool = KVPool("nvfp4", 1, 16, plan.page_size, plan.num_kv_heads, plan.head_dim, scratch_pages=1)
    layer, hk, d = pool.layers[0], plan.num_kv_heads, plan.head_dim
    shapes = [(b, w) for b in batch_buckets(plan.max_batch) for w in width_buckets(plan.max_width)]
    # an sm_90a arch is an H100 or an H200, whose TMA decode runs different steps (decode_choice.LEAN_STEP_GPUS):
    # where the plan's kernel is the TMA one, both steps are compiled
    tma = _decode_config(plan).kernel is DecodeKernel.GLUON_TMA
    for lean in ((False, True) if tma else (False,)):
        backend = (TritonBlockSelectBackend if plan.block_select else TritonBackend)(
            target=DeviceTarget(plan.num_sms, plan.capability, lean_step=lean), decode_kernel=_kernel_choice(plan))
        backend.warm_decode(layer, shapes, plan.num_qo_heads, plan.q_dtype, d ** -0.5, pool.scratch_page)
    for n in _ROW_CLASSES:
        slots = torch.arange(n, dtype=torch.int64)
        kv = torch.zeros(n, hk, d, dtype=plan.q_dtype)
        backend.write_kv(layer, slots, kv, kv)
        ws = torch.empty(n, hk, d, dtype=torch.float8_e4m3fn)
        backend.gather_workspace(layer, slots, ws, ws)


def _warm_dense_write(plan: WarmPlan, kv_dtype: str) -> None:
    """The fp8_e4m3 / bf16 pool write (nvfp4_kernels/backends/triton_kv_write.py) for every row class."""
    from engine.kv_pool import KVPool
    from nvfp4_kernels.backends.triton_kv_write import write_rows

    layer = KVPool(kv_dtype, 1, 16, plan.page_size, plan.num_kv_heads, plan.head_dim, scratch_pages=1).layers[0]
    for n in _ROW_CLASSES:
        kv = torch.zeros(n, plan.num_kv_heads, plan.head_dim, dtype=plan.q_dtype)
        write_rows(layer, torch.arange(n, dtype=torch.int64), kv, kv)


def _report(launches: Counter[str], kernels) -> dict[str, tuple[int, int]]:
    return {k.fn.__name__: (launches[k.fn.__name__], len(k.device_caches[0][0])) for k in kernels}


def _model_op_kernels() -> tuple:  # imported late: nvfp4_kernels.triton needs triton
    from nvfp4_kernels.triton.qk_norm_rope import qk_norm_rope_kernel
    from nvfp4_kernels.triton.rmsnorm import rmsnorm_kernel
    from nvfp4_kernels.triton.silu_mul import silu_mul_kernel

    return rmsnorm_kernel, silu_mul_kernel, qk_norm_rope_kernel


def _warm_model_ops(plan: WarmPlan) -> None:
    """The decoder layer's fused ops (nvfp4_kernels/fused_ops.py) on rows shaped as the model's: the variants depend on
    the widths (hidden, intermediate, heads x head_dim) and the q/k norm, not on the number of rows."""
    from nvfp4_kernels.fused_ops import TRITON_OPS as ops

    if not plan.hidden_size:
        return
    dt, d = plan.q_dtype, plan.head_dim
    h = torch.zeros(2, plan.hidden_size, dtype=dt)
    w = torch.ones(plan.hidden_size, dtype=dt)
    ops.rms_norm(h, w, 1e-6)
    ops.add_rms_norm(h, h.clone(), w, 1e-6)
    ops.silu_mul(torch.zeros(2, 2 * plan.intermediate_size, dtype=dt))
    qkv = torch.zeros(2, (plan.num_qo_heads + 2 * plan.num_kv_heads) * d, dtype=dt)
    cos = torch.ones(4, d // 2, dtype=torch.float32)
    norm_w = torch.ones(d, dtype=dt) if plan.qk_norm else None
    ops.qk_norm_rope(qkv, torch.zeros(2, dtype=torch.int64), cos, cos.clone(), norm_w, norm_w, 1e-6,
                     plan.num_qo_heads, plan.num_kv_heads)


def _warm_skinny(plan: WarmPlan) -> None:
    """The skinny linear of the decode's projections (``nvfp4_kernels.fused_ops.linear``, ``gate_up_silu_mul``) for
    each projection and each row class it takes (``skinny_row_classes``, where ``skinny_shape`` gives it the
    projection). Weights are left uninitialized: nothing runs."""
    from nvfp4_kernels.skinny_linear import skinny_linear, skinny_row_classes, skinny_shape

    for n, k, gated in plan.projections:
        w = torch.empty(n, k, dtype=plan.q_dtype)
        for m in skinny_row_classes():
            if skinny_shape(m, n, k):
                skinny_linear(torch.empty(m, k, dtype=plan.q_dtype), w, gated=gated, gpu_code=True)


def warm_flashinfer(plan: WarmPlan) -> list[str]:
    """Build the FlashInfer JIT modules of ``plan``; one line per module, or one saying why none were."""
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = "{}.{}".format(*plan.capability)  # read when flashinfer imports
    from nvfp4_kernels.backends import flashinfer_backend as fib

    if not fib.flashinfer_available():
        return ["flashinfer is not importable here: its modules were not built (they compile at first use)"]
    kv_types = {torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn for kv in plan.kv_dtypes}
    lines = []
    for kv in sorted(kv_types, key=str):
        for spec in fib.jit_specs(plan.q_dtype, kv, plan.head_dim):
            t0 = time.perf_counter()
            spec.build()
            lines.append(f"flashinfer {spec.name}: {time.perf_counter() - t0:.1f} s -> {spec.build_dir}")
    return lines


def main(argv: list[str] | None = None, prog: str = "nvfp4-serve warm-cache") -> int:
    a = build_parser(prog).parse_args(argv)
    try:
        plan = plan_from_args(a)
    except (WarmCacheError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    from triton import knobs

    cache = Path(knobs.cache.dir)
    before = _cache_files(cache)
    t0 = time.perf_counter()
    no_stubs = None
    if plan.host_launchers:
        from offline.triton_host_launchers import why_not

        if (no_stubs := why_not()) is not None:
            plan = dataclasses.replace(plan, host_launchers=False)
    report, stubs = warm_triton(plan)
    new = len(_cache_files(cache) - before)
    print(f"triton sm_{plan.capability[0]}{plan.capability[1]}, {plan.num_sms} SMs, head_dim {plan.head_dim}, "
          f"{plan.num_qo_heads}/{plan.num_kv_heads} heads, batch <= {plan.max_batch}, {plan.max_width} pages: "
          f"{new} new files in {cache} ({time.perf_counter() - t0:.1f} s)")
    for name, (launches, variants) in report.items():
        print(f"  {name}: {launches} launches, {variants} variants")
    if stubs is not None:
        print(f"  host launcher stubs: {len(stubs)} (one per kernel variant) and the driver helpers")
    elif not a.no_host_launchers:
        print(f"  host launcher stubs: not built ({no_stubs}); a GPU builds them at each kernel's first load")
    for line in warm_flashinfer(plan):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
