"""The host tier's storage: KV pages of one device pool kept in host memory, block scales included.

Layout: one host tensor ``[H, page_bytes]`` uint8, page-major: host page h holds one device page's raw bytes of
every layer and part (k, k_sf, v, v_sf: packed E2M1 / E4M3 / bf16 values and the E4M3 block scales), in the
order of ``nvfp4_kernels.page_stage`` (layer by layer, parts in that order). A batch moves as ONE launch of the
page-stage kernel, whatever the layer count and however scattered its host pages:

- ``CopyPath.DIRECT`` (the default): the kernel reads and writes the pinned host pages themselves over the bus,
  each program one part of one page (on CPU the same with the reference ops);
- ``CopyPath.STAGED`` (where the GPU cannot map the host pages, or when asked): a gather into device staging,
  one device -> host copy per run of consecutive host pages, and the reverse for a load, in chunks of at most
  ``STAGE_BYTES``.

Pinned memory when the device pool is on CUDA, page-locked at its exact size (``engine/pinned_memory.py``;
host <-> device copies run asynchronously on one side stream),
plain memory on CPU. A host page is bytes only; the pool is built for ONE device pool and keeps that pool's
identity (``PoolIdentity``: dtype, geometry and every layer's global K/V scales), checked on every copy, so a
page can never come back into a pool that would read it with another layout or global scale.

Ownership (checked by ``engine.integrity``): ``allocate`` hands host pages to the caller (the radix cache,
which holds each host page in exactly one node); ``free`` gives them back. A host page is free or owned,
never both.

When a host page may be read: all copies (``store`` device -> host, ``load`` host -> device) are issued in
order on ONE stream (the side stream on CUDA; synchronously on CPU), so a load of a host page always runs
after the store that wrote it, and a store into a reused host page always runs after every earlier load of
it. After each batch the compute stream waits for the side stream: device pages freed after a store are
rewritten only once the store has read them, and a request's extend reads loaded pages only once they
landed. ``load`` refuses a host page that is not owned (free pages hold no data).
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.config import CacheConfig
from engine.kv_pool import KVPool
from engine.pinned_memory import page_locked, release
from engine.startup_error import StartupError
from nvfp4_kernels import page_stage
from nvfp4_kernels.kv_layout import KV_DTYPES, bytes_per_token_per_layer

log = logging.getLogger(__name__)

_PARTS = ("k", "k_sf", "v", "v_sf")
STAGE_BYTES = 64 << 20  # device staging per chunk of a batch (a large eviction moves in chunks of this size)


class CopyPath(enum.Enum):
    """How a batch crosses between the device pool and the host pages (module docstring)."""

    DIRECT = "direct"
    STAGED = "staged"


class PoolIdentity(NamedTuple):
    """What a host page's bytes mean: a page is only ever copied back into a pool with the same identity."""

    kv_dtype: str
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]

    @classmethod
    def of(cls, pool: KVPool) -> PoolIdentity:
        return cls(pool.kv_dtype, pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim,
                   tuple(lkv.k_scale for lkv in pool.layers), tuple(lkv.v_scale for lkv in pool.layers))


class HostTierStats(NamedTuple):
    """Counters since start (read through ``Scheduler.stats().host_tier``; metrics and GetLoad report them)."""

    num_pages: int
    num_used_pages: int
    page_size: int
    kv_dtype: str
    total_bytes: int
    hit_tokens: int  # prompt tokens loaded back from the host for admitted requests
    num_loads: int  # load batches (one per request whose prefix came back)
    num_loaded_pages: int
    num_stores: int  # store batches (one per eviction that wrote pages to the host)
    num_stored_pages: int
    load_bytes: int
    store_bytes: int
    load_seconds: float  # copy time (CUDA events on GPU, wall time on CPU)
    store_seconds: float
    copy_path: CopyPath  # how batches cross

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def load_gbps(self) -> float:
        return self.load_bytes / self.load_seconds / 1e9 if self.load_seconds > 0 else 0.0

    @property
    def store_gbps(self) -> float:
        return self.store_bytes / self.store_seconds / 1e9 if self.store_seconds > 0 else 0.0


