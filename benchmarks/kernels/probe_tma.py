"""The TMA-fed Gluon decode (``nvfp4_kernels/triton/nvfp4_decode_tma.py``) against the cp.async one (development
probe): checked against the fp32 reference with NaN scales past every prompt, then both timed at the kernel
benchmark's shapes in one run, each shape twice in alternation, the TMA kernel at several tilings.

    python -m benchmarks.kernels.probe_tma [--shapes 44x32768 ...] [--configs 32:2:24 32:2:32:lean ...] [--out F]
    python -m benchmarks.kernels.probe_tma --compile-only     # no GPU: registers, programs per SM, loop instructions
    compute-sanitizer python -m benchmarks.kernels.probe_tma --check-only   # where a check faults
    ncu --clock-control none --kernel-name regex:nvfp4_decode --launch-skip 2 --launch-count 1 \
        python -m benchmarks.kernels.probe_tma --launch-only 44x32768            # the default decode, launched 4x
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from benchmarks.kernels import bench_decode as bd
from benchmarks.kernels.probe_gluon import write_json


def _compile_tma_sm90(fn, d: int, page: int, scale_box_w: int, constexprs: dict, options: dict):
    """A TMA decode kernel ``fn`` (the one-head or the grouped one: same runtime arguments) compiled for sm_90a
    with Triton's bundled ptxas (no GPU needed): code descriptors box [page, D/4] int16, scale descriptors box
    [page, scale_box_w] bytes, ``constexprs`` as launched."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    dw = d // 4
    cd = f"tensordesc<i16[{page}, {dw}],{gl.NVMMASharedLayout.get_default_for([page, dw], gl.int16)!r}>"
    sd = (f"tensordesc<u8[{page}, {scale_box_w}],"
          f"{gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)!r}>")
    ints = ("stride_qb", "stride_qh", "stride_ptb", "stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh",
            "chunk_tokens", "oob_row")
    sig = {"Q": "*bf16", "k_desc": cd, "ks_desc": sd, "v_desc": cd, "vs_desc": sd, "PAGE_TABLE": "*i32",
           "SEQ_LENS": "*i32", "O_PART": "*fp32", "LSE_PART": "*fp32", "qk_scale": "fp32", "out_scale": "fp32",
           **{n: "i32" for n in ints}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n].startswith("*") or n.startswith("stride_") and n != "stride_ptb"}
    src = GluonASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in constexprs}), constexprs=constexprs,
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _group_constexprs(d: int, group: int, page: int, npg: int, stages: int, lean: bool) -> dict:
    import triton

    return {"HK": 8, "G": group, "GN": max(8, triton.next_power_of_2(group)), "D": d, "PAGE": page, "NPG": npg,
            "STAGES": stages, "LEAN": lean}


