"""Shared by the kernel tests: device, tolerances relative to the output's scale, and the skip when triton is absent."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the kernels cannot run")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """|actual - expected| <= rel * max|expected| elementwise (rtol 0): a tolerance that scales with the
    output and stays far below it, so a wrong kernel cannot pass."""
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(actual.float(), expected.float(), atol=rel * max(scale, 1e-30), rtol=0.0)
