"""What one benchmark point measures (``BenchConfig``) and where it sends requests (``Target``)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """The deployment under test: the router's base URL (no ``/v1``), the model id and tokenizer directory
    ("" -> taken from /server_info), and the API key ("" -> none).

    ``token_ids``: ask for ``return_token_ids`` (the nvfp4-serve router and vLLM implement it) so that every
    chunk is timed with the number of tokens it carries, and TTFT is the first generated *token*. Without it
    (``--no-token-ids``, for servers that reject the field) chunks are timed by their text, as
    ``sglang.bench_serving`` does; that is only right when nearly every token decodes to text on its own, which
    random-weight checkpoints with a small tokenizer (``make-model --preset``) do not: most of their sampled
    ids are outside the tokenizer and decode to "", so text chunks arrive tens of tokens apart."""

    base_url: str
    model: str = ""
    tokenizer_dir: str = ""
    api_key: str = ""
    token_ids: bool = True

    def __post_init__(self) -> None:
        url = self.base_url.rstrip("/")
        url = url.removesuffix("/v1")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https:// (got {self.base_url!r})")
        object.__setattr__(self, "base_url", url)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark point: ``num_prompts`` prompts of exactly ``input_len`` random token ids, each asking for
    ``output_len`` tokens (ignore_eos: exactly that many), at most ``concurrency`` requests in flight.

    ``request_rate`` (requests/s, Poisson arrivals from ``seed``) bounds the arrivals too; inf sends as fast
    as the concurrency allows. ``warmup`` requests (same input length, min(output_len, 16) tokens, other
    prompts) run first and are not measured; ``flush_cache`` then empties the decode workers' prefix caches.
    ``peak_window_s`` is the window of the peak-batch decode throughput (see ``stats``), ``sample_interval_s``
    the period of the /server_info pool sampling, ``num_gpus`` the GPUs the deployment uses (per-GPU figures).
    """

    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    seed: int = 0
    ignore_eos: bool = True
    warmup: int = 1
    request_rate: float = math.inf
    flush_cache: bool = True
    peak_window_s: float = 1.0
    sample_interval_s: float = 0.5
    request_timeout_s: float = 3600.0
    num_gpus: int = 1
    save_requests: bool = True

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "concurrency", "num_prompts", "num_gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (inf: no rate limit), got {self.request_rate}")
        for name in ("peak_window_s", "sample_interval_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")

    @property
    def batch(self) -> int:
        """Requests that can be decoding at once: the concurrency, unless there are fewer prompts."""
        return min(self.concurrency, self.num_prompts)

    @property
    def warmup_output_len(self) -> int:
        return min(self.output_len, 16)
