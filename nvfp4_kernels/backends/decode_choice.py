"""Which NVFP4 decode kernel and tiling a plan launches: ``DecodeConfig``, the GPU's default
(``default_decode_config``: the TMA-fed Gluon kernel on Hopper where the pool fits its boxes, else the cp.async
one, else the Triton kernel) and the config of an eager launch (``eager_config``). The launches themselves are
``triton_decode.TritonNvfp4Decode``'s."""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

from nvfp4_kernels.backends.decode_kernels import GLUON_HEAD_DIMS, DecodeKernel, tma_fits

# the grouped TMA decode (DecodeConfig.head_group): KV heads per CTA, the heads whose 8 bytes of block scales a token
# keeps in one 32-byte sector at head_dim 128; its register cap per thread of the CTA's 8 warps: the copy partition
# gives all but 24 up (setmaxnreg) and each head's warp takes 136, so 3 CTAs (12 heads) run on an SM
GROUPED_HEADS = 4
GROUPED_MAX_REGISTERS = 80


@dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the NVFP4 decode kernel: NW warp slices of BW tokens per loop step (Triton), or one warp
    stepping BW tokens through a ``num_stages``-deep ring filled by cp.async (Gluon) or TMA (Gluon TMA; BW whole
    pages): ``num_warps`` must be 1 for both Gluon kernels."""

    num_warps: int = 4
    block_w: int = 32
    num_stages: int = 2
    # split-KV: the grid fills whole waves of this many programs per SM (wave_programs: rounds of what fits)
    programs_per_sm: int = 8
    kernel: DecodeKernel = DecodeKernel.TRITON
    max_registers: int | None = None  # ptxas register cap per thread (maxnreg); None: the compiler's choice
    lean: bool = False  # the TMA kernel's shorter step (gluon_decode_step.attend, LEAN): faster on an H200 only
    # the TMA kernel with this many KV heads per CTA: 1, or 4 (nvfp4_decode_tma_grouped: the heads whose block
    # scales share a DRAM sector read them once; head_dim 128, KV heads a multiple of 4)
    head_group: int = 1

    def __post_init__(self) -> None:
        if self.block_w < 16 or self.block_w & (self.block_w - 1):
            raise ValueError(f"block_w must be a power of two >= 16 (tensor-core N dim), got {self.block_w}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {self.programs_per_sm}")
        if self.max_registers is not None and not 32 <= self.max_registers <= 255:
            raise ValueError(f"max_registers must be in [32, 255] or None, got {self.max_registers}")
        if self.lean and self.kernel is not DecodeKernel.GLUON_TMA:
            raise ValueError(f"the lean step is the TMA kernel's (DecodeKernel.GLUON_TMA), got {self.kernel.value}")
        if self.head_group not in (1, GROUPED_HEADS):
            raise ValueError(f"head_group must be 1 or {GROUPED_HEADS}, got {self.head_group}")
        if self.head_group != 1 and self.kernel is not DecodeKernel.GLUON_TMA:
            raise ValueError(f"head_group is the TMA kernel's (DecodeKernel.GLUON_TMA), got {self.kernel.value}")
        if self.kernel is not DecodeKernel.TRITON and (self.num_warps != 1 or self.block_w > 64 or self.num_stages < 2):
            raise ValueError("the Gluon decode runs one warp per program with block_w <= 64 and num_stages >= 2, got "
                             f"num_warps={self.num_warps} block_w={self.block_w} num_stages={self.num_stages}")

    @property
    def label(self) -> str:
        cap = "" if self.max_registers is None else f"_r{self.max_registers}"
        return (f"{self.kernel.value}_nw{self.num_warps}_bw{self.block_w}_st{self.num_stages}"
                f"_p{self.programs_per_sm}{cap}{'_lean' if self.lean else ''}"
                f"{f'_hg{self.head_group}' if self.head_group != 1 else ''}")

    @property
    def launch_options(self) -> dict:
        """Extra launch arguments: the register cap (the grouped TMA kernel's: GROUPED_MAX_REGISTERS)."""
        if self.head_group != 1:
            return {"maxnreg": self.max_registers or GROUPED_MAX_REGISTERS}
        return {} if self.max_registers is None else {"maxnreg": self.max_registers}

    @property
    def block_n(self) -> int:
        return self.num_warps * self.block_w


def gluon_fits(head_dim: int, group: int) -> bool:
    """Whether the Gluon kernel is the default for this head dim and group: its accumulators are GN x D fp32 per
    warp (GN = the group padded to >= 8). At GN * D <= 1024 (G <= 8 at D 128, G <= 16 at D 64) a program holds
    about 130 registers, as in the measured GQA 32/8, D 128 case; up to 2048 it compiles without spills but
    with 200-245 registers (fewer programs per SM, not measured), and G 32 at D 128 spills (sm_90a, Triton 3.6).
    An explicit DecodeConfig may still ask for it there."""
    return head_dim in GLUON_HEAD_DIMS and max(8, triton.next_power_of_2(group)) * head_dim <= 1024


# One-warp programs of each Gluon kernel (32-token steps, 2 stages) that run at once on one SM90 SM, by (kernel,
# lean step, head_dim, GN: the group padded to >= 8), for every tiling ``default_decode_config`` picks: registers
# are the limit (a scheduler's 16,384 hold 4 warps of 128 registers, 3 of 130 or 131), shared memory (5-12 KB a
# program) next; at D 128 every group up to 8 compiles to the same registers. tests/test_gluon_decode.py compiles
# each for sm_90a and checks them.
RESIDENT_PROGRAMS = {
    (DecodeKernel.GLUON_TMA, False, 128, 8): 12, (DecodeKernel.GLUON_TMA, True, 128, 8): 16,
    (DecodeKernel.GLUON, False, 128, 8): 12,
    # at D 64 some groups compile to 72 registers (28 programs) and others to 75-80 (24): the fewer, so that a
    # wave never runs past what fits
    (DecodeKernel.GLUON_TMA, False, 64, 8): 24, (DecodeKernel.GLUON_TMA, True, 64, 8): 24,
    (DecodeKernel.GLUON, False, 64, 8): 24,
    (DecodeKernel.GLUON_TMA, False, 64, 16): 16, (DecodeKernel.GLUON_TMA, True, 64, 16): 16,
    (DecodeKernel.GLUON, False, 64, 16): 16,
}
_RESIDENT_ELSEWHERE = 12  # a tiling forced past gluon_fits (not measured; its grid still fills whole waves of 12)


def resident_programs(kernel: DecodeKernel, lean: bool, head_dim: int, group: int) -> int:
    """The programs of ``kernel`` (its lean step or not) at ``head_dim`` and ``group`` query heads per KV head that
    run at once on one Hopper SM (``RESIDENT_PROGRAMS``)."""
    return RESIDENT_PROGRAMS.get((kernel, lean, head_dim, max(8, triton.next_power_of_2(group))), _RESIDENT_ELSEWHERE)


def wave_rounds(kernel: DecodeKernel, lean: bool) -> int:
    """Rounds of the programs that fit on an SM in one wave of ``kernel``'s split-KV grid, as measured fastest on
    an H100 (docs/benchmarks/kernel-notes.md). The TMA kernel's kept step: one round of its 12 (3-5% faster than
    two at 84 x 32K and 10 x 160K in two runs, never slower). Its lean step: two of its 16 (one ran up to 25%
    slower: programs that all start at once end unevenly across SMs and nothing takes the place of the early
    ones). The cp.async kernel: two of its 12 (one ran 5% slower at 1 x 1M)."""
    return 1 if kernel is DecodeKernel.GLUON_TMA and not lean else 2


def wave_programs(kernel: DecodeKernel, lean: bool, head_dim: int, group: int) -> int:
    """``programs_per_sm`` of a Gluon kernel's default config: the split-KV grid fills whole waves of
    ``wave_rounds`` rounds of the programs that fit on an SM (``triton_decode.split_geometry``)."""
    return wave_rounds(kernel, lean) * resident_programs(kernel, lean, head_dim, group)


# GPUs (by name) where the TMA kernel's lean step measured faster than its kept one: 5.5 / 9-10 / 5 / 2.5% at
# 44x32K / 10x160K / 1x1M / 128x4K on an H200, against 13-15% slower on two of three H100s
# (docs/benchmarks/kernel-notes.md). The H200's faster memory leaves the step's instruction issue the limit.
LEAN_STEP_GPUS = ("H200",)


def prefers_lean_step(device_name: str) -> bool:
    """Whether the TMA kernel runs its lean step on the GPU named ``device_name`` (``LEAN_STEP_GPUS``)."""
    return any(g in device_name for g in LEAN_STEP_GPUS)


def default_decode_config(head_dim: int, capability: tuple[int, int] | None = None, group: int = 1,
                          kernel: DecodeKernel | None = None, *, num_kv_heads: int, page_size: int,
                          lean_step: bool = False) -> DecodeConfig:
    """The decode kernel and tiling for a GPU of ``capability`` (None: no GPU, the Triton kernel for the
    interpreter), ``group`` query heads per KV head and a pool of ``num_kv_heads`` heads in ``page_size`` pages.

    Hopper (9.x) gets a Gluon kernel where ``gluon_fits``: the TMA-fed one where its geometry fits (``tma_fits``:
    16-token pages and an even number of KV heads at head_dim 128, as Qwen3 and Llama pools have), 1.04-1.10x
    faster than the cp.async one on the H200 and 1.16-1.19x on an H100 (docs/benchmarks/kernels.md,
    kernel-notes.md), else the cp.async one, itself
    1.3-1.4x faster than the Triton kernel on the H200 (docs/benchmarks/kernels.md). Both run one warp per
    program, 32-token steps, a 2-stage ring; the split-KV grid fills whole waves of one or two rounds of the
    programs that fit on an SM (``wave_programs``). Other GPUs get the Triton kernel, whose D=256
    tiling halves the warp slice to stay in registers (docs/benchmarks/kernel-notes.md). ``kernel``
    (``--nvfp4-decode-kernel``) forces one kernel with its default tiling; a Gluon kernel still needs what
    ``kernel_unfit`` checks (at start-up, svc_common/preflight.py; again at the launch). ``lean_step``: the TMA
    kernel runs its lean step (``prefers_lean_step`` of the GPU's name)."""
    hopper = kernel is None and capability is not None and capability[0] == 9 and gluon_fits(head_dim, group)
    if kernel is DecodeKernel.GLUON_TMA or (hopper and tma_fits(num_kv_heads, head_dim, page_size, 32)):
        return DecodeConfig(1, 32, 2, wave_programs(DecodeKernel.GLUON_TMA, lean_step, head_dim, group),
                            DecodeKernel.GLUON_TMA, lean=lean_step)
    if kernel is DecodeKernel.GLUON or hopper:
        return DecodeConfig(1, 32, 2, wave_programs(DecodeKernel.GLUON, False, head_dim, group), DecodeKernel.GLUON)
    return DecodeConfig(4, 16 if head_dim > 128 else 32, 2, 8)


def eager_config(config: DecodeConfig) -> DecodeConfig:
    """The config an eager launch (no CUDA graph) uses for ``config``: the cp.async Gluon kernel with the same
    tiling (hence the same split geometry and buffers) where ``config`` is the TMA kernel. Its four tensor maps are
    encoded on the host at every launch: in the engine's eager step that cost about 0.2 ms per layer (1 x 32K on
    an H200: 42.5 ms a step against 35.7 with the cp.async kernel, 36 layers), more than the kernel saves; a
    captured graph encodes them once. Any other config is its own."""
    if config.kernel is DecodeKernel.GLUON_TMA:
        return replace(config, kernel=DecodeKernel.GLUON, lean=False)
    return config
