"""Triton kernels of the Domino head: each op is a pure-torch reference, a kernel and a launcher in one module.

- gru_cell: fused bias-free GRU cell; token id on device, input gates from a [V, 3G] table or a GEMV.
- correction_argmax: SiLU(h) · W2ᵀ + base logits, split-vocabulary argmax (+ logsumexp); candidate pool.
- correction_sample: the same scores as a full fp32 row + logsumexp pieces, for lossless sampling.
- head_rollout: the whole greedy K-step rollout on device (CUDA-graph capturable).

Imports torch and triton only (tests/test_layout.py). On a machine without CUDA, set
TRITON_INTERPRET=1 before triton is imported.
"""
