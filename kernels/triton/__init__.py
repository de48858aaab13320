"""Triton kernels (@triton.jit code only); typed wrappers: kernels/backends/triton_nvfp4.py, triton_decode.py."""
