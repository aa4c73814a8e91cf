"""Speculative decoding (lossless, greedy and sampling) with a Domino / DFlash draft or prompt lookup, and the AR baseline.

The names below load on first use (PEP 562), so importing one engine module does not load the
whole engine, the draft model and the kernels with it.
"""

import importlib
from typing import Any

_EXPORTS = {
    "MODES": "dominospec.engine.spec",
    "SpecEngine": "dominospec.engine.spec",
    "Generation": "dominospec.engine.stats",
    "GenerationStats": "dominospec.engine.stats",
    "Sampling": "dominospec.engine.sampling",
    "accept_greedy": "dominospec.engine.accept",
    "accept_sampled": "dominospec.engine.accept",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dominospec.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
