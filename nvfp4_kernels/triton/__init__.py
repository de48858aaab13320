"""Triton kernels (@triton.jit code only); typed wrappers: nvfp4_kernels/backends/triton_nvfp4.py, triton_decode.py."""
