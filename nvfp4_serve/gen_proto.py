"""Regenerate the gRPC stubs in nvfp4_serve_proto/ from proto/ (the one documented command).

    python -m nvfp4_serve.gen_proto            # rewrite the stubs
    python -m nvfp4_serve.gen_proto --check    # exit 1 if the committed stubs are stale

Needs grpcio-tools (the `test` extra pins the version the committed stubs were made with).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = "nvfp4_serve_proto"


def generate(out_root: Path) -> list[Path]:
    """Write <out_root>/nvfp4_serve_proto/*_pb2*.py(i) and return the written files."""
    import grpc_tools
    from grpc_tools import protoc  # imported here: grpcio-tools is a dev/test dependency only

    sources = sorted((PROTO_DIR / PACKAGE).glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *map(str, sources)]
    (out_root / PACKAGE).mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    init = out_root / PACKAGE / "__init__.py"
    init.write_text('"""Generated gRPC stubs of proto/ (python -m nvfp4_serve.gen_proto). Do not edit."""\n')
    return sorted(p for p in (out_root / PACKAGE).iterdir() if p.is_file())


def stale_files() -> list[str]:
    """Names of generated files that differ from (or are missing in) the committed package."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = ROOT / PACKAGE
        names = {p.name for p in fresh} | {p.name for p in committed.glob("*.py*")}
        bad = []
        for name in sorted(names):
            a, b = Path(tmp) / PACKAGE / name, committed / name
            if not (a.exists() and b.exists() and filecmp.cmp(a, b, shallow=False)):
                bad.append(name)
        return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that the committed stubs are fresh")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale_files()
        if bad:
            print(f"stale gRPC stubs: {bad}; run: python -m nvfp4_serve.gen_proto", file=sys.stderr)
            return 1
        print("gRPC stubs are fresh")
        return 0
    for p in generate(ROOT):
        print(p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
