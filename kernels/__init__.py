"""Triton kernels, installed as `dominospec.kernels`: each module holds an op's pure-torch reference,
its kernel and its launcher, in that order (docs/kernels.md).

The Domino head's rollout (the engine's `engine.head_kernel`):
- gru_cell: fused bias-free GRU cell; token id on device, input gates from a [V, 3G] table or a GEMV.
- correction_argmax: SiLU(h) · W2ᵀ + base logits, split-vocabulary argmax (+ logsumexp); candidate pool.
- head_rollout: the whole greedy K-step rollout of one block on device (CUDA-graph capturable).
- pool_select: the candidate pool (top-M of the max over rows) as a radix select, ids ascending.
- tree_grow: DominoTree's build, the best-first draft tree's frontiers, four launches a depth.

The lean decoder's layer (the engine's `engine.lean_target`, nine launches a layer):
- rms_norm: RMSNorm with the residual add before it.
- rope_cache: rotary embedding (+ Qwen3's q/k norm) and the KV-cache write of one layer.
- tree_attention: a draft tree's rows (or one row) over the KV cache, ancestors-only bitmask.
- silu_mul: SiLU(gate) · up of a fused gate/up projection.

The regenerate stage's static decoder (`regenerate.attention: rows`):
- decode_attention: one query row of each of B sequences over its own cached columns (per-row lengths).

Training:
- cross_entropy: fused per-row cross-entropy over a wide vocabulary (`train.ce_kernel`).
- distill: the acceptance + kd loss on the target's distribution, value and gradient in one launch (`train.distill_kernel`).

Imports torch and triton only (tests/test_layout.py). On a machine without CUDA, set
TRITON_INTERPRET=1 before triton is imported.

The block below stays because of where this folder sits. `python -m pytest` and `python -c` run in
the checkout put its root on the import path, so a plain `import kernels` finds this folder before
the PyPI package `kernels`, which transformers imports with its modeling code once installed. Only
moving the folder out of the repository root (under src/dominospec/) would remove that; until then
a top-level import of this folder hands the name `kernels` over to the PyPI package
(tests/test_layout.py checks it).
"""

if __name__ == "kernels":
    # Imported as a top-level `kernels`: the repository root is on sys.path (`python -m` or `python -c`
    # run there), so this folder hides the PyPI package of that name, which transformers imports once
    # it is installed. This package's name is `dominospec.kernels`; hand the top-level name over.
    import importlib as _importlib
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _saved = list(_sys.path)
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    del _sys.modules["kernels"]
    try:
        _sys.modules["kernels"] = _importlib.import_module("kernels")
    except ImportError as _err:
        raise ImportError(
            f"`import kernels` found the folder {_root}/kernels (dominospec.kernels) because {_root} is on "
            "sys.path, and no PyPI package `kernels` is installed to take the name"
        ) from _err
    finally:
        _sys.path[:] = _saved
