"""Triton kernels (@triton.jit code only); typed wrappers live in kernels/backends/triton_backend.py."""
