"""Speculative decoding (lossless, greedy and sampling) with a Domino / DFlash draft or prompt lookup, and the AR baseline."""

from dominospec.engine.loading import check_draft_matches, draft_dir, load_draft
from dominospec.engine.sampling import Sampling, accept_greedy, accept_sampled
from dominospec.engine.packed import pack_linears
from dominospec.engine.spec import MODES, SpecEngine
from dominospec.engine.stats import Generation, GenerationStats

__all__ = [
    "MODES",
    "Generation",
    "GenerationStats",
    "Sampling",
    "SpecEngine",
    "accept_greedy",
    "accept_sampled",
    "check_draft_matches",
    "draft_dir",
    "load_draft",
    "pack_linears",
]
