"""The cuda-ipc transfer path's tensor side: share a prefill's pool tensors once and open them in a decode
process; the copies themselves are ``svc_common.page_import.PageImporter.copy_from_layers``.

    prefill process                                   decode process
    export_share(pool)  --KVShare (gRPC, once)-->      open_share(share, pool) -> PoolView (cached per prefill)
    pool writes; Fence.wait()  --KVPageRefs-->         PageImporter.copy_from_layers(view parts, ...) per run of
                                                       pages of every layer, on writer threads
                               <--ReleaseTransfer--    once every copy is complete (PageImporter.finish)

Handles are torch's own CUDA IPC (``UntypedStorage._share_cuda_`` / ``rebuild_cuda_tensor``, what
``torch.multiprocessing`` sends between processes), serialized field by field into ``SharedTensor``
(never pickled: a KVShare is data, not code). The decode opens every handle on ITS OWN device: the
memory is mapped into that device's address space (peer access across GPUs is enabled lazily by
CUDA), so copies are ordinary kernels on the decode's side stream.

``PoolView`` is the only thing the copy reads, so CPU tests hand it a view of an in-process pool
(``pool_view``) and exercise everything but the handles themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.fence import Fence  # noqa: F401 - re-exported: the transfer's fences
from engine.kv_pool import KVPool
from nvfp4_serve_proto import prefill_pb2

PARTS = ("k", "k_sf", "v", "v_sf")
_DTYPES = {"uint8": torch.uint8, "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass(frozen=True)
class PoolView:
    """Per-layer tensors ``[num_pages, S, Hk, X]`` of a pool (another process's, through IPC, or this one's)."""

    num_pages: int  # rows of every tensor (the pool's allocator pages and any scratch pages after them)
    layers: tuple[dict[str, torch.Tensor], ...]  # part name -> tensor; scales only for nvfp4


def _layer_parts(pool: KVPool, layer: int) -> dict[str, torch.Tensor]:
    lkv = pool.layers[layer]
    return {name: t for name, t in zip(PARTS, (lkv.k, lkv.k_sf, lkv.v, lkv.v_sf), strict=True) if t is not None}


def pool_rows(pool: KVPool) -> int:
    """Pages in each of ``pool``'s tensors: its allocator pages plus any scratch pages."""
    return pool.layers[0].k.shape[0]


def pool_view(pool: KVPool) -> PoolView:
    """A view of ``pool``'s own tensors (no copy)."""
    return PoolView(pool_rows(pool), tuple(_layer_parts(pool, i) for i in range(pool.num_layers)))


# -- prefill side ----------------------------------------------------------------------------------------
def describe_tensors(pool: KVPool) -> list[prefill_pb2.SharedTensor]:
    """Layer, part, dtype, shape and strides of every tensor of ``pool`` (no handles)."""
    return [prefill_pb2.SharedTensor(layer=i, part=part, dtype=str(t.dtype).removeprefix("torch."),
                                     shape=list(t.shape), stride=list(t.stride()), storage_offset=t.storage_offset())
            for i in range(pool.num_layers) for part, t in _layer_parts(pool, i).items()]


def export_share(pool: KVPool) -> list[prefill_pb2.SharedTensor]:
    """``describe_tensors`` plus the CUDA IPC handles of each tensor's storage. Call once per process (each
    call adds torch IPC bookkeeping). Raises RuntimeError when the pool is not on a CUDA device, or torch
    cannot share its memory."""
    if pool.device.type != "cuda":
        raise RuntimeError(f"the KV pool is on {pool.device}: only CUDA pools can be shared through CUDA IPC")
    out = describe_tensors(pool)
    for st in out:
        t = _layer_parts(pool, st.layer)[st.part]
        (_, handle, size_bytes, offset_bytes, rc_handle, rc_offset, ev_handle,
         ev_sync) = t.untyped_storage()._share_cuda_()
        st.ipc_handle, st.storage_size_bytes, st.storage_offset_bytes = handle, size_bytes, offset_bytes
        st.ref_counter_handle, st.ref_counter_offset = rc_handle, rc_offset
        st.event_handle, st.event_sync_required = ev_handle or b"", bool(ev_sync)
    return out


# -- decode side -----------------------------------------------------------------------------------------
def check_share(share: prefill_pb2.KVShare, pool: KVPool) -> None:
    """Raise ValueError unless ``share`` describes, for every layer and part of ``pool``, one contiguous
    tensor of ``share.num_pages`` pages with this pool's page shape and dtype."""
    if share.num_pages < 1:
        raise ValueError(f"the share has {share.num_pages} pages")
    want = {(i, part): t for i in range(pool.num_layers) for part, t in _layer_parts(pool, i).items()}
    got = {(st.layer, st.part): st for st in share.tensors}
    if set(got) != set(want) or len(share.tensors) != len(want):
        raise ValueError(f"the share holds tensors {sorted(got)[:8]}..., this pool needs {len(want)} "
                         f"(layers 0..{pool.num_layers - 1}, parts {'/'.join(_layer_parts(pool, 0))})")
    for key, st in got.items():
        t = want[key]
        shape = [share.num_pages, *t.shape[1:]]
        stride = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        if _DTYPES.get(st.dtype) is not t.dtype or list(st.shape) != shape or list(st.stride) != stride:
            raise ValueError(f"shared tensor {key} is {st.dtype} {list(st.shape)} stride {list(st.stride)}, "
                             f"expected {str(t.dtype).removeprefix('torch.')} {shape} stride {stride}")


def open_share(share: prefill_pb2.KVShare, pool: KVPool) -> PoolView:
    """Open the prefill pool ``share`` on the device of the local ``pool`` (checked with ``check_share``).

    Raises ValueError or RuntimeError when it cannot be opened (other host, IPC namespace, driver)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if pool.device.type != "cuda":
        raise RuntimeError(f"this KV pool is on {pool.device}: CUDA IPC needs a CUDA pool on both ends")
    check_share(share, pool)
    index = pool.device.index if pool.device.index is not None else torch.cuda.current_device()
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(pool.num_layers)]
    for st in share.tensors:
        layers[st.layer][st.part] = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(st.shape), tuple(st.stride), st.storage_offset, torch.UntypedStorage,
            _DTYPES[st.dtype], index, st.ipc_handle, st.storage_size_bytes, st.storage_offset_bytes, False,
            st.ref_counter_handle, st.ref_counter_offset, st.event_handle, st.event_sync_required)
    return PoolView(int(share.num_pages), tuple(layers))


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Maximal (src_start, dst_start, length) runs where both sides advance by one page."""
    if len(src) != len(dst):
        raise ValueError(f"page_runs: {len(src)} source and {len(dst)} destination pages")
    if not src:
        return []
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    cuts = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1  # where a new run starts
    starts = np.concatenate(([0], cuts))
    lengths = np.diff(np.concatenate((starts, [len(s)])))
    return list(zip(s[starts].tolist(), d[starts].tolist(), lengths.tolist(), strict=True))
