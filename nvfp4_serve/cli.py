"""The `nvfp4-serve` command: `up` (all in one), one service (`prefill`, `decode`, `router`), or a tool
(`calibrate`, `eval`, `bench`, `make-model`, `warm-cache`)."""

from __future__ import annotations

import sys

USAGE = """usage: nvfp4-serve COMMAND [options]

commands:
  up        router + one prefill (or none: --num-prefill 0) + N decode services on this machine
  prefill   one prefill gRPC service        (same as: python -m prefill_svc)
  decode    one decode gRPC service         (same as: python -m decode_svc)
  router    the OpenAI-compatible gateway   (same as: python -m router)
  calibrate per-layer KV global scales from calibration text (for --kv-scales FILE)
  eval      KV-cache accuracy on held-out text: perplexity, KL vs bf16, greedy agreement
  bench     serving benchmark through the OpenAI API (run | sweep | plot | experiments;
            python -m benchmarks.serving)
  make-model random-weight HF checkpoint, e.g. OUT_DIR --preset qwen3-8b --device cuda
            (same as: python -m offline.tiny_model)
  warm-cache compile the Triton and FlashInfer kernels a server on a given GPU needs, without that GPU
            (into TRITON_CACHE_DIR and FLASHINFER_WORKSPACE_BASE; the GPU image runs it at build time)

`nvfp4-serve COMMAND --help` lists each command's options and their defaults;
`nvfp4-serve --version` prints the version."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from svc_common.cli_help import DIST_NAME, version

        print(f"{DIST_NAME} {version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "up":
        from nvfp4_serve.launcher import up

        return up(rest)
    if cmd == "prefill":
        from prefill_svc.__main__ import main as run
    elif cmd == "decode":
        from decode_svc.__main__ import main as run
    elif cmd == "router":
        from router.__main__ import main as run
    elif cmd == "calibrate":
        from offline.calibration import main as run
    elif cmd == "eval":
        from offline.evaluation import main as run
    elif cmd == "bench":
        from benchmarks.serving.__main__ import main as run
    elif cmd == "make-model":
        from offline.tiny_model import main as make_model

        return make_model(rest, prog="nvfp4-serve make-model")
    elif cmd == "warm-cache":
        from offline.warm_cache import main as warm_cache

        return warm_cache(rest, prog="nvfp4-serve warm-cache")
    else:
        print(f"nvfp4-serve: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
