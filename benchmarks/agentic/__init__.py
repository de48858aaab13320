"""Agentic multi-turn benchmark: long coding-agent sessions replayed turn after turn.

    nvfp4-serve bench gen-trace --out trace.jsonl [--scale 0.01 | --fit-pool-tokens P --saturate-at C]
    nvfp4-serve bench --trace trace.jsonl --concurrency 1 2 4 8 --out agentic.json --launch [up args...]
    nvfp4-serve bench agentic-report agentic.json... --out docs/benchmarks/agentic.md

Modules: ``trace`` (the JSONL format), ``generate`` (synthetic coding-agent traces), ``prompts`` (token ids of
every turn), ``client`` (one streamed turn with its output ids), ``replay`` (C sessions in flight, one point),
``sweep`` (the ``--trace`` command: points, flushes, integrity checks, dtypes), ``report`` (markdown + PNGs).
"""
