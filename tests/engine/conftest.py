"""Fixtures shared by the engine tests: the fp64 tiny Llama target (vocab 8) and its B = 8 draft."""

import pytest
import torch
from engine_helpers import tiny_draft, tiny_target


@pytest.fixture(scope="module")
def target():
    """Random tiny Llama, fp64, 64 positions: peaked next-token distributions, exact arithmetic."""
    return tiny_target("llama", vocab=8, dtype=torch.float64, scale=0.2, max_positions=64)


@pytest.fixture(scope="module")
def draft(target):
    """Random B = 8 draft fitted to `target`."""
    return tiny_draft(target, block_size=8, seed=8)
