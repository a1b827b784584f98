"""Triton kernels, one module per op (named as the op), each also run on the CPU by Triton's interpreter."""
