"""E2M1 nibble decode helpers shared by the NVFP4 Triton kernels (device functions only).

An int16 element holds 4 E2M1 codes (2 packed bytes, even element in the LOW nibble):

    bits  15..12   11..8    7..4    3..0
          nib 3    nib 2    nib 1   nib 0        value index 4j+3, 4j+2, 4j+1, 4j

``e2m1x4(w, MODE)`` returns four fp16 tensors, output k = E2M1[nibble k] * UNIT, exactly, with UNIT = 2**-14
for modes 0 and 1 and UNIT = 1 for mode 2. The fp16 with bits ``(c & 8) << 12 | (c & 7) << 9`` equals
E2M1[c] * 2**-14 (0.5 lands on an fp16 subnormal); callers fold 1/UNIT into sm_scale (K) and into the
output scale (V) (``nvfp4_kernels.backends.triton_decode.e2m1_fold``).

Three implementations of the same elementwise function, picked by the constexpr ``MODE``:
  0  plain Triton integer ops (any target, also the CPU interpreter)
  1  Hopper (sm_90a): inline PTX on packed 32-bit words; two int16 elements = one register
  2  Blackwell (sm_100a/sm_120a): the hardware ``cvt.rn.f16x2.e2m1x2`` conversion
"""

from __future__ import annotations

import triton
import triton.language as tl

# MODE 1. $4 holds two int16 elements e0 (low half) and e1 (high half) = bytes B0 B1 | B2 B3.
# Output k is the fp16x2 (nibble k of e0, nibble k of e1). Through E5M2-shaped bytes:
#   hi = (w & 0x80808080) | ((w >> 3) & 0x0E0E0E0E)     high nibble of every byte, as fp16 high bytes
#   lo = same on w << 4                                 low nibble of every byte
#   out0 = lo bytes 0,2 ; out1 = hi bytes 0,2 ; out2 = lo bytes 1,3 ; out3 = hi bytes 1,3 (-> fp16 high bytes)
# The two halves of that decode as PTX fragments on the word {w}, shared with the Gluon decode
# (nvfp4_kernels/triton/gluon_decode_step.py): E5M2-shaped bytes of every byte's high nibble into ``hi`` (uses t)
# and of every byte's low nibble into ``lo`` (uses t, w4).
SM90_HI_BYTES = "shr.b32 t, {w}, 3;\nand.b32 t, t, 0x0E0E0E0E;\nand.b32 hi, {w}, 0x80808080;\nor.b32 hi, hi, t;\n"
SM90_LO_BYTES = ("shl.b32 w4, {w}, 4;\nshl.b32 t, {w}, 1;\nand.b32 t, t, 0x0E0E0E0E;\nand.b32 lo, w4, 0x80808080;\n"
                 "or.b32 lo, lo, t;\n")
_SM90_ASM = tl.constexpr("\n{\n.reg .b32 t, hi, lo, w4;\n" + SM90_HI_BYTES.format(w="$4") + SM90_LO_BYTES.format(w="$4")
                         + "prmt.b32 $0, lo, 0, 0x2404;\nprmt.b32 $1, hi, 0, 0x2404;\nand.b32 $2, lo, 0xFF00FF00;\n"
                         "and.b32 $3, hi, 0xFF00FF00;\n}\n")

# MODE 2. Same lanes via cvt.rn.f16x2.e2m1x2 (low nibble -> low half), values unscaled. Build the byte
# (nibble k of e0) | (nibble k of e1) << 4 for each k, then convert it.
_SM100_ASM = tl.constexpr("""
{
.reg .b32 t0, t1, t2, t3, s;
.reg .b8 b0, b1, b2, b3;
.reg .b16 h0, h1, h2, h3;
shr.b32 s, $4, 12;
and.b32 t0, $4, 0x0000000F;
and.b32 s, s, 0x000000F0;
or.b32 t0, t0, s;
shr.b32 t1, $4, 4;
shr.b32 s, $4, 16;
and.b32 t1, t1, 0x0000000F;
and.b32 s, s, 0x000000F0;
or.b32 t1, t1, s;
shr.b32 t2, $4, 8;
shr.b32 s, $4, 20;
and.b32 t2, t2, 0x0000000F;
and.b32 s, s, 0x000000F0;
or.b32 t2, t2, s;
shr.b32 t3, $4, 12;
shr.b32 s, $4, 24;
and.b32 t3, t3, 0x0000000F;
and.b32 s, s, 0x000000F0;
or.b32 t3, t3, s;
cvt.u8.u32 b0, t0;
cvt.u8.u32 b1, t1;
cvt.u8.u32 b2, t2;
cvt.u8.u32 b3, t3;
cvt.rn.f16x2.e2m1x2 $0, b0;
cvt.rn.f16x2.e2m1x2 $1, b1;
cvt.rn.f16x2.e2m1x2 $2, b2;
cvt.rn.f16x2.e2m1x2 $3, b3;
}
""")


@triton.jit
def _nibble_to_f16(w, SHIFT: tl.constexpr):
    c = (w >> SHIFT) & 0xF
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def e2m1x4(w, MODE: tl.constexpr):
    """int16 tensor of 4 codes -> (v0, v1, v2, v3) fp16, v_k = E2M1[nibble k] * UNIT (see module doc)."""
    if MODE == 1:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            _SM90_ASM, "=r,=r,=r,=r,r", [w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    elif MODE == 2:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            _SM100_ASM, "=r,=r,=r,=r,r", [w],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        wi = w.to(tl.int32) & 0xFFFF
        v0 = _nibble_to_f16(wi, 0)
        v1 = _nibble_to_f16(wi, 4)
        v2 = _nibble_to_f16(wi, 8)
        v3 = _nibble_to_f16(wi, 12)
    return v0, v1, v2, v3
