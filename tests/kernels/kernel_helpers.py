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


def model_rollout(embed, w_ih, w_hh, w1, w2, P, z, base, x_start, pool_ids=None):
    """The one torch reference of the head's rollout, the model's `rollout`, run on these raw weights
    (common.random_head.head_model) -> (tokens [K], the scored logits [K, V] with -inf outside `pool_ids`)."""
    from common.random_head import head_model

    model, table = head_model(embed, w_ih, w_hh, w1, w2, P, z.shape[0])
    out = model.rollout(z, base, x_start, table, pool=pool_ids)
    return out.tokens, out.logits
