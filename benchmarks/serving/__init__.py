"""Serving benchmark client: drives a deployment through the OpenAI API with fixed-length random-id prompts.

    python -m benchmarks.serving run   --base-url URL | --launch [nvfp4-serve up args...] --input-len N ...
    python -m benchmarks.serving sweep --concurrency 1 4 16 64 ... (same options; one JSON with every point)
    python -m benchmarks.serving plot  results.json... --out-dir docs/benchmarks

Modules: ``config`` (BenchConfig), ``dataset`` (random-id prompts), ``client`` (one streamed request, C in
flight), ``stats`` (throughput, peak-batch decode throughput, latency percentiles), ``server`` (/server_info,
pool sampling, decode GetMetrics), ``launch`` (start/stop ``nvfp4-serve up``), ``runner`` (one point, a
sweep), ``report`` (table and JSON), ``plot`` (PNG figures), ``progress`` (progress bar).
"""
