"""The FlashInfer parts of the Triton backend, each with the reference as its fallback.

``FlashInferRaggedPrefill``  prefill through ``FlashInferPrefill`` (ragged FA2 on bf16 / fp8 K,V) when the
                             tensors are on CUDA in a dtype it takes and flashinfer imports, else the fallback
``FlashInferPagedDecode``    decode of fp8 / bf16 pools through ``FlashInferDecode`` on CUDA when flashinfer
                             imports, else the fallback

FlashInfer plans its decode on the host: a ``static`` plan holds a CUDA-graph FlashInfer wrapper whose CSR
buffers ``refresh`` rewrites from host arrays before each replay. The wrapper lives on the plan's
``DecodeState`` (``fallback``, ``fallback_args``), which ``TritonNvfp4Decode.plan`` builds for every plan.

``nvfp4_kernels.backends.flashinfer_backend`` (and through it flashinfer) is imported only here, in ``_flashinfer``,
on first use: constructing a backend never imports it.
"""

from __future__ import annotations

import numpy as np
import torch

from nvfp4_kernels.backends.base import DecodeOptions, DecodePlan, PrefillPlan
from nvfp4_kernels.backends.reference import ReferenceBackend
from nvfp4_kernels.backends.triton_decode import DecodeState
from nvfp4_kernels.kv_layout import LayerKV


def _flashinfer():
    """The module with ``FlashInferPrefill``, ``FlashInferDecode`` and ``flashinfer_available``, imported lazily."""
    from nvfp4_kernels.backends import flashinfer_backend

    return flashinfer_backend


class FlashInferRaggedPrefill:
    """Ragged causal prefill over workspace K/V (whatever the pool dtype); one FlashInfer wrapper per device."""

    name = "flashinfer-prefill"

    def __init__(self, fallback: ReferenceBackend) -> None:
        self.fallback = fallback
        self._prefill: dict[torch.device, object] = {}

    def prefill(self, plan: PrefillPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_scale: float, v_scale: float, sm_scale: float) -> torch.Tensor:
        fib = _flashinfer()
        usable = (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
                  and k.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn) and fib.flashinfer_available())
        if not usable:
            return self.fallback.prefill(plan, q, k, v, k_scale, v_scale, sm_scale)
        fi = self._prefill.get(q.device)
        if fi is None:
            fi = self._prefill[q.device] = fib.FlashInferPrefill(q.device)
        fi.plan(plan.qo_indptr, plan.kv_indptr, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim,
                q.dtype, k.dtype, sm_scale, host_key=(tuple(plan.qo_lens), tuple(plan.kv_lens)))
        return fi.run(q, k, v, k_scale, v_scale)


class FlashInferPagedDecode:
    """Paged decode of fp8 / bf16 pools read in place (NHD pages), planned per batch or per replay."""

    name = "flashinfer-decode"

    def __init__(self, fallback: ReferenceBackend) -> None:
        self.fallback = fallback

    def prepare(self, plan: DecodePlan, options: DecodeOptions) -> None:
        """On CUDA with flashinfer: the plan's wrapper, planned now unless ``options.static``."""
        dev = plan.page_table.device
        if dev.type != "cuda":
            return
        fib = _flashinfer()
        if fib.flashinfer_available():
            st = plan.backend_state
            batch, max_pages = plan.page_table.shape
            # A static plan gets a CUDA-graph wrapper whose CSR buffers hold every page the table can name
            # (plus one per row for padded rows). Rows may share pages (a cached prefix), so the CSR can name
            # up to batch * max_pages entries whatever the pool size: size the index buffer by the table.
            fi = fib.FlashInferDecode(dev, use_tensor_cores=True,
                                      graph_batch=batch if options.static else None,
                                      max_pages=batch * max_pages)
            st.fallback = (fi, (options.kv_dtype, options.sm_scale))
            st.fallback_args = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size,
                                options.kv_dtype, options.q_dtype, options.sm_scale)
            if not options.static:
                fi.plan(plan.page_table, plan.seq_lens, *st.fallback_args)

    def refresh(self, plan: DecodePlan, page_table: np.ndarray, seq_lens: np.ndarray) -> None:
        st = plan.backend_state
        if isinstance(st, DecodeState) and st.fallback is not None and st.fallback_args is not None:
            st.fallback[0].plan_host(page_table, seq_lens, *st.fallback_args)

    def warm(self, layer: LayerKV, shapes: list[tuple[int, int]], num_qo_heads: int,
             q_dtype: torch.dtype, sm_scale: float, fill_page: int) -> int:
        """Runs nothing ahead: the start-up warm-up covers the Triton NVFP4 decode only."""
        return 0

    def decode(self, plan: DecodePlan, q: torch.Tensor, layer: LayerKV, sm_scale: float) -> torch.Tensor:
        fib = _flashinfer()
        st = plan.backend_state
        if q.is_cuda and fib.flashinfer_available():
            if not isinstance(st, DecodeState) or st.fallback is None or st.fallback[1] != (layer.kv_dtype, sm_scale):
                fi = fib.FlashInferDecode(q.device, use_tensor_cores=True)
                fi.plan(plan.page_table, plan.seq_lens, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim,
                        plan.page_size, layer.kv_dtype, q.dtype, sm_scale)
                if isinstance(st, DecodeState):
                    st.fallback = (fi, (layer.kv_dtype, sm_scale))
            else:
                fi = st.fallback[0]
            return fi.run(q, layer)
        return self.fallback.decode(plan, q, layer, sm_scale)
