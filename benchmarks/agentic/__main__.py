"""``python -m benchmarks.agentic`` (also ``nvfp4-serve bench``): the agentic trace commands.

    gen-trace --out FILE [options]            synthetic coding-agent trace (benchmarks.agentic.generate)
    agentic-report RESULTS... [--out MD]       markdown + PNGs (benchmarks.agentic.report)
    --trace FILE --concurrency C... ...        replay sweep (benchmarks.agentic.sweep)
"""

from __future__ import annotations

import sys

COMMANDS = ("gen-trace", "agentic-report")


def is_agentic(argv: list[str]) -> bool:
    """Whether a ``nvfp4-serve bench`` command line is one of these (the part before ``--launch``)."""
    own = argv[:argv.index("--launch")] if "--launch" in argv else argv
    return bool(own) and (own[0] in COMMANDS or any(a == "--trace" or a.startswith("--trace=") for a in own))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "gen-trace":
        from benchmarks.agentic.generate import main as run

        return run(argv[1:])
    if argv and argv[0] == "agentic-report":
        from benchmarks.agentic.report import main as run

        return run(argv[1:])
    if not is_agentic(argv):
        print(__doc__, file=sys.stderr)
        return 2
    from benchmarks.agentic.sweep import main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
