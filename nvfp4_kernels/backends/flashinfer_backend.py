"""FlashInfer-based pieces: ragged causal prefill on FP8/BF16 K/V, and the FlashInfer decode baselines.

Imported only on CUDA machines (the triton backend imports it lazily); ``flashinfer_available()`` says
whether the package imports. Every FlashInfer kernel JIT-compiles on first use (about 25 s each); set
FLASHINFER_WORKSPACE_BASE to keep the cache between processes.

``FlashInferPrefill``  out = causal attention of BF16 q over K/V rows (bf16, or fp8 with per-layer scales),
                       bottom-right aligned like ``AttentionBackend.prefill``.
``FlashInferDecode``   FlashInfer's paged decode over one pool layer in our layout (NHD pages), for bf16,
                       fp8_e4m3 and nvfp4 pools; used as the baseline in benchmarks.kernels and as the FP8
                       decode path when it is faster than ours.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from nvfp4_kernels.kv_layout import LayerKV

_WORKSPACE_BYTES = 256 * 1024 * 1024


@functools.cache
def flashinfer_available() -> bool:
    """True when ``import flashinfer`` works (never raises)."""
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


@functools.cache
def _workspace(device: torch.device) -> torch.Tensor:
    # FlashInfer requires the float workspace zeroed before its first use; shared by all wrappers.
    return torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def _require() -> None:
    if not flashinfer_available():
        raise RuntimeError("flashinfer is not importable; install the 'gpu' extra (flashinfer-python) "
                           "or use the reference/triton backend")


class FlashInferPrefill:
    """Ragged causal prefill via ``BatchPrefillWithRaggedKVCacheWrapper`` (FA2 backend)."""

    def __init__(self, device: torch.device) -> None:
        _require()
        import flashinfer

        self._wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device), "NHD", backend="fa2")
        self._planned: tuple | None = None

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype, sm_scale: float,
             host_key: tuple | None = None) -> None:
        """Plans once per batch: ``host_key`` (e.g. the host-side lengths) identifies the batch without
        reading the device indptr back (a sync per layer otherwise)."""
        lens = host_key if host_key is not None else (tuple(qo_indptr.tolist()), tuple(kv_indptr.tolist()))
        key = (qo_indptr.data_ptr(), kv_indptr.data_ptr(), lens,
               num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, sm_scale)
        if key == self._planned:
            return
        self._wrapper.plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, causal=True,
                           sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        self._planned = key

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
        """q [Tq, Hq, D] bf16; k, v [Tkv, Hk, D] bf16 or float8_e4m3fn (real = stored * scale)."""
        if k.dtype == torch.float8_e4m3fn:
            return self._wrapper.run(q, k, v, k_scale=k_scale, v_scale=v_scale)
        return self._wrapper.run(q, k, v)


def jit_specs(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> list:
    """The FlashInfer JIT modules (``JitSpec``) that ``FlashInferPrefill`` and ``FlashInferDecode`` load for
    q in ``q_dtype`` over K/V in ``kv_dtype`` (bf16 or float8_e4m3fn): both resolve to the same FA2 batch-prefill
    module, the call flashinfer 0.7.2's ``get_batch_prefill_module("fa2", ...)`` builds. The ragged prefill
    asks for fa2; the tensor-core decode's "auto" is fa2 for bf16 K/V and, since FA3 takes FP8 K/V only with
    an FP8 query, for fp8 K/V on every GPU. Arguments as the wrappers' plans pass them: o in q's dtype, int32
    indptr, no position encoding, window, soft cap or fp16 QK reduction. ``spec.build()`` compiles one into
    FlashInfer's JIT cache for the archs of FLASHINFER_CUDA_ARCH_LIST (no GPU needed)."""
    _require()
    from flashinfer.prefill import _gen_batch_prefill_primary_module

    return [_gen_batch_prefill_primary_module("fa2", q_dtype, kv_dtype, q_dtype, torch.int32, head_dim, head_dim,
                                              0, False, False, False)]


def paged_indices(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr, indices, last_page_len) int32 in FlashInfer's CSR form from a [B, max_pages] page table."""
    lens = seq_lens.to(torch.int64)
    num_pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64, device=page_table.device)
    indptr[1:] = torch.cumsum(num_pages, 0)
    cols = torch.arange(page_table.shape[1], device=page_table.device)
    indices = page_table[cols[None, :] < num_pages[:, None]]
    last = lens - (num_pages - 1) * page_size
    return indptr.to(torch.int32), indices.to(torch.int32).contiguous(), last.to(torch.int32)


_ROW_CUT_WIDTH = 512  # table widths from which paged_indices_host cuts row by row (see there)


