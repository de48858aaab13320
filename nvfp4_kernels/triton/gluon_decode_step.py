"""One step of the Hopper NVFP4 decode in Gluon, and the program state around it, shared by its two kernels
(``nvfp4_decode_gluon``: pages through a cp.async ring; ``nvfp4_decode_tma``: through TMA). One program = (kv head
h, split s, sequence b), ONE warp; same contract and outputs as ``nvfp4_decode.nvfp4_decode_kernel`` (split-KV
partial outputs + base-2 LSE, merged by ``merge_kernel``).

Transposed products. The tensor cores multiply [M x 16] by [16 x N] with N >= 8, so the G query heads of a
group (4 for GQA 32/8) go on the N side, padded to GN >= 8, instead of padding them to 16 rows:

    S^T [BT, GN]  = sum_k  K_k [BT, DW] . Q_k^T [DW, GN]        K_k[t, j] = K[t, 4j+k]
    O_k^T [DW, GN] += V_k^T [DW, BT] . P^T [BT, GN]             O[g, 4j+k] = O_k^T[j, g]

A step of BT tokens from one ring slot (``attend``), codes [BT, D/4] int16 and block scales [BT, D/16] bytes in
shared memory:
  - ldmatrix loads the packed K words as the A operand (pairs along j) and the V words transposed (pairs along
    tokens), so the codes reach the MMA registers without any shuffle;
  - the scale bytes are read from shared memory in a layout whose broadcast to [BT, D/4] IS the operand layout
    (``convert_layout(..., assert_trivial=True)``: no data movement), converted to fp16 once per pair
    (``operand_scales``);
  - two inline-PTX halves per pair of words decode its 8 E2M1 codes (nibbles 0, 2 and 1, 3) and multiply them by
    their E4M3 scales in fp16x2 (exact: E2M1 * E4M3 fits fp16);
  - online softmax in base 2 over the token axis of S^T (warp reductions); P^T goes to the B operand layout (the
    one layout change per step).
The TMA kernel also has a lean step (``attend``'s LEAN, the default on an H200: ``decode_choice.LEAN_STEP_GPUS``):
each scale byte converted once into a small shared buffer of the fp16 pairs the operands take (``k_scales``,
``v_scales``), the softmax sum kept per lane and reduced once after the last step (``lane_sums``, ``total_sums``),
the mask on the tail step only.
One warp owns its program's whole state, so no barrier is shared between warps. At D 128, G <= 8 a program holds
130-131 registers: 12 programs per SM (the 4-warp Triton kernel holds 226:
2 warps per scheduler). Larger groups or D 256 need 180-245 registers (``gluon_fits`` in
nvfp4_kernels/backends/decode_choice.py).

Scales folded in, as in the Triton kernel: qk_scale = sm_scale * k_global * 2**14 * log2(e) and
out_scale = v_global * 2**14 (the decoded values are E2M1 * 2**-14 * E4M3). Q enters as fp16 (|q| < 65504).
Needs sm_89+ for ``cvt.rn.f16x2.e4m3x2`` (built and run for sm_90a); D in {64, 128, 256}; BT in {16, 32, 64}.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from nvfp4_kernels.triton.e2m1 import SM90_HI_BYTES, SM90_LO_BYTES

# $2: two int16 words (8 codes) e0 | e1 << 16; $3: their two block scales as fp16x2 (s0, s1).
# _LO_ASM: outputs for nibbles 0 and 2, _HI_ASM: nibbles 1 and 3, each an fp16x2
# (E2M1[nibble k of e0] * s0, E2M1[nibble k of e1] * s1) * 2**-14 (the decode of nvfp4_kernels/triton/e2m1.py, split
# in two halves that share no work, so a step's decoded operands are live two nibbles at a time).
_SCALED = "mul.rn.f16x2 $0, $0, $3;\nmul.rn.f16x2 $1, $1, $3;\n}\n"  # both outputs times the scales $3
_LO_ASM = gl.constexpr("\n{\n.reg .b32 t, lo, w4;\n" + SM90_LO_BYTES.format(w="$2")
                       + "prmt.b32 $0, lo, 0, 0x2404;\nand.b32 $1, lo, 0xFF00FF00;\n" + _SCALED)
_HI_ASM = gl.constexpr("\n{\n.reg .b32 t, hi;\n" + SM90_HI_BYTES.format(w="$2")
                       + "prmt.b32 $0, hi, 0, 0x2404;\nand.b32 $1, hi, 0xFF00FF00;\n" + _SCALED)


@gluon.jit
def decode_half(w, s, ASM: gl.constexpr):
    """int16 words w and fp16 scales s of one layout -> two fp16 tensors (nibbles 0, 2 or 1, 3) * s * 2**-14."""
    return gl.inline_asm_elementwise(ASM, "=r,=r,r,r", [w, s], dtype=(gl.float16, gl.float16), is_pure=True,
                                     pack=2)


@gluon.jit
def operand_scales(smem, layout: gl.constexpr, operand: gl.constexpr, BT: gl.constexpr, NS: gl.constexpr,
            TRANS: gl.constexpr):
    """Scale bytes [BT, NS] of one ring slot -> uint8 [BT, 4*NS] (or its transpose) in ``operand`` layout:
    element (t, j) = scale(t, j // 4). ``layout`` is chosen so the broadcast is already that layout."""
    x = gl.expand_dims(smem.load(gl.SliceLayout(2, layout)), 2)
    x = gl.broadcast(x, gl.full([BT, NS, 4], 0, gl.uint8, layout=layout))[0]
    x = gl.reshape(x, [BT, NS * 4])
    if TRANS:
        x = gl.permute(x, (1, 0))
    x = gl.convert_layout(x, operand, assert_trivial=True)
    return x.to(gl.float8e4nv, bitcast=True).to(gl.float16)  # exact


@gluon.jit
def k_scales(ks_slot, scratch, op_a: gl.constexpr, BT: gl.constexpr, NS: gl.constexpr):
    """K's block scales [BT, NS] bytes of one ring slot -> fp16 [BT, 4*NS] in ``op_a`` layout (element (t, j) =
    scale(t, j // 4)), through ``scratch`` (fp16 [BT, 2, NS // 2, 2], this program's): each lane converts one
    row (one 64-bit load, e4m3x2 -> f16x2 conversions) and stores it as (s, s) pairs, blocks of one parity
    together; then each lane loads the pairs its operand registers need, 16 bytes per row. The same values as
    the operand's broadcast of each byte, in about half the instructions (one load and conversion per scale, not
    per operand register)."""
    rl: gl.constexpr = gl.BlockedLayout([1, NS], [32, 1], [1, 1], [1, 0])  # a row per lane
    x = ks_slot.load(rl).to(gl.float8e4nv, bitcast=True).to(gl.float16)  # [BT, NS]
    x = gl.permute(gl.reshape(x, [BT, NS // 2, 2]), (0, 2, 1))  # [t, b % 2, b // 2]
    scratch.store(gl.join(x, x))  # [t, b % 2, b // 2, 2]: (s, s) pairs
    gl.thread_barrier()
    # lane bits: 0 -> j bit 1 (both lanes of a pair read the same scales), 1 -> b % 2, 2-4 -> t bits 0-2;
    # registers: the pair, then b // 2, then t bits 3-4 (the operand's order: the convert below is no data move)
    l5: gl.constexpr = gl.BlockedLayout([1, 1, NS // 2, 1, 2], [8, 2, 1, 2, 1], [1, 1, 1, 1, 1], [4, 2, 3, 1, 0])
    y = gl.expand_dims(scratch.load(gl.SliceLayout(3, l5)), 3)
    y = gl.broadcast(y, gl.full([BT, 2, NS // 2, 2, 2], 0, gl.float16, layout=l5))[0]
    y = gl.reshape(gl.permute(y, (0, 2, 1, 3, 4)), [BT, 4 * NS])  # j = 8 (b // 2) + 4 (b % 2) + 2 jj1 + jj0
    return gl.convert_layout(y, op_a, assert_trivial=True)


@gluon.jit
def v_scales(vs_slot, scratch, op_a: gl.constexpr, BT: gl.constexpr, NS: gl.constexpr):
    """V's block scales [BT, NS] bytes of one ring slot -> fp16 [4*NS, BT] in ``op_a`` layout (V^T's: element
    (j, t) = scale(t, j // 4)), through ``scratch`` (fp16 [BT // 2, 2, NS // 2, 2], this program's): each lane
    converts two rows' halves and stores (scale(t, b), scale(t + 1, b)) pairs, a token pair's blocks of one
    parity together; then each lane loads the pairs its operand registers need: one load and conversion per
    scale instead of per operand register."""
    rl: gl.constexpr = gl.BlockedLayout([2, NS // 2], [16, 2], [1, 1], [1, 0])  # two rows' halves per lane
    x = vs_slot.load(rl).to(gl.float8e4nv, bitcast=True).to(gl.float16)  # [BT, NS]
    x = gl.permute(gl.reshape(x, [BT // 2, 2, NS // 2, 2]), (0, 3, 2, 1))  # [t // 2, b % 2, b // 2, t % 2]
    scratch.store(x)
    gl.thread_barrier()
    # lane bits: 0-1 -> t bits 1-2, 2-3 -> j bits 0-1 (lanes that read the same scales), 4 -> b % 2; registers:
    # t % 2 (the pair), t bits 3-4, then b // 2 (the operand's order: the convert below is no data move)
    l5: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2, 1], [4, 2, 1, 1, 4], [1, 1, 1, 1, 1], [3, 0, 4, 1, 2])
    y = gl.expand_dims(scratch.load(gl.SliceLayout(4, l5)), 4)
    y = gl.broadcast(y, gl.full([BT // 2, 2, NS // 2, 2, 4], 0, gl.float16, layout=l5))[0]
    y = gl.reshape(gl.permute(y, (0, 3, 2, 1, 4)), [BT, 4 * NS])  # t = 2 (t // 2) + t % 2, j = 4 b + jj
    return gl.convert_layout(gl.permute(y, (1, 0)), op_a, assert_trivial=True)


@gluon.jit
def store_out(O_PART, LSE_PART, b, split, h, acc0, acc1, acc2, acc3, lse, stride_pb, stride_ph, stride_ps,
               stride_lb, stride_lh, G: gl.constexpr, GN: gl.constexpr, DW: gl.constexpr, mma: gl.constexpr):
    jo = gl.arange(0, DW, layout=gl.SliceLayout(1, mma))
    go = gl.arange(0, GN, layout=gl.SliceLayout(0, mma))
    hq = h * G + go
    base = O_PART + b * stride_pb + hq[None, :] * stride_ph + split * stride_ps + 4 * jo[:, None]
    mask = (go < G)[None, :] & (jo >= 0)[:, None]
    gl.store(base + 0, acc0, mask=mask)
    gl.store(base + 1, acc1, mask=mask)
    gl.store(base + 2, acc2, mask=mask)
    gl.store(base + 3, acc3, mask=mask)
    gl.store(LSE_PART + b * stride_lb + hq * stride_lh + split, lse, mask=go < G)


# the accumulators' layout: one warp, MMA v2 (m16n8k16)
# ``k_scales`` / ``v_scales``' buffers of converted scales: unswizzled (each lane writes and reads 16-byte runs)
SCALE_BUFFER = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
ACC_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))


@gluon.jit
def split_range(SEQ_LENS, chunk_tokens):
    """This program's (kv head, split, sequence) and the split's token range [start, end) (empty past the end)."""
    h = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    start = split * chunk_tokens
    end = gl.minimum(gl.load(SEQ_LENS + b), start + chunk_tokens)
    return h, split, b, start, end


@gluon.jit
def fresh_state(GN: gl.constexpr, DW: gl.constexpr, BT: gl.constexpr, LEAN: gl.constexpr):
    """Online-softmax state before the first step: (m_i, l_i, acc0..acc3). With LEAN (``attend``'s lean step) l_i
    holds the sums per lane row group, [8, GN] (``lane_sums``), reduced across lanes once by ``total_sums``."""
    acc = gl.zeros([DW, GN], gl.float32, layout=ACC_LAYOUT)
    m_i = gl.full([GN], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ACC_LAYOUT))
    if LEAN:
        return m_i, lane_sums(gl.zeros([BT, GN], gl.float32, layout=ACC_LAYOUT), BT, GN), acc, acc, acc, acc
    else:
        return m_i, gl.zeros([GN], gl.float32, layout=gl.SliceLayout(0, ACC_LAYOUT)), acc, acc, acc, acc


@gluon.jit
def lane_sums(p, BT: gl.constexpr, GN: gl.constexpr):
    """[BT, GN] in the accumulator layout -> [8, GN]: the sums over the token rows each lane holds (tokens t and
    t + 8k share a lane), no data leaving a lane."""
    return gl.sum(gl.reshape(p, [BT // 8, 8, GN]), 0)


@gluon.jit
def total_sums(l_i, LEAN: gl.constexpr):
    """The softmax sums [GN] (accumulator slice layout) of ``fresh_state``'s l_i after the last step."""
    if LEAN:
        return gl.convert_layout(gl.sum(l_i, 0), gl.SliceLayout(0, ACC_LAYOUT))
    else:
        return l_i


@gluon.jit
def load_q(Q, b, h, stride_qb, stride_qh, G: gl.constexpr, GN: gl.constexpr, DW: gl.constexpr):
    """Q_k^T [DW, GN] as B operands (k = 0..3): element (j, g) = q[b, h*G + g, 4j + k], zero for g >= G."""
    op_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ACC_LAYOUT, k_width=2)
    jq = gl.arange(0, DW, layout=gl.SliceLayout(1, op_b))
    gq = gl.arange(0, GN, layout=gl.SliceLayout(0, op_b))
    qp = Q + b * stride_qb + (h * G + gq)[None, :] * stride_qh + 4 * jq[:, None]
    qm = (gq < G)[None, :] & (jq >= 0)[:, None]
    q0 = gl.load(qp + 0, mask=qm, other=0.0).to(gl.float16)
    q1 = gl.load(qp + 1, mask=qm, other=0.0).to(gl.float16)
    q2 = gl.load(qp + 2, mask=qm, other=0.0).to(gl.float16)
    q3 = gl.load(qp + 3, mask=qm, other=0.0).to(gl.float16)
    return q0, q1, q2, q3


@gluon.jit
def store_empty(O_PART, LSE_PART, b, split, h, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                 G: gl.constexpr, GN: gl.constexpr, DW: gl.constexpr):
    """A split with no token: a zero row and lse -inf (the merge weighs it 0)."""
    mma: gl.constexpr = ACC_LAYOUT
    z = gl.zeros([DW, GN], gl.float32, layout=mma)
    store_out(O_PART, LSE_PART, b, split, h, z, z, z, z,
               gl.full([GN], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma)),
               stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, G, GN, DW, mma)


@gluon.jit
def attend(k_slot, ks_slot, v_slot, vs_slot, q0, q1, q2, q3, t0, end, qk_scale, m_i, l_i, acc0, acc1, acc2, acc3,
           BT: gl.constexpr, GN: gl.constexpr, NS: gl.constexpr, LEAN: gl.constexpr, bufs):
    """One step of BT tokens from one ring slot (shared memory: codes [BT, D/4] int16, scales [BT, D/16] uint8):
    S^T = K Q^T, the online softmax over tokens (those at or past ``end`` masked), O^T += V^T P^T. Returns the
    new (m_i, l_i, acc0..acc3). V is read only after the softmax, so K's and V's operands are never live at once.

    LEAN: the shorter step (about 14% fewer instructions, 128 registers; 5-10% faster on an H200, 13-15% slower on
    H100s: docs/benchmarks/kernel-notes.md): each scale byte converted once through ``bufs`` (``scale_buffers``;
    every lane is past the previous step's reads of them, by the caller's barrier at the top of a step, before
    they are rewritten), the mask on the tail step only, the softmax sum kept per lane (``lane_sums``)."""
    mma: gl.constexpr = ACC_LAYOUT
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    op_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # scale layouts whose [BT, NS, 4] broadcast, reshaped to [BT, DW], equals op_a's layout of K [BT, DW] (j bit 0
    # in a register, j bits 1-2 on lanes 0-1, t bits 0-2 on lanes 2-4) or, transposed, of V^T [DW, BT]
    k_sl: gl.constexpr = gl.BlockedLayout([1, 1, 2], [8, 2, 2], [1, 1, 1], [2, 1, 0])
    v_sl: gl.constexpr = gl.BlockedLayout([2, 1, 1], [4, 2, 4], [1, 1, 1], [0, 2, 1])
    ts = gl.arange(0, BT, layout=gl.SliceLayout(1, mma))
    if LEAN:
        ks = k_scales(ks_slot, bufs[0], op_a, BT, NS)
    else:
        ks = operand_scales(ks_slot, k_sl, op_a, BT, NS, False)
    kw = k_slot.load(op_a)
    k0, k2 = decode_half(kw, ks, _LO_ASM)
    s = mma_v2(k0, q0, gl.zeros([BT, GN], gl.float32, layout=mma))
    s = mma_v2(k2, q2, s)
    k1, k3 = decode_half(kw, ks, _HI_ASM)
    s = mma_v2(k1, q1, s)
    s = mma_v2(k3, q3, s)
    if LEAN:
        s = s * qk_scale
        if t0 + BT > end:  # the tail step only: tokens at or past `end` masked
            s = gl.where(((t0 + ts) < end)[:, None], s, float("-inf"))
    else:
        s = gl.where(((t0 + ts) < end)[:, None], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 0))  # finite: every step has >= 1 token below `end`
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    if LEAN:
        l_i = l_i * gl.convert_layout(alpha, gl.SliceLayout(0, l_i.type.layout))[None, :] + lane_sums(p, BT, GN)
    else:
        l_i = l_i * alpha + gl.sum(p, 0)
    pb = gl.convert_layout(p.to(gl.float16), op_b)
    if LEAN:
        vs = v_scales(vs_slot, bufs[1], op_a, BT, NS)
    else:
        vs = operand_scales(vs_slot, v_sl, op_a, BT, NS, True)
    vw = v_slot.permute((1, 0)).load(op_a)
    a2 = alpha[None, :]
    v0, v2 = decode_half(vw, vs, _LO_ASM)
    acc0 = mma_v2(v0, pb, acc0 * a2)
    acc2 = mma_v2(v2, pb, acc2 * a2)
    v1, v3 = decode_half(vw, vs, _HI_ASM)
    acc1 = mma_v2(v1, pb, acc1 * a2)
    acc3 = mma_v2(v3, pb, acc3 * a2)
    return m_new, l_i, acc0, acc1, acc2, acc3


@gluon.jit
def scale_buffers(BT: gl.constexpr, NS: gl.constexpr):
    """A program's two shared buffers of converted scales: ``k_scales``'s [BT, 2, NS // 2, 2] and ``v_scales``'s
    [BT // 2, 2, NS // 2, 2] fp16 (1.5 KB at BT 32, D 128)."""
    return (gl.allocate_shared_memory(gl.float16, [BT, 2, NS // 2, 2], SCALE_BUFFER),
            gl.allocate_shared_memory(gl.float16, [BT // 2, 2, NS // 2, 2], SCALE_BUFFER))
