"""The fixed-buffer decode (CUDA graphs on GPU): buckets, padding rows on the scratch page, same tokens as eager.

On CPU the fixed-buffer path runs eagerly (capture=False): the same padding, buckets and staging that the
captured graphs replay. On CUDA (marked gpu) the engine captures graphs and is checked against the eager path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.decode_graphs import DecodeGraphRunner, batch_buckets, width_bucket, width_buckets
from engine.engine import Engine
from engine.model_runner import PageTableRows
from engine.request import Request
from engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _engine(model_dir: str, kv_dtype: str, device: str = "cpu", overlap: bool = True, page_size: int = 4,
            **kw) -> Engine:
    return Engine(EngineConfig(
        model_dir=model_dir, device=device, dtype="float32" if device == "cpu" else "bfloat16",
        cache=CacheConfig(kv_dtype=kv_dtype, page_size=page_size, max_total_tokens=4096),
        scheduler=SchedulerConfig(chunk_size=64, disable_overlap_schedule=not overlap), **kw))


def _prompts(n: int, seed: int, max_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(torch.randint(5, max_len, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        batch_buckets(0)
    # 4 widths per octave, never below the request, capped at the maximum
    assert [width_bucket(p, 1 << 20) for p in (1, 16, 17, 20, 21, 33, 2049, 2112)] == \
        [16, 16, 20, 20, 24, 40, 2560, 2560]
    for p in range(1, 5000, 7):
        w = width_bucket(p, 1 << 20)
        assert p <= w <= max(16, p * 1.25)
    assert width_bucket(900, 512) == 512
    # width_buckets lists exactly the widths a table can be padded to (what start-up compiles for)
    for top in (1, 16, 17, 513, 5000):
        assert width_buckets(top) == sorted({width_bucket(p, top) for p in range(1, top + 1)})


def test_start_up_warm_covers_every_entry_shape_and_compiles_nothing_on_cpu(tiny_model_dir):
    eng = _engine(tiny_model_dir, "nvfp4")
    runner = DecodeGraphRunner(eng.model, eng.paths, eng.device, 24, 130, capture=False)
    assert runner.shapes() == [(b, w) for b in (1, 2, 4, 8, 16, 24) for w in width_buckets(130)]
    assert runner.warm_kernels() == 0  # the reference backend compiles nothing per shape


def test_page_table_rows_follow_appends_and_replaced_lists():
    rows = PageTableRows()
    r = Request("a", [1, 2, 3], GREEDY, page_ids=[5, 6])
    assert rows.rows([r])[0].tolist() == [5, 6]
    r.page_ids.extend(range(7, 60))  # grows past the first capacity
    assert rows.rows([r])[0].tolist() == [5, 6, *range(7, 60)]
    r.page_ids = [9]  # retraction + readmission: a new list object
    assert rows.rows([r])[0].tolist() == [9]
    other = Request("b", [1], GREEDY, page_ids=[1, 2])
    assert [x.tolist() for x in rows.rows([other, r])] == [[1, 2], [9]]
    assert set(rows._rows) == {"a", "b"}
    rows.rows([other])
    assert set(rows._rows) == {"b"}  # rows of requests gone from the batch are dropped


def test_append_only_staging_writes_the_table_a_refill_would_as_rows_grow_move_and_leave(tiny_model_dir):
    """``run(..., append_only=True)`` writes only new entries while steps stay on one entry; whatever the rows
    do (grow, change request, shrink after a retraction, leave for padding, switch entry) the host table must
    equal a refill: each row's pages, then the scratch page."""
    eng = _engine(tiny_model_dir, "nvfp4")
    runner = DecodeGraphRunner(eng.model, eng.paths, eng.device, max_batch=8, max_width=64, capture=False)
    scratch, rows = runner.scratch_page, PageTableRows()
    a, b, c = (Request(n, [1], GREEDY, page_ids=list(p)) for n, p in (("a", [1, 2, 3]), ("b", [4, 5, 6, 7, 8]),
                                                                       ("c", [9, 10])))
    d = Request("d", [1], GREEDY, page_ids=[11])

    def step(reqs):
        tables = rows.rows(reqs)
        bb, wb = 8, 32
        entry = runner._entries.get((bb, wb)) or runner._build(bb, wb)
        n = len(reqs)
        runner._stage(entry, [0] * n, [0] * n, tables, [1] * n, [0] * n, append_only=True)
        want = np.full((bb, wb), scratch, dtype=np.int32)
        for i, r in enumerate(reqs):
            want[i, :len(r.page_ids)] = r.page_ids
        assert np.array_equal(runner._host_table(bb, wb), want), [r.rid for r in reqs]

    step([a, b, c])
    a.page_ids.append(12)  # a grows in place
    step([a, b, c])
    step([a, c, d])  # b leaves: c moves up over b's longer row, d takes c's
    step([c, a, d])  # a moves onto c's shorter row: the row is rewritten, not just extended
    a.page_ids = [13, 14]  # a retracted and admitted again: a new, shorter list
    step([a, c, d])
    step([d])  # rows 1 and 2 back to padding
    for k in range(28):  # one page at a time to a row that was padding, past PageTableRows' first capacity (16)
        d.page_ids.append(15 + k % 40)
        step([d, c] if k % 3 else [d])
    runner._build(4, 32)  # another entry's capture-time staging in between: the next step refills
    step([c, d])


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "nvfp4"])
def test_fixed_buffer_decode_gives_the_eager_tokens(tiny_model_dir, kv_dtype):
    prompts = _prompts(7, seed=3, max_len=120)
    eager = _engine(tiny_model_dir, kv_dtype, overlap=False)  # and each step read before the next: the fixed
    want = [o.token_ids for o in eager.generate(prompts, GREEDY)]  # buffers' carried input ids are checked too

    eng = _engine(tiny_model_dir, kv_dtype)
    eng.pool.poison()  # scratch and unwritten pages read as NaN: a padded row touching a real page would show
    runner = DecodeGraphRunner(eng.model, eng.paths, eng.device, max_batch=5, max_width=64, capture=False)
    eng.runner.graphs = runner
    got = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    assert got == want
    # batches of 6-7 ran eagerly, smaller ones through padded buckets of several widths
    assert runner._entries
    assert len({w for _, w in runner._entries}) >= 2
    report = eng.check_integrity()  # raises on any ownership error
    assert report.num_in_use == 0
    assert eng.pool.scratch_page == eng.allocator.num_pages  # never handed out


