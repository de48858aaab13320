"""The package layering (docs/structure.md): each top-level package imports only the packages below it, so
there is no cycle between them; the router runs without torch and without the engine; the serving code keeps
functions and classes small enough to read. Checked on the source (ast), every import counted, lazy ones too."""

from __future__ import annotations

import ast
import functools
import pickle
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. A package may import itself and what it lists here, nothing else of the project.
ALLOWED: dict[str, frozenset[str]] = {
    "nvfp4_serve_proto": frozenset(),
    "nvfp4_kernels": frozenset(),
    "tokenization": frozenset(),
    "engine": frozenset({"nvfp4_kernels", "tokenization"}),
    "svc_common": frozenset({"nvfp4_kernels", "tokenization", "engine", "nvfp4_serve_proto"}),
    "offline": frozenset({"nvfp4_kernels", "tokenization", "engine", "svc_common"}),
    "prefill_svc": frozenset({"nvfp4_kernels", "tokenization", "engine", "svc_common", "nvfp4_serve_proto"}),
    "decode_svc": frozenset({"nvfp4_kernels", "tokenization", "engine", "svc_common", "nvfp4_serve_proto"}),
    "router": frozenset({"tokenization", "svc_common", "nvfp4_serve_proto"}),
    "nvfp4_serve": frozenset({"nvfp4_kernels", "tokenization", "engine", "svc_common", "offline", "prefill_svc",
                              "decode_svc", "router", "nvfp4_serve_proto", "benchmarks"}),  # bench
}
PROJECT = frozenset(ALLOWED) | {"benchmarks", "tests"}
SERVING = ("nvfp4_kernels", "tokenization", "engine", "svc_common", "prefill_svc", "decode_svc", "router", "nvfp4_serve")
MAX_FUNCTION_LINES = 80
MAX_METHODS = 20


_PARSE = """
import ast, pickle, sys
from pathlib import Path
paths = sys.argv[1:]
sys.stdout.buffer.write(pickle.dumps([ast.parse(Path(p).read_text(encoding="utf-8"), filename=p) for p in paths]))
"""


@functools.cache
def _parsed(package: str) -> tuple[tuple[Path, ast.AST], ...]:
    """The package's modules parsed in a fresh interpreter: CPython 3.11's AST builder keeps its recursion
    depth per interpreter, so a parse in another thread of the test process (threads earlier tests left
    running) can make this one fail with "AST constructor recursion depth mismatch"."""
    paths = [path for path in sorted((ROOT / package).rglob("*.py"))
             if package != "nvfp4_serve_proto" and "__pycache__" not in path.parts]
    out = subprocess.run([sys.executable, "-c", _PARSE, *map(str, paths)], capture_output=True, check=True)
    return tuple(zip(paths, pickle.loads(out.stdout)))


def _modules(package: str):
    yield from _parsed(package)


def _imported_packages(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def test_every_package_imports_only_the_packages_below_it():
    wrong = []
    for package, allowed in ALLOWED.items():
        for path, tree in _modules(package):
            for line, top in _imported_packages(tree):
                if top in PROJECT and top != package and top not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {top}")
    assert not wrong, "\n".join(wrong)


def test_the_allowed_imports_have_no_cycle():
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(p: str, path: tuple[str, ...]) -> None:
        assert seen.get(p) != 1, " -> ".join((*path, p))
        if p not in seen:
            seen[p] = 1
            for q in ALLOWED[p] & ALLOWED.keys():  # benchmarks (used by the CLI only) is not layered
                visit(q, (*path, p))
            seen[p] = 2
    for p in ALLOWED:
        visit(p, ())


def test_every_package_is_in_the_layering():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - PROJECT == set(), "a new top-level package needs its row in ALLOWED and docs/structure.md"


def test_the_router_imports_neither_torch_nor_the_engine():
    code = ("import importlib, pkgutil, sys, router\n"
            "for m in pkgutil.walk_packages(router.__path__, 'router.'): importlib.import_module(m.name)\n"
            "import router.app\n"
            "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'engine', 'nvfp4_kernels'))\n"
            "print(bad)\n"
            "sys.exit(1 if bad else 0)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def _is_triton_jit(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit":
            return True
    return False


def test_serving_functions_and_classes_stay_small():
    long = []
    for package in SERVING:
        for path, tree in _modules(package):
            for node in ast.walk(tree):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_jit(node):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{where} function {node.name}: {lines} lines")
                elif isinstance(node, ast.ClassDef):
                    methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
                    if len(methods) > MAX_METHODS:
                        long.append(f"{where} class {node.name}: {len(methods)} methods")
    assert not long, "\n".join(long)


def test_no_failure_is_told_apart_by_its_text():
    """Failures are typed end to end (enums in the engine's outputs and the protos, status tables): nothing
    decides what happened by reading a gRPC status's details or an exception's message."""
    matched = []
    for package in SERVING:
        for path, tree in _modules(package):
            for node in ast.walk(tree):
                if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
                    text = ast.unparse(node)
                    if any(w in text for w in ("details", "str(e", "str(exc", ".message", "error.lower")):
                        matched.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in ("startswith", "partition") and "details()" in ast.unparse(node):
                    matched.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not matched, "\n".join(matched)
