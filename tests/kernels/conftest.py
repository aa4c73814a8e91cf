"""Kernel tests run on CPU under Triton's interpreter: TRITON_INTERPRET=1 is set before triton is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
