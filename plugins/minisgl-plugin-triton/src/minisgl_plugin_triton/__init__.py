"""Triton kernels for minisgl on CUDA: the kernel set ``triton``."""