def test_padded_rows_write_only_the_scratch_page(tiny_model_dir):
    eng = _engine(tiny_model_dir, "nvfp4")
    runner = DecodeGraphRunner(eng.model, eng.paths, eng.device, max_batch=8, max_width=16, capture=False)
    layer = eng.pool.layers[0]
    before = layer.k.clone()
    ps = eng.pool.page_size
    # one real row on page 3 (slot 3*ps), padded to the bucket of 2 rows
    runner.run([7], [0], [np.array([3], dtype=np.int32)], [1], [3 * ps])
    changed = (layer.k != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {3, eng.pool.scratch_page}
    assert 3 in changed


def test_cuda_graph_flags_are_validated(tiny_model_dir):
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        EngineConfig(model_dir=tiny_model_dir, cuda_graph_max_bs=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,page_size", [("nvfp4", 4), ("nvfp4", 16), ("fp8_e4m3", 4), ("bf16", 4)])
def test_cuda_graph_decode_matches_eager_on_gpu(tmp_path, kv_dtype, page_size):
    # nvfp4 on Hopper: 4-token pages decode with the cp.async Gluon kernel, 16-token pages with the TMA-fed one
    from offline.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "m", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2,
                                    head_dim=128, intermediate_size=512, seed=1))
    eng = _engine(model_dir, kv_dtype, device="cuda", overlap=False, page_size=page_size)  # no step left in flight
    assert eng.runner.graphs is not None
    reqs = [eng.new_request(p, GREEDY) for p in _prompts(11, seed=5)]
    for r in reqs:
        eng.scheduler.submit(r)
    while eng.scheduler.extending or eng.scheduler.waiting:
        eng.scheduler.step()
    batch = [r for r in eng.scheduler.running if not r.is_finished]
    assert len(batch) >= 8
    for r in batch:  # the scheduler adds a request's next page at its decode step; do it here
        if r.kv_len == len(r.page_ids) * eng.pool.page_size:
            r.page_ids.extend(eng.allocator.allocate(1))
    eager = eng.runner.decode_logits(batch, use_graphs=False).clone()
    graph = eng.runner.decode_logits(batch).clone()
    assert eng.runner.graphs.num_captured >= 1
    scale = eager.abs().max().item()
    assert (graph - eager).abs().max().item() <= 2e-2 * scale
    assert (graph.argmax(-1) == eager.argmax(-1)).float().mean().item() >= 0.9
    while eng.scheduler.has_work:  # finish them under graphs
        eng.scheduler.step()
    # a whole generation under graphs stays consistent and leak-free
    outs = eng.generate(_prompts(6, seed=9), GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert eng.check_integrity().num_in_use == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3", "bf16"])
def test_overlap_under_cuda_graphs_gives_the_tokens_of_steps_read_one_by_one(tmp_path, kv_dtype):
    """Under graphs a step's input ids are the last step's sampled ids read on the device, staged while that step
    may still run: greedy tokens must be those of steps read before the next is launched."""
    from offline.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "m", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2,
                                    head_dim=128, intermediate_size=512, seed=1))
    prompts = _prompts(12, seed=8, max_len=90)
    want = [o.token_ids for o in _engine(model_dir, kv_dtype, device="cuda", overlap=False).generate(prompts, GREEDY)]
    eng = _engine(model_dir, kv_dtype, device="cuda")
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == want
    assert eng.runner.graphs.num_captured >= 1 and eng.check_integrity().num_in_use == 0


