"""The offline engine: model + paged pool + radix cache + scheduler in one process.

    engine = Engine(EngineConfig(model_dir="path/to/hf_checkpoint", cache=CacheConfig(kv_dtype="nvfp4")))
    outs = engine.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=32))

The prefill and decode services wrap the same object (engine/engine_loop.py runs it on a thread).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention_paths import AttentionPaths
from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphRunner, max_width_pages
from engine.host_pool import make_host_pool
from engine.integrity import IntegrityReport
from engine.kv_pool import KVPool, PoolCapacity
from engine.kv_rotation import head_rotation
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.outcome import FinishReason
from engine.page_allocator import PageAllocator
from engine.radix_cache import RadixCache
from engine.request import Request, StepOutput
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.startup_error import StartupError
from nvfp4_kernels import programmatic_launch
from nvfp4_kernels.backends.registry import get_backend
from nvfp4_kernels.kv_layout import bytes_per_token_per_layer
from tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GenerationOutput:
    rid: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_cached_tokens: int


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.resolved_device())
        programmatic_launch.set_enabled(not config.disable_pdl)  # before any capture or compile
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        try:  # every failure here is the checkpoint's (missing files, unsupported model, bad tensors)
            loaded = load_model(config.model_dir, device=self.device, dtype=dtype, num_layers=config.num_layers,
                                fused_ops=not config.disable_fused_ops)
            self.tokenizer = Tokenizer.from_dir(config.model_dir)
        except (OSError, ValueError, NotImplementedError) as e:
            raise StartupError(f"cannot serve {config.model_dir}: {e}") from e
        self.model, self.model_config, self.fingerprint = loaded.model, loaded.config, loaded.fingerprint
        mc, cc = self.model_config, config.cache
        n_layers = mc.num_hidden_layers
        # Checkpoint k_scale/v_scale are FP8 scales (amax / 448, the vLLM/ModelOpt convention): an nvfp4
        # pool uses them for its FP8 workspace and scale / 6 (= amax / (6 * 448)) as its global scale.
        ckpt = loaded.kv_scales if cc.k_scales is None and cc.v_scales is None else None
        pool_div = 6.0 if cc.kv_dtype == "nvfp4" else 1.0
        ckpt_pool = {key: [x / pool_div for x in vals] for key, vals in ckpt.items()} if ckpt else None
        self.k_scales = _per_layer(cc.k_scales, ckpt_pool, "k", n_layers)
        self.v_scales = _per_layer(cc.v_scales, ckpt_pool, "v", n_layers)
        if cc.kv_dtype == "fp8_e4m3":
            ws_k, ws_v = self.k_scales, self.v_scales  # the workspace holds the pool's own FP8 bytes
        else:
            ws_k = _per_layer(cc.ws_k_scales, ckpt, "k", n_layers)
            ws_v = _per_layer(cc.ws_v_scales, ckpt, "v", n_layers)
        self.max_context_len = served_context_len(config.context_length, mc.max_context_len, config.model_dir)
        num_pages, ws_tokens = self._size_pool()
        self.pool = KVPool(cc.kv_dtype, n_layers, num_pages, cc.page_size, mc.num_key_value_heads, mc.head_dim,
                           device=self.device, k_scales=self.k_scales, v_scales=self.v_scales,
                           ws_k_scales=ws_k, ws_v_scales=ws_v, scratch_pages=1)
        self.allocator = PageAllocator(num_pages)
        self.host_pool = make_host_pool(self.pool, cc)  # None unless --host-cache-size
        self.cache = RadixCache(cc.page_size, self.allocator, self.host_pool)
        self.backend = get_backend(config.attention_backend, self.device, config.nvfp4_decode_kernel)
        rotation = head_rotation(cc.kv_rotation, mc.head_dim, self.device, self.model.dtype)
        if rotation is not None:
            self.model.rotate_kv(rotation)
        self.paths = AttentionPaths(self.pool, self.backend, ws_tokens, mc.num_attention_heads,
                                    mc.head_dim ** -0.5, self.device)
        graphs = None
        if self.device.type == "cuda" and not config.disable_cuda_graph:
            graphs = DecodeGraphRunner(self.model, self.paths, self.device,
                                       min(config.cuda_graph_max_bs, config.scheduler.max_running_requests),
                                       max_width_pages(self.max_context_len, cc.page_size), capture=True)
            t0 = time.perf_counter()
            try:
                if num := graphs.warm_kernels():
                    log.info("decode kernels warmed for %d (batch, width) shapes in %.1f s", num,
                             time.perf_counter() - t0)
            except Exception:  # an optimisation only: without it kernels compile on first use, as before
                log.warning("decode kernel warm-up failed; kernels compile on first use", exc_info=True)
        eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids or ())
        self.eos_token_ids = eos  # the tokenizer's and the model config's
        self.runner = ModelRunner(self.model, self.paths, self.device, graphs, eos)
        self.scheduler = Scheduler(self.runner, self.allocator, self.cache, cc.page_size, config.scheduler,
                                   self.max_context_len, ws_tokens, eos, self.device, mc.vocab_size)
        cap = self.capacity()
        log.info("KV pool: %s, %d pages x %d tokens = %d tokens, %.2f GiB; workspace %d tokens (%.1f MiB); "
                 "backend %s on %s; decode CUDA graphs: %s", cap.kv_dtype, cap.num_pages, cap.page_size, cap.max_tokens,
                 cap.total_bytes / 2**30, ws_tokens, self.paths.workspace_bytes / 2**20, self.backend.name,
                 self.device, f"up to batch {graphs.max_batch}" if graphs else "off")
        self._ids = itertools.count()

    def _size_pool(self) -> tuple[int, int]:
        """(num_pages, workspace_tokens) from --max-total-tokens, --mem-fraction-static or the CPU default."""
        mc, cc = self.model_config, self.config.cache
        ws_tokens = cc.workspace_tokens or self.max_context_len
        ws_row = 2 * mc.num_key_value_heads * mc.head_dim * (2 if cc.kv_dtype == "bf16" else 1)
        per_token = mc.num_hidden_layers * bytes_per_token_per_layer(cc.kv_dtype, mc.num_key_value_heads,
                                                                     mc.head_dim)
        if cc.max_total_tokens is not None:
            tokens = cc.max_total_tokens
            if self.device.type == "cuda":  # an explicit size must fit what is free (another service may share it)
                free, _ = torch.cuda.mem_get_info(self.device)
                need = tokens * per_token + min(ws_tokens, tokens) * ws_row
                if need > free:
                    raise StartupError(
                        f"--max-total-tokens {tokens} needs {need / 2**30:.1f} GiB for the KV pool and workspace, "
                        f"{free / 2**30:.1f} GiB are free on this GPU after the weights (other processes count): lower "
                        "--max-total-tokens (or, for a prefill under `nvfp4-serve up`, --prefill-max-total-tokens) "
                        "or --workspace-tokens")
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - cc.mem_fraction_static) - ws_tokens * ws_row
            if budget < per_token * cc.page_size:
                gib = 2**30
                raise StartupError(
                    f"not enough GPU memory for the KV pool: {free / gib:.1f} of {total / gib:.1f} GiB free after "
                    f"loading the weights; --mem-fraction-static {cc.mem_fraction_static} keeps "
                    f"{total * (1.0 - cc.mem_fraction_static) / gib:.1f} GiB back and the workspace of {ws_tokens} "
                    f"tokens takes {ws_tokens * ws_row / gib:.2f} GiB, leaving less than one page "
                    f"({per_token * cc.page_size / 2**20:.2f} MiB): raise --mem-fraction-static, lower "
                    "--workspace-tokens or --context-length, or set --max-total-tokens (other processes on this "
                    "GPU count against its free memory)")
            tokens = int(budget // per_token)
        else:
            tokens = cc.cpu_default_tokens
        num_pages = max(1, tokens // cc.page_size)
        return num_pages, min(ws_tokens, num_pages * cc.page_size)

    # -- introspection ------------------------------------------------------------------------------
    def capacity(self) -> PoolCapacity:
        return self.pool.capacity()

    def check_integrity(self) -> IntegrityReport:
        return self.scheduler.check_integrity()

    # -- offline API ------------------------------------------------------------------------------
    def new_request(self, prompt: str | Sequence[int], sampling: SamplingParams, rid: str | None = None,
                    **kw) -> Request:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return Request(rid or f"req-{next(self._ids)}", ids, sampling, **kw)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Run prompts to completion with continuous batching; outputs in prompt order."""
        if sampling is None:
            sampling = SamplingParams()
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        reqs = [self.new_request(p, sp) for p, sp in zip(prompts, params)]
        for r in reqs:
            self.scheduler.submit(r)
        results: dict[str, list[StepOutput]] = {r.rid: [] for r in reqs}
        while self.scheduler.has_work:
            for out in self.scheduler.step():
                if isinstance(out, StepOutput):
                    results[out.rid].append(out)
        outs = []
        for r in reqs:
            ids = [t for o in results[r.rid] for t in o.new_token_ids]
            outs.append(GenerationOutput(r.rid, r.prompt_ids, ids, self.tokenizer.decode(ids),
                                         r.finish_reason, r.num_cached_tokens))
        return outs


def served_context_len(requested: int | None, model_len: int, model_dir: str) -> int:
    """The engine's max context: ``--context-length`` when given (at most the model's), else the model's."""
    if requested is None:
        return model_len
    if requested > model_len:
        raise StartupError(f"--context-length {requested} is longer than {model_dir} supports ({model_len} tokens, "
                           f"from config.json and its rope scaling): pass at most {model_len}")
    return requested


def _per_layer(given: Sequence[float] | None, checkpoint: dict | None, key: str, n: int) -> list[float]:
    """Per-layer scales: explicit config > checkpoint k_scale/v_scale > 1.0."""
    vals = list(given) if given is not None else (list(checkpoint[key]) if checkpoint else [1.0] * n)
    if len(vals) != n:
        raise ValueError(f"{len(vals)} {key} scales given for a model of {n} layers")
    if not all(math.isfinite(v) and v > 0 for v in vals):
        raise ValueError(f"{key} scales must be finite and > 0, got {vals}")
    return [float(v) for v in vals]