class HostPool:
    """``num_pages`` host pages shaped like ``pool``'s; batched copies between the two (see module docstring)."""

    def __init__(self, pool: KVPool, num_pages: int, path: CopyPath | None = None) -> None:
        if num_pages < 1:
            raise ValueError(f"a host tier needs at least 1 page (got {num_pages}); raise --host-cache-size")
        self.identity = PoolIdentity.of(pool)
        self.pool = pool
        self.num_pages = num_pages
        self.page_size = pool.page_size
        self.page_bytes = pool.page_size * pool.bytes_per_token  # all layers, K + V + block scales
        cuda = pool.device.type == "cuda"
        self.pinned = cuda
        # the pool's parts in staging order; KVPool allocates them once, so their addresses (which the staging
        # kernel reads from the plan's table) hold for the pool's life
        self._plan = page_stage.StagePlan.of(
            [getattr(lkv, name) for lkv in pool.layers for name in _PARTS if getattr(lkv, name) is not None])
        if self._plan.page_bytes != self.page_bytes:
            raise ValueError(f"host tier: the pool's parts hold {self._plan.page_bytes} bytes per page, its "
                             f"layout says {self.page_bytes}")
        if cuda:  # page-locked at exactly its size (engine/pinned_memory.py), unregistered in ``close``
            self.pages, self._registered = page_locked((num_pages, self.page_bytes))
        else:
            self.pages, self._registered = torch.empty((num_pages, self.page_bytes), dtype=torch.uint8), False
        self._stream = torch.cuda.Stream(pool.device) if cuda else None
        self.path = path or (self._direct_works() if cuda else CopyPath.DIRECT)
        self._free = list(range(num_pages))  # min-heap: allocation hands out the smallest ids (runs stay long)
        self._owned = [False] * num_pages
        self._pending: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []  # timings not yet read
        self.hit_tokens = 0
        self.num_loads = self.num_loaded_pages = self.num_stores = self.num_stored_pages = 0
        self._seconds = {"load": 0.0, "store": 0.0}
        self._bytes = {"load": 0, "store": 0}

    # -- host page ownership ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> set[int]:
        """Snapshot of the free host page ids."""
        return set(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """MUTATES: the ``n`` smallest free host pages, now owned by the caller (RuntimeError when too few)."""
        if not self.can_allocate(n):
            raise RuntimeError(f"host tier: need {n} pages, {len(self._free)} free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for h in pages:
            self._owned[h] = True
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """MUTATES: give owned host pages back (RuntimeError naming the page on a double free)."""
        for h in pages:
            if not 0 <= h < self.num_pages or not self._owned[h]:
                raise RuntimeError(f"host tier: free of host page {h}, which is not owned (double free)")
        for h in pages:
            self._owned[h] = False
            heapq.heappush(self._free, h)

    # -- copies ----------------------------------------------------------------------------------
    def store(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Copy device pages into owned host pages (pairwise), every layer, data and block scales.

        Batched: one gather of every layer and part into staging, one copy per run of consecutive host pages.
        """
        self._copy("store", device_pages, host_pages)

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        """Copy owned host pages into device pages (pairwise); the compute stream sees them after this call.

        Batched: one copy per run of consecutive host pages into staging, one scatter of every layer and part.
        """
        self._copy("load", device_pages, host_pages)

    def _copy(self, kind: str, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        pool = self.pool
        now = PoolIdentity.of(pool)
        if now != self.identity:
            changed = [f for f, a, b in zip(PoolIdentity._fields, self.identity, now, strict=True) if a != b]
            raise ValueError(f"host tier: the device pool's {', '.join(changed)} differ from those the host pages "
                             "were stored with; refusing to copy (restart the service after changing KV scales)")
        if len(device_pages) != len(host_pages):
            raise ValueError(f"{len(device_pages)} device pages but {len(host_pages)} host pages")
        n = len(host_pages)
        if n == 0:
            return
        bad = [h for h in host_pages if not 0 <= h < self.num_pages or not self._owned[h]]
        if bad:
            raise RuntimeError(f"host tier: {kind} of host pages {bad[:8]} that are not owned")
        num_rows = self._plan.views[0].shape[0]  # device pages the parts hold (scratch pages included)
        off = [int(p) for p in device_pages if not 0 <= int(p) < num_rows]
        if off:  # the page-stage kernel indexes raw addresses: an id past the pool would touch other memory
            raise ValueError(f"host tier: {kind} of device pages {off[:8]} outside the pool's {num_rows}")
        # host side first (allocations, pinning): the timed window holds the GPU's copy, not the host's set-up
        idx = torch.tensor([[int(p) for p in device_pages], [int(h) for h in host_pages]], dtype=torch.int64)
        if self.pinned:  # from pinned memory on the side stream: a pageable copy would wait for the compute stream
            idx = idx.pin_memory()
        plan = self._plan
        t0 = time.perf_counter()
        start = end = None
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            # the ids first, outside the timed window: every torch call lets other threads take the GIL, and a
            # window open on the GPU while this thread waits for it would time the wait, not the copy
            ids, rows = idx.to(pool.device, non_blocking=True)
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream(pool.device))  # device pages written
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            if self.path is CopyPath.DIRECT:
                (page_stage.gather if kind == "store" else page_stage.scatter)(plan, ids, self.pages, rows)
            else:
                self._staged(kind, ids, host_pages)
            if end is not None:
                end.record()
        if self._stream is not None:
            torch.cuda.current_stream(pool.device).wait_stream(self._stream)
            self._pending.append((kind, n, start, end))
        else:
            self._seconds[kind] += time.perf_counter() - t0
        self._bytes[kind] += n * self.page_bytes
        if kind == "store":
            self.num_stores += 1
            self.num_stored_pages += n
        else:
            self.num_loads += 1
            self.num_loaded_pages += n

    def _staged(self, kind: str, ids: torch.Tensor, host_pages: Sequence[int]) -> None:
        """``CopyPath.STAGED``: device staging in chunks, one device <-> host copy per run of host pages."""
        per_chunk = max(1, STAGE_BYTES // self.page_bytes)
        for c0 in range(0, len(host_pages), per_chunk):
            chunk, hosts = ids[c0:c0 + per_chunk], host_pages[c0:c0 + per_chunk]
            stage = torch.empty((chunk.numel(), self.page_bytes), dtype=torch.uint8, device=self.pool.device)
            if kind == "store":
                page_stage.gather(self._plan, chunk, stage)
                for i, a, b in _runs(hosts):
                    self.pages[a:b].copy_(stage[i:i + b - a], non_blocking=True)
            else:
                for i, a, b in _runs(hosts):
                    stage[i:i + b - a].copy_(self.pages[a:b], non_blocking=True)
                page_stage.scatter(self._plan, chunk, stage)

    def _direct_works(self) -> CopyPath:
        """DIRECT if a kernel can write these host pages (device page 0 into free host page 0, compared with the
        reference), else STAGED with a warning: some systems do not map pinned host memory for kernels."""
        ids = torch.zeros(1, dtype=torch.int64, device=self.pool.device)
        want = torch.empty((1, self.page_bytes), dtype=torch.uint8, device=self.pool.device)
        try:
            page_stage.gather_reference(self._plan, ids, want)
            page_stage.gather(self._plan, ids, self.pages, ids)
            torch.cuda.synchronize(self.pool.device)
            if torch.equal(self.pages[0], want[0].cpu()):
                return CopyPath.DIRECT
            why = "it wrote other bytes"
        except (RuntimeError, ValueError) as e:  # Triton: "Pointer argument ... cannot be accessed"
            why = f"{type(e).__name__}: {e}"
        log.warning("host tier: kernels cannot write the pinned host pages (%s); copying through device staging",
                    why)
        return CopyPath.STAGED

    # -- stats -----------------------------------------------------------------------------------
    def stats(self) -> HostTierStats:
        """Counters since start; reads the timings of copies the GPU has finished (never waits for it)."""
        still = []
        for kind, n, start, end in self._pending:
            if end.query():
                self._seconds[kind] += start.elapsed_time(end) / 1e3
            else:
                still.append((kind, n, start, end))
        self._pending = still
        return HostTierStats(
            num_pages=self.num_pages, num_used_pages=self.num_pages - len(self._free), page_size=self.page_size,
            kv_dtype=self.identity.kv_dtype, total_bytes=self.num_pages * self.page_bytes,
            hit_tokens=self.hit_tokens, num_loads=self.num_loads, num_loaded_pages=self.num_loaded_pages,
            num_stores=self.num_stores, num_stored_pages=self.num_stored_pages, load_bytes=self._bytes["load"],
            store_bytes=self._bytes["store"], load_seconds=self._seconds["load"],
            store_seconds=self._seconds["store"], copy_path=self.path)

    def synchronize(self) -> None:
        """Wait for every issued copy (tests and benchmarks; the engine never needs to)."""
        if self._stream is not None:
            self._stream.synchronize()

    def close(self) -> None:
        """Wait for the copies, then unlock the host pages (once; copies after it would run synchronously)."""
        if getattr(self, "_registered", False):
            self.synchronize()
            release(self.pages)
            self._registered = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone; the process frees the pages
            self.close()


def _runs(host_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Consecutive host ids as (index in the batch, first id, end id): [5, 6, 7, 2] -> [(0, 5, 8), (3, 2, 3)]."""
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(host_pages):
        j = i + 1
        while j < len(host_pages) and host_pages[j] == host_pages[j - 1] + 1:
            j += 1
        out.append((i, int(host_pages[i]), int(host_pages[j - 1]) + 1))
        i = j
    return out



def make_host_pool(pool: KVPool, config: CacheConfig) -> HostPool | None:
    """The host tier ``config`` asks for (None when off), sized in whole pages; logs its size in tokens of each
    KV dtype (the same bytes hold 16/9 as many nvfp4 tokens as fp8_e4m3 ones)."""
    if not (config.host_cache_bytes or config.host_cache_tokens):
        return None
    page_bytes = pool.page_size * pool.bytes_per_token
    if config.host_cache_tokens:
        num_pages = config.host_cache_tokens // pool.page_size
        given = f"{config.host_cache_tokens} tokens"
    else:
        num_pages = config.host_cache_bytes // page_bytes
        given = f"{config.host_cache_bytes} bytes"
    if num_pages < 1:
        raise StartupError(f"--host-cache-size {given} holds no page: one page of {pool.page_size} tokens takes "
                           f"{page_bytes} bytes here ({pool.kv_dtype}); give at least {page_bytes} bytes or "
                           f"{pool.page_size}tokens, or 0 for no host tier")
    try:
        host = HostPool(pool, num_pages, None if config.host_copy_path == "auto" else CopyPath(config.host_copy_path))
    except RuntimeError as e:  # pinned allocation failed: too much for this host
        raise StartupError(f"cannot allocate the host tier ({num_pages * page_bytes / 2**30:.2f} GiB of "
                           f"{'pinned' if pool.device.type == 'cuda' else 'host'} memory): {e}; lower "
                           "--host-cache-size") from e
    total = num_pages * page_bytes
    per_dtype = ", ".join(
        f"{d} {total // (pool.num_layers * bytes_per_token_per_layer(d, pool.num_kv_heads, pool.head_dim))}"
        for d in KV_DTYPES)
    log.info("host tier: %d pages x %d tokens = %d %s tokens, %.2f GiB %s memory, %s copies (the same bytes hold, "
             "in tokens: %s)", num_pages, pool.page_size, num_pages * pool.page_size, pool.kv_dtype, total / 2**30,
             "pinned" if host.pinned else "host", host.path.value, per_dtype)
    return host