def test_cuda_graph_flags_reach_the_engine_config_and_the_children():
    import argparse

    from svc_common.engine_args import add_engine_args, engine_args_to_argv, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = p.parse_args(["--model", "m", "--disable-cuda-graph", "--cuda-graph-max-bs", "48"])
    cfg = engine_config_from_args(a)
    assert cfg.disable_cuda_graph and cfg.cuda_graph_max_bs == 48
    argv = engine_args_to_argv(a)
    assert "--disable-cuda-graph" in argv and argv[argv.index("--cuda-graph-max-bs") + 1] == "48"
    again = engine_config_from_args(p.parse_args(argv))
    assert again.disable_cuda_graph and again.cuda_graph_max_bs == 48
    assert not engine_config_from_args(p.parse_args(["--model", "m"])).disable_cuda_graph
    # a prefill service never decodes: it builds no decode graphs whatever the flags
    from prefill_svc.config import build_arg_parser, config_from_args

    assert config_from_args(build_arg_parser().parse_args(["--model", "m"])).engine.disable_cuda_graph


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "nvfp4"])
def test_rows_sharing_prefix_pages_can_name_more_pages_than_the_pool_holds(tmp_path, kv_dtype):
    """A cached prefix shared by every row: the batch's page table names more entries than the pool has."""
    from benchmarks.engine.bench_decode_step import fill_pool_random
    from offline.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "m", num_layers=1, hidden_size=256, num_heads=8, num_kv_heads=2,
                                    head_dim=128, intermediate_size=512, seed=2))
    eng = Engine(EngineConfig(model_dir=model_dir, device="cuda", dtype="bfloat16",
                              cache=CacheConfig(kv_dtype=kv_dtype, page_size=4, max_total_tokens=160)))
    fill_pool_random(eng.pool)
    ps, shared = eng.pool.page_size, list(range(30))  # 30 of the pool's 40 pages, in every row
    rows = [np.array([*shared, 30 + i], dtype=np.int32) for i in range(8)]  # 8 x 31 = 248 entries > 40
    seq = 30 * ps + 1
    with torch.inference_mode():
        logits = eng.runner.graphs.run([5] * 8, [seq - 1] * 8, rows, [seq] * 8, [(30 + i) * ps for i in range(8)])
    assert logits.shape[0] == 8 and torch.isfinite(logits).all()
    # the rows see the same prefix and the same token: equal logits up to summation order
    assert (logits - logits[:1]).abs().max().item() <= 1e-2 * logits.abs().max().item()


@pytest.mark.gpu
def test_no_decode_step_compiles_a_kernel_after_start_up(tmp_path):
    """The engine compiles the NVFP4 decode for every captured shape at start-up: a growing batch of growing
    sequences then never waits for a Triton compile (each used to stall the whole batch about a second)."""
    from nvfp4_kernels.triton.nvfp4_decode import merge_kernel, nvfp4_decode_kernel
    from nvfp4_kernels.triton.nvfp4_decode_gluon import nvfp4_decode_gluon_kernel
    from nvfp4_kernels.triton.nvfp4_decode_tma import nvfp4_decode_tma_kernel
    from offline.tiny_model import make_tiny_model

    def compiled() -> int:  # the decode kernel the engine picked (a Gluon one on Hopper, else Triton) and the merge
        kernels = (nvfp4_decode_kernel, nvfp4_decode_gluon_kernel, nvfp4_decode_tma_kernel, merge_kernel)
        return sum(len(c[0]) for k in kernels
                   for c in k.device_caches.values())

    model_dir = str(make_tiny_model(tmp_path / "m", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2,
                                    head_dim=128, intermediate_size=512, seed=1))
    eng = _engine(model_dir, "nvfp4", device="cuda")
    before = compiled()
    assert before >= 2
    outs = eng.generate(_prompts(20, seed=3, max_len=180), GREEDY)  # batches 1..20, widths up to ~50 pages
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert eng.runner.graphs.num_captured >= 2
    assert compiled() == before


@pytest.mark.gpu
def test_captures_succeed_while_another_thread_copies_and_syncs_its_own_stream(tmp_path):
    """The decode service's transfer threads (and UCX, for NIXL) copy, allocate and sync their own streams while
    the engine thread captures a new batch shape: captures are thread-local, so neither side fails (a global
    capture made the other thread's sync an error and the capture invalid, then every later capture failed)."""
    import threading

    from offline.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "m", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2,
                                    head_dim=128, intermediate_size=512, seed=1))
    eng = _engine(model_dir, "nvfp4", device="cuda")
    stop, errors, rounds = threading.Event(), [], [0]

    def transfer_like() -> None:
        side = torch.cuda.Stream()
        try:
            while not stop.is_set():
                with torch.cuda.stream(side):
                    host = torch.empty(1 << 18, dtype=torch.uint8, pin_memory=True)
                    dev = host.to("cuda", non_blocking=True)
                    dev.clone().add_(1)
                side.synchronize()
                rounds[0] += 1
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    th = threading.Thread(target=transfer_like)
    th.start()
    try:
        outs = eng.generate(_prompts(20, seed=4, max_len=150), GREEDY)  # many batch/width shapes: many captures
    finally:
        stop.set()
        th.join()
    assert not errors, errors
    assert rounds[0] > 0
    assert eng.runner.graphs.capture_error == ""
    assert eng.runner.graphs.num_captured >= 2
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
