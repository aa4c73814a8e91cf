"""The Domino draft: DFlash backbone + causal GRU logit-correction head."""

from .configuration_domino import DominoDraftConfig
from .modeling_domino import DFlashDraftModel, DraftContextCache, DraftRollout, greedy

__all__ = ["DominoDraftConfig", "DFlashDraftModel", "DraftContextCache", "DraftRollout", "greedy"]
