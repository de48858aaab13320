"""Rounding fp32 values to a storage dtype inside a kernel, the same on every target and in Triton's interpreter.

``round_to(x, DTYPE)``  fp32 x -> fp32 holding x rounded to DTYPE, to nearest even (bf16 by integer ops on the
                        bits: the interpreter's own fp32 -> bf16 cast truncates; fp16 by a cast; fp32: x).
A value so rounded converts to DTYPE exactly, so storing it with any cast gives the reference's bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000: keep 7 mantissa bits
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
