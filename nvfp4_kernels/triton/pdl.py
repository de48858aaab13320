"""The kernel side of programmatic dependent launch (host side and invariant: nvfp4_kernels/programmatic_launch.py).

``pdl_enter(PDL)``  first statement of a kernel launched with ``launch_pdl=PDL``: waits until the kernel before
                    it on the stream has completed with its writes visible, then lets the kernel after it be
                    scheduled. With PDL False it compiles to nothing (CPU interpreter, GPUs before SM90).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