def paged_indices_host(page_table: np.ndarray, seq_lens: np.ndarray, page_size: int
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``paged_indices`` on host arrays (numpy int32 results). Runs before every fp8/bf16 decode graph replay,
    while the GPU waits: a wide table (long contexts) is cut row by row, a narrow one masked whole, whichever is
    faster there (``python -m benchmarks.engine.bench_host_staging``: docs/benchmarks/host_staging.md)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    num_pages = (lens + page_size - 1) // page_size
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    cut = csr_rows if page_table.shape[1] >= _ROW_CUT_WIDTH and len(lens) else csr_masked
    last = (lens - (num_pages - 1) * page_size).astype(np.int32)
    return indptr, cut(page_table, num_pages), last


def csr_rows(page_table: np.ndarray, num_pages: np.ndarray) -> np.ndarray:
    """The first ``num_pages[i]`` ids of each row, concatenated (int32): one slice per row."""
    return np.concatenate([page_table[i, :n] for i, n in enumerate(num_pages.tolist())]).astype(np.int32, copy=False)


def csr_masked(page_table: np.ndarray, num_pages: np.ndarray) -> np.ndarray:
    """``csr_rows`` as one mask over the whole table."""
    cols = np.arange(page_table.shape[1])
    return np.ascontiguousarray(page_table[cols[None, :] < num_pages[:, None]], dtype=np.int32)


class FlashInferDecode:
    """FlashInfer paged decode over a pool layer (bf16 / fp8_e4m3 / nvfp4), planned once per batch.

    ``use_tensor_cores`` picks FlashInfer's prefill-style (tensor core) or CUDA-core decode kernel;
    ``kv_layout`` "NHD" reads our pool pages as they are, "HND" expects pages laid out [P, Hk, S, ...]
    (what FlashInfer's NVFP4 kernels prefer; the benchmark uses it for a fair baseline).
    """

    def __init__(self, device: torch.device, use_tensor_cores: bool = True, kv_layout: str = "NHD",
                 graph_batch: int | None = None, max_pages: int = 0) -> None:
        """``graph_batch``: a CUDA-graph wrapper for exactly that batch size, whose page indices (at most
        ``max_pages``) live in fixed device buffers that ``plan_host`` rewrites before each replay."""
        _require()
        import flashinfer

        self.device = torch.device(device)
        self.kv_layout = kv_layout
        self.graph_batch = graph_batch
        buffers = {}
        if graph_batch is not None:
            if graph_batch < 1 or max_pages < graph_batch:
                raise ValueError(f"a graph wrapper needs graph_batch >= 1 and max_pages >= graph_batch "
                                 f"(got {graph_batch}, {max_pages})")
            buffers = {
                "use_cuda_graph": True,
                "paged_kv_indptr_buffer": torch.zeros(graph_batch + 1, dtype=torch.int32, device=device),
                "paged_kv_indices_buffer": torch.zeros(max_pages, dtype=torch.int32, device=device),
                "paged_kv_last_page_len_buffer": torch.zeros(graph_batch, dtype=torch.int32, device=device)}
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _workspace(device), kv_layout, use_tensor_cores=use_tensor_cores, **buffers)

    def plan(self, page_table: torch.Tensor, seq_lens: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, kv_dtype: str, q_dtype: torch.dtype, sm_scale: float) -> None:
        indptr, indices, last = paged_indices(page_table, seq_lens, page_size)
        self._plan_csr(indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, kv_dtype, q_dtype,
                       sm_scale)

    def plan_host(self, page_table: np.ndarray, seq_lens: np.ndarray, num_qo_heads: int, num_kv_heads: int,
                  head_dim: int, page_size: int, kv_dtype: str, q_dtype: torch.dtype, sm_scale: float) -> None:
        """``plan`` from host arrays (no device->host sync): page_table [B, W] int32, seq_lens [B]. The CSR goes to
        the wrapper in pinned memory, so its copies to the device are asynchronous: a copy from pageable memory
        can wait for the work queued before it (the decode step in flight, under overlap scheduling)."""
        indptr, indices, last = (torch.from_numpy(a).pin_memory()
                                 for a in paged_indices_host(page_table, seq_lens, page_size))
        # the page ids go to the device here: FlashInfer copies ids it gets on the host with a blocking copy
        indices = indices.to(self.device, non_blocking=True)
        self._plan_csr(indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, kv_dtype, q_dtype,
                       sm_scale)

    def _plan_csr(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, num_qo_heads: int,
                  num_kv_heads: int, head_dim: int, page_size: int, kv_dtype: str, q_dtype: torch.dtype,
                  sm_scale: float) -> None:
        data_type = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "nvfp4": torch.uint8}[kv_dtype]
        self._wrapper.plan(indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size,
                           q_data_type=q_dtype, kv_data_type=data_type, sm_scale=sm_scale)

    def run(self, q: torch.Tensor, layer: LayerKV, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
            k_sf: torch.Tensor | None = None, v_sf: torch.Tensor | None = None) -> torch.Tensor:
        """Decode q [B, Hq, D] over ``layer`` (or over explicit k/v/scale tensors in ``kv_layout``)."""
        k = layer.k if k is None else k
        v = layer.v if v is None else v
        if layer.kv_dtype == "bf16":
            return self._wrapper.run(q, (k, v))
        if layer.kv_dtype == "fp8_e4m3":
            return self._wrapper.run(q, (k, v), k_scale=layer.k_scale, v_scale=layer.v_scale)
        k_sf = layer.k_sf.view(torch.uint8) if k_sf is None else k_sf
        v_sf = layer.v_sf.view(torch.uint8) if v_sf is None else v_sf
        return self._wrapper.run(q, (k, v), k_scale=layer.k_scale, v_scale=layer.v_scale, kv_cache_sf=(k_sf, v_sf))


def nvfp4_dequantize_rows(data: torch.Tensor, scales: torch.Tensor, global_scale: float) -> torch.Tensor:
    """FlashInfer's own NVFP4 KV dequantize of rows [M, D/2] + [M, D/16] -> fp32 [M, D] (format check)."""
    _require()
    import flashinfer

    g = torch.tensor([global_scale], dtype=torch.float32, device=data.device)
    out = flashinfer.nvfp4_kv_dequantize(data.contiguous(), scales.view(torch.uint8).contiguous(), g,
                                         output_dtype=torch.bfloat16)
    return out.float()

