"""Gluon decode variants side by side (development probe): each module's ``nvfp4_decode_gluon_kernel`` checked
against the fp32 reference and timed at the kernel benchmark's shapes in one run.

    python -m benchmarks.kernels.probe_gluon nvfp4_kernels.triton.nvfp4_decode_gluon [more modules] [--shapes 44x32768]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import sys

import torch

from benchmarks.kernels import bench_decode as bd


def _use(module_name: str) -> None:
    import nvfp4_kernels.triton.nvfp4_decode_gluon as base

    base.nvfp4_decode_gluon_kernel = importlib.import_module(module_name).nvfp4_decode_gluon_kernel


def _hnd(layer):
    """The same pages with each page's rows head-major ([P, HK, PAGE, ...] bytes) in the NHD-shaped tensors."""
    from nvfp4_kernels.kv_layout import LayerKV

    def f(t):
        return t.permute(0, 2, 1, 3).contiguous().view(t.shape)

    return LayerKV("nvfp4", layer.page_size, layer.num_kv_heads, layer.head_dim, f(layer.k), f(layer.v), f(layer.k_sf),
                   f(layer.v_sf), layer.k_scale, layer.v_scale)


def check(dev, hnd: bool = False) -> list[dict]:
    from nvfp4_kernels.backends.triton_backend import DecodeConfig, DecodeKernel, TritonBackend
    from nvfp4_kernels.kv_layout import LayerKV

    out = []
    torch.manual_seed(0)
    ref_tb = TritonBackend()
    for g, d, lens, bt, pg in ((4, 128, (5000, 17, 1, 33, 64), 32, 16), (4, 128, (3001, 640, 33), 16, 16),
                               (4, 128, (2049, 100), 64, 16), (8, 64, (2049, 100, 31), 32, 16), (1, 128, (1500, 16, 47), 32, 16),
                               (4, 256, (1500, 16), 16, 16), (4, 128, (3001, 77, 5), 32, 64), (4, 128, (1001, 40), 64, 32)):
        b, hq = len(lens), bd.HK * g
        maxp = max(-(-n // pg) for n in lens) + 1
        p = b * maxp + 5
        z = functools.partial(torch.zeros, device=dev)
        layer = LayerKV("nvfp4", pg, bd.HK, d, z(p, pg, bd.HK, d // 2, dtype=torch.uint8),
                        z(p, pg, bd.HK, d // 2, dtype=torch.uint8), z(p, pg, bd.HK, d // 16, dtype=torch.float8_e4m3fn),
                        z(p, pg, bd.HK, d // 16, dtype=torch.float8_e4m3fn), bd.K_G, bd.V_G)
        kk = torch.randn(p * pg, bd.HK, d, device=dev)
        kk[:, :, 7] *= 40.0
        vv = torch.randn(p * pg, bd.HK, d, device=dev) * torch.exp(torch.randn(p * pg, bd.HK, 1, device=dev))
        ref_tb.write_kv(layer, torch.arange(p * pg, device=dev), kk, vv)
        pt = torch.randperm(p, device=dev)[: b * maxp].reshape(b, maxp).to(torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32, device=dev)
        q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        ref = bd.fp32_decode_reference(layer, pt, seq, q, 1 / math.sqrt(d))
        gb = TritonBackend(DecodeConfig(1, bt, 2, 24, DecodeKernel.GLUON))
        o = gb.decode(gb.plan_decode(pt, seq, hq, bd.HK, d, pg), q, _hnd(layer) if hnd else layer, 1 / math.sqrt(d)).float()
        err = float((o - ref).norm() / ref.norm())
        out.append({"g": g, "d": d, "lens": lens, "bt": bt, "page": pg, "rel_err": err, "finite": bool(torch.isfinite(o).all())})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("modules", nargs="+")
    ap.add_argument("--shapes", nargs="*", default=[f"{b}x{n}" for b, n in bd.SHAPES])
    ap.add_argument("--configs", nargs="*", default=["32:2:24"], help="BT:STAGES:programs_per_sm[:max_registers]")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args(argv)
    from nvfp4_kernels.backends.triton_backend import DecodeConfig, DecodeKernel

    dev = torch.device("cuda")
    copy = bd.copy_bandwidth(dev)
    print(f"copy bandwidth {copy:.2f} TB/s", flush=True)
    rows = []
    for m in a.modules:
        _use(m)
        if not a.no_check:
            for c in check(dev, getattr(importlib.import_module(m), "HND", False)):
                print(f"check {m} {c}", flush=True)
                rows.append({"module": m, "check": c})
        for sh in a.shapes:
            bsz, n = map(int, sh.split("x"))
            cfgs = []
            for x in a.configs:
                f = [int(v) for v in x.split(":")]
                cfgs.append(DecodeConfig(1, f[0], f[1], f[2], DecodeKernel.GLUON, f[3] if len(f) > 3 else None))
            res = bd.time_ours(dev, bsz, n, cfgs)
            for label, r in res.items():
                tbs = bd.nvfp4_bytes(bsz, n) / r["us"] / 1e6
                print(f"time {m} {sh} {label}: {r['us']:.1f} us {tbs:.2f} TB/s ({tbs / copy:.0%})", flush=True)
                rows.append({"module": m, "shape": sh, "config": label, "us": r["us"], "tbs": tbs, "of_copy": tbs / copy})
    write_json(a.out, copy, rows)
    return 0


def write_json(path: str | None, copy_tbs: float, rows: list[dict]) -> None:
    """A probe run's rows, its copy bandwidth and command line (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as f:
            json.dump({"copy_tbs": copy_tbs, "rows": rows, "argv": sys.argv}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
