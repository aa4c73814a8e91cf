"""Triton kernels of the Domino head: each op is a pure-torch reference, a kernel and a launcher in one module.

- gru_cell: fused bias-free GRU cell; token id on device, input gates from a [V, 3G] table or a GEMV.
- correction_argmax: SiLU(h) · W2ᵀ + base logits, split-vocabulary argmax (+ logsumexp); candidate pool.
- head_rollout: the whole greedy K-step rollout on device (CUDA-graph capturable).
- pool_select: the candidate pool (top-M of the max over rows) as a radix select in four launches, ids ascending.

Imports torch and triton only (tests/test_layout.py). On a machine without CUDA, set
TRITON_INTERPRET=1 before triton is imported.
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
