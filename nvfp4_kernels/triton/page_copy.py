"""One layer's KV pages from one pool to another in one launch, checking the prompt's slots for NaN/inf.

``page_copy_kernel``  grid (num_pages, num_parts): program (i, part) moves page ``SRC_IDS[i]`` of one part to
                      page ``DST_IDS[i]`` (``COPY``; without it the source pages are only checked), as int32
                      words (16-byte accesses: every page is a multiple of 4 words, the wrapper asserts it), and
                      stores 1 to ``FLAG`` when a checked value among the page's first
                      ``clamp(num_tokens - i * PAGE_SIZE, 0, PAGE_SIZE)`` token slots is NaN/inf.

    part 0 = k, 1 = v     VAL_WORDS words per page, checked as VAL_CHECK (0: E2M1 codes, never NaN;
                          1: E4M3 bytes, fp8 pools; 2: bf16 values)
    part 2 = k_sf, 3 = v_sf   SF_WORDS words per page (nvfp4 only; 0 = absent), always E4M3

``staged_copy_kernel``  ``page_copy_kernel`` with every source part in one staged buffer (a received message,
                      copied to the device whole, the destination ids before it).

``page_table_kernel``  grid (num_pages, num_segments): program (i, s) does what ``page_copy_kernel`` does for
                      one part, for segment s of a table: row ``TABLE[s]`` = (source base address, destination
                      base address) of one part tensor of one layer, WORDS words per page, checked as CHECK
                      (``COPY``; without it the source pages are only checked). A launch takes parts of one
                      size and kind (the values of every layer, or the scales of every layer), so the pages of
                      every layer of a batch move in one launch per kind.

A page part is ``[S, Hk, X]`` slot-major, so a page's first ``t`` token slots are its first ``t * bytes/slot``
bytes. The references are ``nvfp4_kernels.page_copy.copy_pages_reference`` and ``move_pages_reference``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _nan_lanes(w, CHECK: tl.constexpr):
    """uint32 words -> the top bit of each lane that is NaN/inf. E4M3 (fn) bytes: NaN is x.1111.111 (no inf);
    bf16 halves: exponent all ones. Masking leaves each lane at most one below its top bit, so adding 1 per
    lane carries into the top bit exactly when the masked lane is all ones, never into the next lane."""
    if CHECK == 1:
        return ((w & 0x7F7F7F7F) + 0x01010101) & 0x80808080
    else:
        return ((w & 0x7F807F80) + 0x00800080) & 0x80008000


@triton.jit
def _page_part(SRC, DST, src_page, dst_page, checked_bytes, FLAG, WORDS: tl.constexpr, BLOCK: tl.constexpr,
               CHECK: tl.constexpr, COPY: tl.constexpr):
    """One page of one part: WORDS int32 words from SRC page ``src_page`` to DST page ``dst_page`` (the part's
    tensors, of any element type, read as words); the first ``checked_bytes`` bytes checked as CHECK (0: not)."""
    src = SRC.to(tl.pointer_type(tl.int32), bitcast=True) + src_page * WORDS
    dst = DST.to(tl.pointer_type(tl.int32), bitcast=True) + dst_page * WORDS
    hits = tl.zeros([BLOCK], dtype=tl.uint32)
    for start in tl.range(0, WORDS, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < WORDS
        w = tl.load(src + offs, mask=inside, other=0)
        if COPY:
            tl.store(dst + offs, w, mask=inside)
        if CHECK != 0:
            n = tl.minimum(tl.maximum(checked_bytes - offs * 4, 0), 4).to(tl.int64)  # bytes of this word checked
            keep = ((tl.full([BLOCK], 1, tl.int64) << (8 * n)) - 1).to(tl.uint32)  # little-endian: low bytes
            hits = hits | (_nan_lanes(w.to(tl.uint32, bitcast=True), CHECK) & keep)
    if CHECK != 0:
        bad = tl.max(hits, axis=0)
        tl.store(FLAG, 1, mask=bad != 0)  # the only value ever stored: an OR into the flag


@triton.jit
def _page_of_parts(K_SRC, K_DST, V_SRC, V_DST, KSF_SRC, KSF_DST, VSF_SRC, VSF_DST, src_page, dst_page, i, part,
                   FLAG, num_tokens, PAGE_SIZE: tl.constexpr, VAL_WORDS: tl.constexpr, VAL_BLOCK: tl.constexpr,
                   VAL_CHECK: tl.constexpr, SF_WORDS: tl.constexpr, SF_BLOCK: tl.constexpr, COPY: tl.constexpr):
    """Part ``part`` (0 k, 1 v, 2 k_sf, 3 v_sf) of the ``i``-th page of a copy: source page ``src_page`` to
    destination page ``dst_page``, its prompt slots (of ``num_tokens`` from the copy's first page) checked."""
    slots = tl.minimum(tl.maximum(num_tokens - i * PAGE_SIZE, 0), PAGE_SIZE)  # prompt slots in this page
    if part < 2:
        if COPY or VAL_CHECK != 0:
            checked = slots * (VAL_WORDS * 4 // PAGE_SIZE)
            if part == 0:
                _page_part(K_SRC, K_DST, src_page, dst_page, checked, FLAG, VAL_WORDS, VAL_BLOCK, VAL_CHECK, COPY)
            else:
                _page_part(V_SRC, V_DST, src_page, dst_page, checked, FLAG, VAL_WORDS, VAL_BLOCK, VAL_CHECK, COPY)
    elif SF_WORDS > 0:
        checked = slots * (SF_WORDS * 4 // PAGE_SIZE)
        if part == 2:
            _page_part(KSF_SRC, KSF_DST, src_page, dst_page, checked, FLAG, SF_WORDS, SF_BLOCK, 1, COPY)
        else:
            _page_part(VSF_SRC, VSF_DST, src_page, dst_page, checked, FLAG, SF_WORDS, SF_BLOCK, 1, COPY)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile per pool shape, whatever the prompt length
def page_copy_kernel(K_SRC, K_DST, V_SRC, V_DST, KSF_SRC, KSF_DST, VSF_SRC, VSF_DST, SRC_IDS, DST_IDS, FLAG,
                     num_tokens, PAGE_SIZE: tl.constexpr, VAL_WORDS: tl.constexpr, VAL_BLOCK: tl.constexpr,
                     VAL_CHECK: tl.constexpr, SF_WORDS: tl.constexpr, SF_BLOCK: tl.constexpr,
                     COPY: tl.constexpr):
    i = tl.program_id(0)
    src_page = tl.load(SRC_IDS + i).to(tl.int64)
    dst_page = tl.load(DST_IDS + i).to(tl.int64)
    _page_of_parts(K_SRC, K_DST, V_SRC, V_DST, KSF_SRC, KSF_DST, VSF_SRC, VSF_DST, src_page, dst_page, i,
                   tl.program_id(1), FLAG, num_tokens, PAGE_SIZE, VAL_WORDS, VAL_BLOCK, VAL_CHECK, SF_WORDS,
                   SF_BLOCK, COPY)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile per pool shape (offsets: multiples of 16 bytes)
def staged_copy_kernel(STAGED, K_DST, V_DST, KSF_DST, VSF_DST, FLAG, num_tokens, k_at, v_at, ksf_at, vsf_at,
                       PAGE_SIZE: tl.constexpr, VAL_WORDS: tl.constexpr, VAL_BLOCK: tl.constexpr,
                       VAL_CHECK: tl.constexpr, SF_WORDS: tl.constexpr, SF_BLOCK: tl.constexpr):
    """``page_copy_kernel`` from one staged buffer (a received page run message copied to the device whole):
    the destination ids are int64 at its start, part p's pages are consecutive from byte offset ``*_at``."""
    i = tl.program_id(0)
    dst_page = tl.load(STAGED.to(tl.pointer_type(tl.int64), bitcast=True) + i)
    _page_of_parts(STAGED + k_at, K_DST, STAGED + v_at, V_DST, STAGED + ksf_at, KSF_DST, STAGED + vsf_at, VSF_DST,
                   i, dst_page, i, tl.program_id(1), FLAG, num_tokens, PAGE_SIZE, VAL_WORDS, VAL_BLOCK, VAL_CHECK,
                   SF_WORDS, SF_BLOCK, True)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile per part geometry, whatever the prompt or layers
def page_table_kernel(TABLE, SRC_IDS, DST_IDS, FLAG, num_tokens, PAGE_SIZE: tl.constexpr, WORDS: tl.constexpr,
                      BLOCK: tl.constexpr, CHECK: tl.constexpr, COPY: tl.constexpr):
    i = tl.program_id(0)
    s = tl.program_id(1)
    src = tl.load(TABLE + 2 * s).to(tl.pointer_type(tl.int32))  # the segments are separate allocations
    dst = tl.load(TABLE + 2 * s + 1).to(tl.pointer_type(tl.int32))
    src_page = tl.load(SRC_IDS + i).to(tl.int64)
    dst_page = tl.load(DST_IDS + i).to(tl.int64)
    slots = tl.minimum(tl.maximum(num_tokens - i * PAGE_SIZE, 0), PAGE_SIZE)
    _page_part(src, dst, src_page, dst_page, slots * (WORDS * 4 // PAGE_SIZE), FLAG, WORDS, BLOCK, CHECK, COPY)