def compile_sm90(d: int = 128, npg: int = 2, stages: int = 2, group: int = 4, page: int = 16, lean: bool = False):
    """The one-head TMA kernel compiled for sm_90a (no GPU needed)."""
    from nvfp4_kernels.triton.nvfp4_decode_tma import nvfp4_decode_tma_kernel

    sw = max(16, d // 16)
    return _compile_tma_sm90(nvfp4_decode_tma_kernel, d, page, sw,
                             {**_group_constexprs(d, group, page, npg, stages, lean), "SW": sw}, {"num_warps": 1})


def compile_sm90_grouped(npg: int = 1, stages: int = 4, group: int = 4, page: int = 16, lean: bool = True):
    """The grouped TMA kernel (4 KV heads per CTA, nvfp4_decode_tma_grouped) compiled for sm_90a, at D 128, as
    launched (4 warps and the register cap of ``GROUPED_MAX_REGISTERS``; no GPU needed)."""
    from nvfp4_kernels.backends.decode_choice import GROUPED_HEADS, GROUPED_MAX_REGISTERS
    from nvfp4_kernels.triton.nvfp4_decode_tma_grouped import nvfp4_decode_tma_grouped_kernel

    return _compile_tma_sm90(nvfp4_decode_tma_grouped_kernel, 128, page, GROUPED_HEADS * 128 // 16,
                             _group_constexprs(128, group, page, npg, stages, lean),
                             {"num_warps": 4, "maxnreg": GROUPED_MAX_REGISTERS})


def sm90_resident_programs(registers: int, shared_bytes: int) -> int:
    """One-warp programs that run at once on one SM90 SM: a warp's registers (allocated 8 a thread at a time) come
    from its scheduler's quarter of the 65,536, a program's shared memory (plus 1 KB the hardware reserves) from
    the SM's 228 KB, and at most 32 programs."""
    per_warp = -(-registers // 8) * 8 * 32
    return min(4 * (16384 // per_warp), 228 * 1024 // (shared_bytes + 1024), 32)


def sass_report(kernel) -> dict:
    """Registers, spills and the instructions of the longest loop of a compiled kernel (cuobjdump's SASS)."""
    import collections
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", ln) for ln in sass.splitlines()) if m]
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []  # backward branches' bodies; the main loop is the shortest one that holds the MMAs
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(?:0x)?([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = ins[at[int(m.group(1), 16)]:i + 1]
            if any("HMMA" in t for _, t in body):
                loops.append(body)
    loop = min(loops, key=len) if loops else []
    # the steps' common path: the loop less the bodies of its short predicated forward branches (the tail step's
    # masking and scale zeroing, which one step per split runs)
    hi = loop[-1][0] if loop else 0
    rare = set()
    for a, text in loop:
        m = re.search(r"^@!?P\d\s+BRA\s+(?:0x)?([0-9a-f]+)", text)
        if m and a < int(m.group(1), 16) <= hi:
            body = [b for b, _ in loop if a < b < int(m.group(1), 16)]
            if len(body) < 150:
                rare.update(body)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in loop)
    return {"registers": int(re.search(r"REG:(\d+)", res).group(1)), "spills": "LOCAL:0" not in res,
            "loop_instructions": len(loop), "common_path_instructions": len(loop) - len(rare),
            "loop_ops": dict(ops.most_common()), "tma_loads": sass.count("UTMALDG"),
            "ldmatrix": sass.count("LDSM")}


def check(dev) -> list[dict]:
    from nvfp4_kernels.backends.triton_backend import DecodeConfig, DecodeKernel, TritonBackend
    from nvfp4_kernels.kv_layout import LayerKV

    out = []
    torch.manual_seed(0)
    ref_tb = TritonBackend()
    for g, d, lens, bt, pg, st in ((4, 128, (5000, 17, 1, 33, 64), 32, 16, 2), (4, 128, (3001, 640, 33), 16, 16, 3),
                                   (4, 128, (2049, 100, 7), 32, 16, 3), (8, 64, (2049, 100, 31), 32, 16, 2),
                                   (1, 128, (1500, 16, 47), 32, 16, 2), (4, 256, (1500, 16), 16, 16, 2),
                                   (4, 128, (3001, 77, 5), 64, 64, 2), (4, 128, (1001, 40), 32, 32, 2)):
        b, hq = len(lens), bd.HK * g
        maxp = max(-(-n // pg) for n in lens) + 1
        p = b * maxp + 5
        layer = LayerKV("nvfp4", pg, bd.HK, d, torch.zeros(p, pg, bd.HK, d // 2, dtype=torch.uint8, device=dev),
                        torch.zeros(p, pg, bd.HK, d // 2, dtype=torch.uint8, device=dev),
                        torch.zeros(p, pg, bd.HK, d // 16, dtype=torch.float8_e4m3fn, device=dev),
                        torch.zeros(p, pg, bd.HK, d // 16, dtype=torch.float8_e4m3fn, device=dev), bd.K_G, bd.V_G)
        kk = torch.randn(p * pg, bd.HK, d, device=dev)
        kk[:, :, 7] *= 40.0
        vv = torch.randn(p * pg, bd.HK, d, device=dev) * torch.exp(torch.randn(p * pg, bd.HK, 1, device=dev))
        ref_tb.write_kv(layer, torch.arange(p * pg, device=dev), kk, vv)
        pt = torch.randperm(p, device=dev)[: b * maxp].reshape(b, maxp).to(torch.int32)
        # the slots past each prompt's end: NaN scales (0x7F), which the kernel must never let through
        for i, n in enumerate(lens):
            last = int(pt[i, (n - 1) // pg])
            layer.v_sf.view(torch.uint8)[last, (n - 1) % pg + 1:] = 0x7F
            layer.k_sf.view(torch.uint8)[last, (n - 1) % pg + 1:] = 0x7F
        seq = torch.tensor(lens, dtype=torch.int32, device=dev)
        q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        ref = bd.fp32_decode_reference(layer, pt, seq, q, 1 / math.sqrt(d))
        # both steps of the TMA kernel, one KV head per program and (at head_dim 128) 4 per CTA
        for lean, hg in ((False, 1), (True, 1)) + (((False, 4), (True, 4)) if d == 128 else ()):
            gb = TritonBackend(DecodeConfig(1, bt, st, 24, DecodeKernel.GLUON_TMA, lean=lean, head_group=hg))
            print(f"check case g {g} d {d} lens {lens} bt {bt} page {pg} stages {st} lean {lean} head_group {hg}",
                  flush=True)
            o = gb.decode(gb.plan_decode(pt, seq, hq, bd.HK, d, pg), q, layer, 1 / math.sqrt(d)).float()
            torch.cuda.synchronize(dev)  # a fault shows at the case that made it
            err = float((o - ref).norm() / ref.norm())
            out.append({"g": g, "d": d, "lens": lens, "bt": bt, "page": pg, "stages": st, "lean": lean,
                        "head_group": hg, "rel_err": err,
                        "finite": bool(torch.isfinite(o).all())})
    return out


def launch_only(batch: int, seq_len: int, config=None) -> int:
    """The decode of the benchmark's pool at one shape, launched 4 times: ``config`` (a DecodeConfig), else the
    GPU's default (``default_decode_config``)."""
    from nvfp4_kernels.backends.triton_backend import TritonBackend

    dev = torch.device("cuda")
    layer = bd._nvfp4_pool(dev, batch, seq_len, 1)
    pt = bd._page_tables(dev, batch, seq_len, 1)[0]
    seq = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    q = torch.randn(batch, bd.HQ, bd.D, device=dev).to(torch.bfloat16)
    tb = TritonBackend(config)
    plan = tb.plan_decode(pt, seq, bd.HQ, bd.HK, bd.D, bd.PAGE)
    for _ in range(4):
        tb.decode(plan, q, layer, bd.SM_SCALE)
    torch.cuda.synchronize(dev)
    print(f"launched {plan.backend_state.config.label} at {batch}x{seq_len}: {plan.backend_state.num_splits} splits",
          flush=True)
    return 0


def _tma_config(ap: argparse.ArgumentParser, text: str, flag: str = "--configs"):
    """``BT:STAGES:PROGRAMS_PER_SM[:lean][:hg4]`` as the TMA kernel's DecodeConfig (``hg4``: the grouped kernel,
    4 KV heads per CTA); argparse's error otherwise."""
    from nvfp4_kernels.backends.triton_backend import DecodeConfig, DecodeKernel

    parts = text.split(":")
    tail = parts[3:]
    if (len(parts) < 3 or not all(p.isdigit() for p in parts[:3])
            or tail not in ([], ["lean"], ["hg4"], ["lean", "hg4"])):
        ap.error(f"{flag} takes BT:STAGES:PROGRAMS_PER_SM, then :lean and/or :hg4, got {text!r}")
    try:
        return DecodeConfig(1, *map(int, parts[:3]), DecodeKernel.GLUON_TMA, lean="lean" in tail,
                            head_group=4 if "hg4" in tail else 1)
    except ValueError as e:
        ap.error(f"{flag} {text}: {e}")


def _shape(ap: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    """``BxL`` (sequences x tokens, both >= 1; L a whole number of pages) as ints (argparse's error otherwise)."""
    b, _, n = text.partition("x")
    if not (b.isdigit() and n.isdigit() and int(b) >= 1 and int(n) >= 1 and int(n) % bd.PAGE == 0):
        ap.error(f"a shape is BxL with B, L >= 1 and L a multiple of {bd.PAGE} tokens, got {text!r}")
    return int(b), int(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[f"{b}x{n}" for b, n in bd.SHAPES])
    ap.add_argument("--configs", nargs="*", default=["32:2:24", "32:2:12", "32:2:32:lean", "32:2:48:lean"],
                    help="TMA kernel tilings BT:STAGES:programs_per_sm, ':lean' for its lean step")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--check-only", action="store_true",
                    help="the checks alone, each case synchronized (run under compute-sanitizer: stage tma_sanitize)")
    ap.add_argument("--launch-only", default=None, metavar="BxL",
                    help="the GPU's default decode at one shape, launched 4 times and nothing else (for a profiler)")
    ap.add_argument("--launch-config", default=None, metavar="BT:STAGES:PROGRAMS_PER_SM[:lean][:hg4]",
                    help="with --launch-only: this TMA config instead of the GPU's default (e.g. 32:2:32:lean, the "
                         "H200's default, profiled on an H100)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    if a.launch_config and not a.launch_only:
        ap.error("--launch-config names the config --launch-only launches; give --launch-only BxL too")
    tcfgs = [_tma_config(ap, x) for x in a.configs]
    shapes = [(sh, *_shape(ap, sh)) for sh in a.shapes]
    if a.launch_only:
        return launch_only(*_shape(ap, a.launch_only),
                           _tma_config(ap, a.launch_config, "--launch-config") if a.launch_config else None)
    if a.compile_only:
        for npg, stages, lean in ((2, 2, False), (2, 2, True), (1, 3, False), (1, 4, False), (2, 3, False)):
            k = compile_sm90(npg=npg, stages=stages, lean=lean)
            r = sass_report(k)
            print(f"BT {16 * npg} stages {stages}{' lean' if lean else ''}: {r['registers']} registers, spills "
                  f"{r['spills']}, {sm90_resident_programs(r['registers'], k.metadata.shared)} programs per SM, "
                  f"{r['loop_instructions']} loop instructions ({r['common_path_instructions']} on the steps' common "
                  f"path) {r['loop_ops']}", flush=True)
        return 0
    from nvfp4_kernels.backends.triton_backend import DecodeConfig, DecodeKernel

    dev = torch.device("cuda")
    copy = bd.copy_bandwidth(dev)
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    rows = []
    for c in check(dev):
        print(f"check tma {c}", flush=True)
        rows.append({"kernel": "tma", "check": c})
    if a.check_only:
        write_json(a.out, copy, rows)
        return 0
    base = [DecodeConfig(1, 32, 2, 24, DecodeKernel.GLUON)]
    for rnd in range(a.rounds):
        for sh, bsz, n in shapes:
            for kernel, cfgs in (("cp.async", base), ("tma", tcfgs)):
                for label, r in bd.time_ours(dev, bsz, n, cfgs).items():
                    tbs = bd.nvfp4_bytes(bsz, n) / r["us"] / 1e6
                    print(f"time r{rnd} {kernel} {sh} {label}: {r['us']:.1f} us (graph {r['graph_us']:.1f}) "
                          f"{tbs:.2f} TB/s ({tbs / copy:.0%})", flush=True)
                    rows.append({"kernel": kernel, "round": rnd, "shape": sh, "config": label, "us": r["us"],
                                 "graph_us": r["graph_us"], "tbs": tbs, "of_copy": tbs / copy})
    write_json(a.out, copy, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
