"""Triton kernels: each op is a pure-torch reference, a kernel and a launcher in one module. Imports torch and triton only."""
