"""The NIXL wheel cut down to what one GPU host's transfers load, so it travels in one device call.

The nixl-cu13 wheel is 56 MiB: beside NIXL's core and its UCX backend it carries the expert-parallel kernels
(nixl_ep, three builds of 30 MB each), a dozen storage and network plugins (GDS, object stores, libfabric, DOCA)
with their SDKs, UCX's InfiniBand transports and perftest, headers and example programs. A benchmark on one H200
moves pages over UCX's cuda_ipc, shared-memory and TCP transports only. This keeps NIXL's Python package, its
core libraries, the UCX plugin and UCX's non-IB transport modules, then every bundled library those ELF files
need (their DT_NEEDED entries, followed transitively), and packs them as a tar.xz to extract into a
``--target`` site directory (the small ``nixl`` wheel, the importable name over nixl_cu13, is added whole):

    python benchmarks/device/slim_nixl.py NIXL_CU13_WHEEL NIXL_WHEEL OUT.tar.xz
    (on the device)  tar -xJf OUT.tar.xz -C /tmp/site

Not for deployments: those install the wheel itself (RDMA needs the InfiniBand transports dropped here).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# top-level entries and file patterns a one-host transfer never loads
_DROP_TOP = re.compile(r"^(nixl_ep_cu\d+|nixl_cu\d+-[^/]*\.data|nixl_cu\d+\.scripts)$")
_DROP_FILE = re.compile(r"(libplugin_(?!UCX)\w+\.so|libtelemetry_exporter_\w+\.so|libtrace_backend_\w+\.so|"
                        r"libuct_ib\w*\.so[.\d]*|libucx_perftest\w*\.so[.\d]*|\.la)$")


def _needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=False).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def slim(tree: Path) -> tuple[int, int]:
    """MUTATES ``tree`` (an extracted nixl-cu13 wheel): drops what one-host transfers never load; returns
    (files kept, files dropped)."""
    dropped = 0
    for top in list(tree.iterdir()):
        if _DROP_TOP.match(top.name):
            dropped += sum(1 for p in top.rglob("*") if p.is_file())
            subprocess.run(["rm", "-rf", str(top)], check=True)
    for p in list(tree.rglob("*")):
        if p.is_file() and _DROP_FILE.search(p.name):
            p.unlink()
            dropped += 1
    # bundled libraries (auditwheel's nixl_cu13.libs, meson's .libs) are kept only where a kept ELF needs them
    libs = {p.name: p for d in tree.iterdir() if d.name.endswith(".libs") for p in d.rglob("*.so*") if p.is_file()}
    roots = [p for p in tree.rglob("*") if p.is_file() and _is_elf(p) and p.name not in libs]
    roots += [p for name, p in libs.items() if "/ucx/" in str(p) or "/plugins/" in str(p) or "/nixl/" in str(p)]
    keep, todo = set(), list(roots)
    while todo:
        p = todo.pop()
        if p in keep:
            continue
        keep.add(p)
        todo.extend(libs[n] for n in _needed(p) if n in libs)
    for p in libs.values():
        if p not in keep:
            p.unlink()
            dropped += 1
    return sum(1 for p in tree.rglob("*") if p.is_file()), dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cu13_wheel", help="nixl_cu13-*.whl (pip download nixl-cu13==1.5.1 --python-version 3.12 ...)")
    ap.add_argument("nixl_wheel", help="nixl-*-py3-none-any.whl (the importable name over nixl_cu13)")
    ap.add_argument("out", help="the .tar.xz to write")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "site"
        for whl in (a.cu13_wheel, a.nixl_wheel):
            with zipfile.ZipFile(whl) as z:
                z.extractall(tree)
        for p in tree.rglob("*"):  # zipfile drops the modes: the libraries must stay loadable
            if p.is_file() and _is_elf(p):
                os.chmod(p, 0o755)
        kept, dropped = slim(tree)
        with tarfile.open(a.out, "w:xz", preset=9) as tar:
            for p in sorted(tree.iterdir()):
                tar.add(p, arcname=p.name)
    size = os.path.getsize(a.out)
    print(f"{a.out}: {kept} files kept, {dropped} dropped, {size / 2**20:.1f} MiB "
          f"(wheel {os.path.getsize(a.cu13_wheel) / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
