"""Shared test set-up: CPU only, Triton in interpreter mode where no GPU is present."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny test models gain nothing from threads; one thread avoids oversubscription on 2 cores.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    """Every test starts with one torch thread (a stage under test may have set more) and leaves it as it was."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
