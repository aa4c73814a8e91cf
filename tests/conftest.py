"""Shared test set-up: CPU only, Triton in interpreter mode where no GPU is present."""

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))

REPO = Path(__file__).resolve().parents[1]
