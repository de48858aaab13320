"""Pages of every layer and part of a pool gathered into (or scattered from) one page-major staging buffer, in
one launch: @triton.jit code only (wrapper: nvfp4_kernels/page_stage.py).

``page_stage_kernel``  grid (n, num_segments, cdiv(max segment words, BLOCK)): program (p, s, c) moves words
                       [c * BLOCK, (c + 1) * BLOCK) of segment s of page ``IDS[p]``:

    segment s = one part tensor of one layer (k, k_sf, v, v_sf), row TABLE[s] = (base address, words per page,
                offset in a staged page), its page q at base + q * words
    staged page p = row r of STAGE, STAGE[r * STAGE_PAGE_WORDS :][: STAGE_PAGE_WORDS] = every segment's page
                    IDS[p], at its offset; r = ROWS[p] (HAS_ROWS) or p

    GATHER: STAGE <- pool pages;   else: pool pages <- STAGE

Words are the wrapper's element (int32 where every segment's page is a multiple of 4 bytes, else uint8). The
base addresses are loaded from TABLE and cast to pointers: the segments are separate allocations. STAGE may be
pinned host memory the GPU maps (the host tier's pages): the loads or stores then cross the bus directly.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def page_stage_kernel(TABLE, IDS, ROWS, STAGE, STAGE_PAGE_WORDS, BLOCK: tl.constexpr, GATHER: tl.constexpr,
                      HAS_ROWS: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    c = tl.program_id(2)
    words = tl.load(TABLE + s * 3 + 1)
    if c * BLOCK < words:
        base = tl.load(TABLE + s * 3).to(tl.pointer_type(STAGE.dtype.element_ty))
        offset = tl.load(TABLE + s * 3 + 2)
        page = tl.load(IDS + p).to(tl.int64)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = offs < words
        pool_ptr = base + page * words + offs
        row = tl.load(ROWS + p).to(tl.int64) if HAS_ROWS else p
        stage_ptr = STAGE + row * STAGE_PAGE_WORDS + offset + offs
        if GATHER:
            tl.store(stage_ptr, tl.load(pool_ptr, mask=m), mask=m)
        else:
            tl.store(pool_ptr, tl.load(stage_ptr, mask=m), mask=m)
