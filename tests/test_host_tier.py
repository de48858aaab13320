"""The host tier: evicted pages wait in host memory with their block scales and come back bit-identical.

Unit level: a tiny KVPool + HostPool + RadixCache with exact page ids; engine level: the tiny model, outputs
against an engine without the tier; integrity of both tiers under seeded random aborts.
"""

from __future__ import annotations

import argparse
import contextlib
import random

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.host_cache_size import HostCacheSize, host_cache_size_arg, parse_host_cache_size
from engine.host_pool import CopyPath, HostPool, make_host_pool
from engine.integrity import IntegrityReport, check_integrity
from engine.kv_pool import KVPool
from engine.page_allocator import PageAllocator
from engine.radix_cache import HOST_STORE_MIN_BYTES, RadixCache, host_store_min_pages
from engine.radix_node import walk
from engine.sampling import SamplingParams
from engine.startup_error import StartupError

S = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_pool(kv_dtype: str = "nvfp4", num_pages: int = 8, device: str = "cpu") -> KVPool:
    pool = KVPool(kv_dtype, num_layers=2, num_pages=num_pages, page_size=S, num_kv_heads=2, head_dim=32,
                  k_scales=[0.5, 0.25], v_scales=[1.0, 2.0], device=device)
    g = torch.Generator().manual_seed(7)
    for lkv in pool.layers:  # random bytes everywhere, scales included (NaN codes too: bytes are bytes)
        for t in (lkv.k, lkv.v, lkv.k_sf, lkv.v_sf):
            if t is not None:
                raw = t.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8).to(device))
    return pool


def page_bytes(pool: KVPool, page: int) -> list[bytes]:
    """Every layer's K, K scales, V, V scales bytes of one page."""
    return [b"".join(pool.export_pages(layer, [page])) for layer in range(pool.num_layers)]


def tiered_cache(num_pages: int = 8, num_host_pages: int = 4, kv_dtype: str = "bf16", store_min_pages: int = 1):
    """An eviction frees what it is asked for (``store_min_pages`` 1) unless a test says otherwise."""
    pool = make_pool(kv_dtype, num_pages)
    alloc = PageAllocator(num_pages)
    host = HostPool(pool, num_host_pages)
    return pool, alloc, host, RadixCache(S, alloc, host, store_min_pages=store_min_pages)


def seq(first: int, num_pages: int) -> list[int]:
    return list(range(first, first + num_pages * S))


def cache_seq(cache: RadixCache, alloc: PageAllocator, tokens: list[int]) -> list[int]:
    """A request computed ``tokens`` into fresh pages and finished: the cache keeps them."""
    pages = alloc.allocate(len(tokens) // S)
    cache.insert(tokens, pages)
    alloc.decref(pages)
    return pages


# -- the host pool: bit-exact round trips, identity, ownership --------------------------------------------
@pytest.mark.parametrize("path", list(CopyPath))
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "nvfp4"])
def test_round_trip_through_the_host_is_bit_exact_with_block_scales(kv_dtype, path):
    pool = make_pool(kv_dtype)
    before = {p: page_bytes(pool, p) for p in (3, 5, 6)}
    host = HostPool(pool, 4, path)
    assert host.path is path
    hp = host.allocate(3)
    assert hp == [0, 1, 2]
    host.store([3, 5, 6], [hp[2], hp[0], hp[1]])  # out of order: pairs, not positions
    pool.poison(0x00)
    host.load([hp[2], hp[0], hp[1]], [1, 7, 2])
    assert [page_bytes(pool, p) for p in (1, 7, 2)] == [before[3], before[5], before[6]]
    assert host.pages.shape == (4, S * pool.bytes_per_token)  # every layer's K, V and (nvfp4) block scales
    st = host.stats()
    assert (st.num_stores, st.num_stored_pages, st.num_loads, st.num_loaded_pages) == (1, 3, 1, 3)
    assert st.load_bytes == st.store_bytes == 3 * S * pool.bytes_per_token


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("path", list(CopyPath))
def test_a_batch_of_scattered_pages_moves_bit_exactly(monkeypatch, device, path):
    """Device and host pages in no order; STAGED in chunks smaller than the batch (runs broken across chunk
    boundaries). On CUDA: the page-stage kernel, pinned host pages (read and written by the kernel itself on the
    DIRECT path, which CUDA picks by default) and the side stream."""
    import engine.host_pool

    pool = make_pool("nvfp4", num_pages=8, device=device)
    monkeypatch.setattr(engine.host_pool, "STAGE_BYTES", 3 * S * pool.bytes_per_token)  # 3 pages per chunk
    before = {p: page_bytes(pool, p) for p in range(8)}
    assert HostPool(pool, 8).path is CopyPath.DIRECT
    host = HostPool(pool, 8, path)
    hp = host.allocate(8)
    order = [6, 1, 7, 0, 3, 2, 5, 4]
    host.store(order, [hp[i] for i in (0, 1, 2, 4, 5, 6, 3, 7)])  # runs broken across chunk boundaries
    pool.poison(0x00)
    host.load([hp[i] for i in (0, 1, 2, 4, 5, 6, 3, 7)], order)
    host.synchronize()
    assert {p: page_bytes(pool, p) for p in range(8)} == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_host_pages_are_page_locked_at_their_exact_size():
    """engine/pinned_memory.py: registered with cudaHostRegister, not taken from PyTorch's caching host allocator
    (which rounds to a power of two), and unlocked by ``close``. CUDA itself says whether a range is locked: a
    second registration of it fails as already registered, an unregistration of an unlocked range fails."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats()["allocated_bytes.current"] if stats else None
    pool = make_pool("nvfp4", device="cuda")
    host = HostPool(pool, 3)
    assert host._registered
    cudart = torch.cuda.cudart()
    again = int(getattr(r := cudart.cudaHostRegister(host.pages.data_ptr(), 4096, 0), "value", r))
    _consume_cuda_error()
    assert again == 712  # cudaErrorHostMemoryAlreadyRegistered
    if stats:
        assert stats()["allocated_bytes.current"] == before
    want = page_bytes(pool, 1)  # asynchronous copies through the registered pages round-trip exactly
    hp = host.allocate(1)
    host.store([1], hp)
    pool.poison(0x00)
    host.load(hp, [1])
    host.synchronize()
    assert page_bytes(pool, 1) == want
    ptr = host.pages.data_ptr()
    host.close()
    assert not host._registered
    gone = int(getattr(r := cudart.cudaHostUnregister(ptr), "value", r))
    _consume_cuda_error()
    assert gone == 713  # cudaErrorHostMemoryNotRegistered: close unlocked it


def _consume_cuda_error() -> None:
    """A failed runtime call leaves its error for the next launch check, which would fail an unrelated kernel
    later: a launch here reports (and so clears) it."""
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()


def test_a_pool_whose_global_scales_changed_cannot_read_host_pages():
    pool = make_pool("nvfp4")
    host = HostPool(pool, 2)
    host.store([0], host.allocate(1))
    pool.layers[1].v_scale = 4.0
    with pytest.raises(ValueError, match="v_scales differ"):
        host.load([0], [1])


def test_a_free_host_page_is_never_read_and_never_freed_twice():
    host = HostPool(make_pool(), 2)
    with pytest.raises(RuntimeError, match="not owned"):
        host.load([1], [0])
    with pytest.raises(ValueError, match=r"store of device pages \[8\] outside the pool's 8"):
        host.store([8], host.allocate(1))
    hp = host.allocate(1)
    host.free(hp)
    with pytest.raises(RuntimeError, match="double free"):
        host.free(hp)


# -- the radix cache over two tiers -----------------------------------------------------------------------
def test_evicted_pages_go_to_the_host_and_come_back_into_fresh_device_pages():
    pool, alloc, host, cache = tiered_cache(num_pages=4, num_host_pages=4)
    a = seq(100, 2)
    assert cache_seq(cache, alloc, a) == [0, 1]
    before = [page_bytes(pool, p) for p in (0, 1)]
    assert cache.evict(2) == [1, 0]
    assert cache.residency(a) == ["host", "host"] and cache.match_prefix(a).num_tokens == 0
    assert alloc.num_free == 4 and host.num_free == 2
    pool.poison(0xAB)
    other = alloc.allocate(1)  # page 0 is taken: the prefix comes back elsewhere
    assert cache.load_from_host(a) == 2 * S
    m = cache.match_prefix(a)
    assert m.page_ids == [1, 2] and m.num_tokens == 2 * S
    assert [page_bytes(pool, p) for p in m.page_ids] == before
    assert cache.residency(a) == ["both", "both"]
    alloc.decref(other)
    assert check_integrity(alloc, cache, []) == IntegrityReport(4, 2, 2, 0, 4, 2, 2)
    # on both tiers already: a second eviction copies nothing
    stores = host.stats().num_stores
    cache.evict(2)
    assert host.stats().num_stores == stores and cache.residency(a) == ["host", "host"]


def test_a_partial_eviction_splits_the_node_and_stores_only_its_tail():
    _pool, alloc, _host, cache = tiered_cache(num_pages=4, num_host_pages=4)
    a = seq(0, 3)
    cache_seq(cache, alloc, a)
    assert cache.evict(1) == [2]
    assert cache.residency(a) == ["device", "device", "host"]
    assert cache.match_prefix(a).page_ids == [0, 1]
    assert cache.load_from_host(a) == S and cache.match_prefix(a).page_ids == [0, 1, 2]
    check_integrity(alloc, cache, [])


def test_with_a_host_tier_an_eviction_stores_a_batch_of_at_least_store_min_pages_in_one_copy():
    _pool, alloc, host, cache = tiered_cache(num_pages=8, num_host_pages=8, store_min_pages=3)
    a, b = seq(0, 2), seq(100, 2)
    cache_seq(cache, alloc, a)
    cache_seq(cache, alloc, b)  # a is the least recently used
    assert cache.evict(1) == [1, 0, 3]  # a's two pages, then b's last: one batch of 3, one copy
    assert host.stats().num_stores == 1 and host.num_free == 5
    assert cache.residency(a) == ["host", "host"] and cache.residency(b) == ["device", "host"]
    assert cache.evict(1) == [2]  # fewer evictable than the batch: what there is
    assert cache.evict(0) == [] and host.stats().num_stores == 2
    check_integrity(alloc, cache, [])
    # the default batch, and none without a tier: an eviction frees what it is asked for
    assert RadixCache(S, alloc, host).store_min_pages == host_store_min_pages(host.page_bytes) >= 1
    assert HOST_STORE_MIN_BYTES == 64 << 20 and host_store_min_pages(1 << 20) == 64  # e.g. a 36-layer fp8 page
    assert host_store_min_pages(262144) == 256 and host_store_min_pages(3 << 20) == 22
    assert host_store_min_pages(HOST_STORE_MIN_BYTES + 1) == 1
    plain_alloc = PageAllocator(4)
    plain = RadixCache(S, plain_alloc)
    cache_seq(plain, plain_alloc, seq(0, 3))
    assert plain.evict(1) == [2]
    with pytest.raises(ValueError, match="store_min_pages must be >= 1"):
        RadixCache(S, alloc, host, store_min_pages=0)


def test_a_full_host_tier_drops_its_least_recently_used_pages_first():
    _pool, alloc, host, cache = tiered_cache(num_pages=2, num_host_pages=2)
    a, b, c, d = seq(100, 1), seq(200, 1), seq(300, 1), seq(400, 1)
    cache_seq(cache, alloc, a)
    cache_seq(cache, alloc, b)
    assert cache.evict(2) == [0, 1]  # a (older) then b go to the host, in one batch
    assert cache.residency(a) == ["host"] and cache.residency(b) == ["host"]
    assert sorted(cache.host_pages()) == [0, 1] and host.stats().num_stores == 1
    cache_seq(cache, alloc, c)
    cache.evict(1)  # c needs a host page: a's goes (least recently used)
    assert (cache.residency(a), cache.residency(b), cache.residency(c)) == ([], ["host"], ["host"])
    assert cache.load_from_host(b) == S  # b is used again: now c is the least recent on the host
    cache_seq(cache, alloc, d)
    cache.evict(2)  # b leaves the device (its host copy stays), d takes c's host page
    assert (cache.residency(b), cache.residency(c), cache.residency(d)) == (["host"], [], ["host"])
    assert check_integrity(alloc, cache, []) == IntegrityReport(2, 2, 0, 0, 2, 0, 2)


def test_a_request_that_recomputes_a_host_only_prefix_puts_its_pages_back_on_the_device():
    _pool, alloc, _host, cache = tiered_cache(num_pages=4, num_host_pages=4)
    a = seq(0, 2)
    cache_seq(cache, alloc, a)
    cache.evict(2)
    pages = alloc.allocate(3)
    assert cache.insert(a + seq(500, 1), pages) == 2 * S  # the tree had those tokens (on the host)
    assert cache.residency(a + seq(500, 1)) == ["both", "both", "device"]
    alloc.decref(pages)
    check_integrity(alloc, cache, [])


def test_a_failed_load_frees_the_new_pages_and_drops_the_host_copy(monkeypatch):
    _pool, alloc, host, cache = tiered_cache(num_pages=4, num_host_pages=4)
    a = seq(0, 2)
    cache_seq(cache, alloc, a)
    cache.evict(2)

    def broken(*_a, **_k):
        raise RuntimeError("copy engine fault")

    monkeypatch.setattr(host, "load", broken)
    assert cache.load_from_host(a) == 0
    assert cache.residency(a) == [] and alloc.num_free == 4 and host.num_free == 4
    assert check_integrity(alloc, cache, []) == IntegrityReport(4, 4, 0, 0, 4, 4, 0)


def test_one_eviction_never_hands_a_host_page_to_two_of_its_stores(monkeypatch):
    """A full host tier makes room for each node an eviction stores; the nodes that same eviction already stored
    are host-only leaves with old access times, yet giving one's host page to a later node would have the one
    store write two device pages into it (one kernel launch on CUDA: either may land)."""
    _pool, alloc, host, cache = tiered_cache(num_pages=4, num_host_pages=2)
    a, b, c, d = seq(0, 1), seq(100, 1), seq(200, 1), seq(300, 1)
    cache_seq(cache, alloc, a)
    cache_seq(cache, alloc, b)
    cache.evict(2)  # the host holds a and b: full
    cache_seq(cache, alloc, c)
    assert cache.load_from_host(b) == S  # b is used again after c was cached: c is now the older one
    cache_seq(cache, alloc, d)
    stores = []
    real = host.store

    def recorded(dev, hosts):
        stores.append((list(dev), list(hosts)))
        real(dev, hosts)

    monkeypatch.setattr(host, "store", recorded)
    assert len(cache.evict(3)) == 3  # c (room: a's host copy goes), b (already on the host), d (room: b's goes)
    assert len(stores) == 1 and len(set(stores[0][1])) == len(stores[0][1]) == 2
    assert (cache.residency(a), cache.residency(b), cache.residency(c), cache.residency(d)) == \
        ([], [], ["host"], ["host"])
    check_integrity(alloc, cache, [])


def test_a_failed_store_drops_the_pages_as_without_a_tier_and_frees_everything(monkeypatch):
    """A store that fails (a CUDA fault, an identity refused) must not leave host pages that claim bytes they never
    got: the evicted nodes go, their device pages are freed, their host pages free, and later requests recompute."""
    _pool, alloc, host, cache = tiered_cache(num_pages=4, num_host_pages=4)
    a, b = seq(0, 2), seq(100, 1)
    cache_seq(cache, alloc, a)
    cache.evict(1)  # a's last page on the host (a good store)
    cache_seq(cache, alloc, b)

    def broken(*_a, **_k):
        raise RuntimeError("copy engine fault")

    monkeypatch.setattr(host, "store", broken)
    assert cache.evict(1) == [0]  # a's first page (least recent): a's node and its host-only child go
    assert cache.residency(a) == [] and cache.residency(b) == ["device"]
    assert alloc.num_free == 3 and host.num_free == 4
    assert check_integrity(alloc, cache, []) == IntegrityReport(4, 3, 1, 0, 4, 4, 0)
    monkeypatch.undo()
    cache_seq(cache, alloc, a)  # recomputed: cached again, and stored again on the next eviction
    assert len(cache.evict(3)) == 3
    assert cache.residency(a) == ["host", "host"] and cache.residency(b) == ["host"] and host.num_free == 1
    check_integrity(alloc, cache, [])


def test_flush_empties_both_tiers():
    _pool, alloc, _host, cache = tiered_cache(num_pages=4, num_host_pages=4)
    cache_seq(cache, alloc, seq(0, 2))
    cache.evict(1)
    cache_seq(cache, alloc, seq(900, 1))
    cache.flush()
    assert check_integrity(alloc, cache, []) == IntegrityReport(4, 4, 0, 0, 4, 4, 0)


def test_integrity_names_a_host_page_held_twice():
    _pool, alloc, _host, cache = tiered_cache(num_pages=4, num_host_pages=4)
    cache_seq(cache, alloc, seq(0, 1))
    cache_seq(cache, alloc, seq(50, 1))
    cache.evict(2)
    nodes = [n for n in walk(cache._root) if n.host_pages]
    nodes[1].host_pages = list(nodes[0].host_pages)
    with pytest.raises(Exception, match="host pages held by more than one node"):
        check_integrity(alloc, cache, [])


# -- --host-cache-size ------------------------------------------------------------------------------------
def test_host_cache_size_takes_bytes_or_tokens_and_says_what_to_give():
    assert parse_host_cache_size("8GiB") == HostCacheSize(num_bytes=8 * 2**30)
    assert parse_host_cache_size("1.5GB") == HostCacheSize(num_bytes=1_500_000_000)
    assert parse_host_cache_size("4096") == HostCacheSize(num_bytes=4096)
    assert parse_host_cache_size("64Ktokens") == HostCacheSize(num_tokens=64_000)
    assert not parse_host_cache_size("0").enabled
    assert str(parse_host_cache_size("100tokens")) == "100tokens"
    for bad in ("8 parsecs", "-1GiB", "lots", "0.5B"):
        with pytest.raises(argparse.ArgumentTypeError, match="give bytes"):
            host_cache_size_arg(bad)


def test_a_host_tier_too_small_for_one_page_is_refused_in_one_line():
    pool = make_pool("nvfp4")
    with pytest.raises(StartupError, match="holds no page.*give at least"):
        make_host_pool(pool, CacheConfig(page_size=S, host_cache_bytes=10))
    host = make_host_pool(pool, CacheConfig(page_size=S, host_cache_bytes=10 * S * pool.bytes_per_token))
    assert host is not None and host.num_pages == 10
    assert make_host_pool(pool, CacheConfig(page_size=S)) is None


def test_host_copy_path_picks_how_batches_cross_and_rejects_others(capsys):
    from decode_svc.config import build_arg_parser
    from engine.host_pool import CopyPath

    pool = make_pool("nvfp4")
    size = 10 * S * pool.bytes_per_token
    for given, want in (("auto", CopyPath.DIRECT), ("direct", CopyPath.DIRECT), ("staged", CopyPath.STAGED)):
        host = make_host_pool(pool, CacheConfig(page_size=S, host_cache_bytes=size, host_copy_path=given))
        assert host.path is want and host.stats().copy_path is want
    with pytest.raises(ValueError, match="--host-copy-path must be one of"):
        CacheConfig(host_copy_path="dma")
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(["--host-copy-path", "dma"])
    assert "--host-copy-path" in capsys.readouterr().err


def test_decode_parser_rejects_a_bad_host_cache_size(capsys):
    from decode_svc.config import build_arg_parser

    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(["--host-cache-size", "8 parsecs"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "--host-cache-size" in err[-1] and "give bytes" in err[-1]


# -- the engine -------------------------------------------------------------------------------------------
def make_engine(model_dir: str, kv_dtype: str = "nvfp4", pool_tokens: int = 96, host_tokens: int = 0,
                **sched) -> Engine:
    return Engine(EngineConfig(
        model_dir=model_dir, device="cpu", dtype="float32",
        cache=CacheConfig(kv_dtype=kv_dtype, page_size=S, max_total_tokens=pool_tokens,
                          host_cache_tokens=host_tokens),
        scheduler=SchedulerConfig(chunk_size=64, **sched)))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "nvfp4"])
def test_an_evicted_prefix_is_served_from_the_host_with_the_outputs_of_an_engine_without_it(
        tiny_model_dir, kv_dtype):
    shared = ids(40, 1)
    first, fillers, again = shared + ids(4, 2), [ids(60, 10 + i) for i in range(2)], shared + ids(6, 3)
    eng = make_engine(tiny_model_dir, kv_dtype, pool_tokens=96, host_tokens=256)
    eng.generate([first], GREEDY)
    eng.generate(fillers[:1], GREEDY)
    eng.generate(fillers[1:], GREEDY)  # the pool holds 96 tokens: the shared prefix is now on the host only
    assert "host" in eng.cache.residency(again) and eng.cache.match_prefix(again).num_tokens < 40
    hits = eng.scheduler.stats().host_tier.hit_tokens
    out = eng.generate([again], GREEDY)[0]
    st = eng.scheduler.stats().host_tier
    assert out.num_cached_tokens == 40  # every shared page: nothing of it was computed again
    assert st.hit_tokens - hits > 0 and st.num_loads >= 1 and st.num_stores >= 1
    plain = make_engine(tiny_model_dir, kv_dtype, pool_tokens=96)
    for p in (first, *fillers):
        plain.generate([p], GREEDY)
    assert plain.generate([again], GREEDY)[0].num_cached_tokens < 40  # without the tier: part recomputed
    big = make_engine(tiny_model_dir, kv_dtype, pool_tokens=1024)  # no tier, the prefix never leaves the device
    for p in (first, *fillers):
        big.generate([p], GREEDY)
    ref = big.generate([again], GREEDY)[0]
    assert ref.num_cached_tokens == 40 and out.token_ids == ref.token_ids
    report = eng.check_integrity()
    assert report.num_in_use == 0 and report.num_host_cached + report.num_host_free == report.num_host_total


def test_integrity_of_both_tiers_holds_under_random_aborts(tiny_model_dir):
    rng = random.Random(1234)
    eng = make_engine(tiny_model_dir, "nvfp4", pool_tokens=128, host_tokens=96, max_running_requests=4)
    stems = [ids(rng.randrange(8, 33), 100 + i) for i in range(4)]
    sched, live, n = eng.scheduler, [], 0
    for _ in range(60):
        if rng.random() < 0.5:
            prompt = rng.choice(stems) + ids(rng.randrange(1, 12), rng.randrange(10**6))
            req = eng.new_request(prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 8),
                                                         ignore_eos=True))
            sched.submit(req)
            live.append(req.rid)
            n += 1
        if live and rng.random() < 0.3:
            sched.abort(live.pop(rng.randrange(len(live))))
        sched.step()
        sched.check_integrity()
    while sched.has_work:
        sched.step()
        sched.check_integrity()
    st = sched.stats().host_tier
    assert n > 20 and st.num_stores > 0 and st.num_loads > 0  # both directions ran under the aborts
    report = sched.check_integrity()
    assert report.num_in_use == 0
    sched.cache.flush()
    assert sched.check_integrity() == IntegrityReport(32, 32, 0, 0, 24, 24, 0)


def test_an_abort_right_after_a_host_load_frees_everything(tiny_model_dir):
    eng = make_engine(tiny_model_dir, "nvfp4", pool_tokens=96, host_tokens=256)
    shared = ids(40, 1)
    eng.generate([shared + [7]], GREEDY)
    eng.generate([ids(60, 10)], GREEDY)
    eng.generate([ids(60, 11)], GREEDY)
    req = eng.new_request(shared + [9, 9], GREEDY)
    eng.scheduler.submit(req)
    loads = eng.scheduler.stats().host_tier.num_loads
    eng.scheduler._admit([])
    assert eng.scheduler.stats().host_tier.num_loads == loads + 1 and req.num_cached_tokens == 40
    eng.scheduler.abort(req.rid)
    report = eng.check_integrity()
    assert report.num_in_use == 0 and report.num_free + report.num_cached == report.num_total


# -- through a real decode service --------------------------------------------------------------------------
def test_a_decode_service_with_a_host_tier_serves_an_evicted_prefix_from_it(tiny_model_dir):
    import asyncio

    import grpc

    from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc
    from tests.service_procs import start

    def request(rid: str, token_ids: list[int]) -> decode_pb2.GenerateRequest:
        sp = common_pb2.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        return decode_pb2.GenerateRequest(request_id=rid, token_ids=token_ids, sampling=sp)

    async def drive(address: str):
        async with grpc.aio.insecure_channel(address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)

            async def gen(rid, token_ids):
                msgs = [m async for m in stub.Generate(request(rid, token_ids))]
                return [t for m in msgs for t in m.token_ids], msgs[0].cached_tokens

            shared = ids(40, 1)
            await gen("cold", shared + [5])
            first = await gen("first", shared + [5])  # its prefix from the device cache
            for i in range(2):
                await gen(f"filler-{i}", ids(60, 10 + i))
            again = await gen("again", shared + [5])
            load = await stub.GetLoad(common_pb2.GetLoadRequest())
            text = (await stub.GetMetrics(common_pb2.MetricsRequest())).prometheus_text
            report = await stub.CheckIntegrity(decode_pb2.CheckIntegrityRequest())
            return first, again, load, text, report

    proc = start("decode_svc", "--device", "cpu", "--dtype", "float32", "--model", tiny_model_dir,
                 "--page-size", str(S), "--max-total-tokens", "96", "--host-cache-size", "64Ktokens")
    try:
        first, again, load, text, report = asyncio.run(drive(proc.address))
    finally:
        proc.stop()
    assert first[1] == again[1] == 40  # the whole shared prefix cached both times (device, then host)
    assert again[0] == first[0]
    hc = load.host_cache
    assert hc.num_pages == 16_000 and hc.max_tokens == 64_000 and hc.hit_tokens >= 8 and hc.num_loads >= 1
    assert hc.num_stores >= 1 and hc.store_bytes > 0 and hc.load_bytes > 0 and hc.copy_path == "direct"
    assert "nvfp4_decode_host_hit_tokens " in text and report.ok and report.num_in_use == 0


# -- the agentic benchmark's host tier axis -----------------------------------------------------------------
def test_the_agentic_sweep_launches_each_dtype_with_and_without_a_pool_sized_host_tier():
    from benchmarks.agentic.sweep import build_parser, deployments

    a = build_parser().parse_args(["--trace", "t.jsonl", "--concurrency", "1", "--kv-dtypes", "fp8_e4m3", "nvfp4",
                                   "--equal-pool-bytes", "9000", "--host-cache-sizes", "0", "pool"])
    plan = deployments(a, ["--num-prefill", "0"])
    assert [label for label, _ in plan] == ["fp8_e4m3.host-0", "fp8_e4m3.host-9000tokens",
                                            "nvfp4.host-0", "nvfp4.host-16000tokens"]
    assert plan[3][1] == ["--num-prefill", "0", "--kv-cache-dtype", "nvfp4", "--max-total-tokens", "16000",
                          "--host-cache-size", "16000tokens"]  # the GPU pool's bytes: 16/9 x FP8's tokens
    b = build_parser().parse_args(["--trace", "t.jsonl", "--concurrency", "1", "--host-cache-sizes", "pool"])
    with pytest.raises(ValueError, match="pool needs --equal-pool-bytes"):
        deployments(b, ["--num-prefill", "0"])
    c = build_parser().parse_args(["--trace", "t.jsonl", "--concurrency", "1", "--host-cache-sizes", "8 parsecs"])
    with pytest.raises(ValueError, match="give bytes"):
        deployments(c, [])


def test_the_agentic_report_tables_hit_rate_and_throughput_with_and_without_the_host_tier():
    from benchmarks.agentic import trace as tf
    from benchmarks.agentic.report import markdown

    def point(c: int, tok_s: float, hit: float, host_hits: int = 0) -> dict:
        return {"concurrency": c, "num_sessions": 2 * c, "completed": 4, "failed": 0, "turns_not_sent": 0,
                "output_tok_s": tok_s, "tok_s_per_user": 10.0, "ttft_ms": {"median": 5.0, "p99": 9.0},
                "cache_hit_rate": hit, "cache_hit_rate_later_turns": hit, "later_hit_ceiling": 0.99,
                "reprefill_tokens": 0 if host_hits else 70,
                "evicted_pages": 1, "evicted_tokens": 4, "retractions": 0, "integrity_ok": True,
                "host_hit_tokens": host_hits, "host_load_gbps": 45.0 if host_hits else None,
                "host_store_gbps": 50.0 if host_hits else None,
                "server": {"pool": {"peak_pages_used": 1, "pages_total": 8}}}

    dep = {"model": "m", "model_path": "", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "page_size": 4,
           "num_decode_workers": 1, "num_prefill_workers": 0, "pool_pages_total": 8}
    stats = tf.Trace((tf.SessionTrace("a", (tf.Turn("a", 0, "user", 2, new_tokens=3),)),)).stats()

    def run(dtype, host, pts):
        return {"kv_dtype": dtype, "gpu": "H200", "deployment": dep, "host_cache_size": host,
                "host_cache_tokens": 32 if host != "0" else 0, "points": pts}

    runs = [run("nvfp4", "0", [point(40, 460.0, 0.9)]), run("nvfp4", "32tokens", [point(40, 690.0, 0.98, 5000)]),
            run("fp8_e4m3", "0", [point(40, 200.0, 0.66)]),
            run("fp8_e4m3", "32tokens", [point(40, 400.0, 0.97, 9000)])]
    text = markdown([{"trace": {"path": "t.jsonl", "stats": stats}, "command": "c", "runs": runs}], ["r.json"], None)
    host = text[text.index("## Host tier"):]
    assert "| fp8_e4m3 | none | 40 | 66.0% | 99.0% | 70 | 200.0 | - | - | - |" in host
    assert "| fp8_e4m3 | 32tokens (32 tokens) | 40 | 97.0% | 99.0% | 0 | 400.0 | 2.00 | 9,000 | 45.0 / 50.0 |" in host
    assert "| nvfp4 | 32tokens (32 tokens) | 40 | 98.0% | 99.0% | 0 | 690.0 | 1.50 | 5,000 | 45.0 / 50.0 |" in host
    assert "With the tier at C=40: NVFP4 690.0 vs FP8 400.0 output tok/s (1.73x)." in host
    assert "## nvfp4 + host 32tokens" in text and "## fp8_e4m3\n" in text  # the no-tier series keep their names
