"""The lean decoder's forward on the Triton ops (interpreted on CPU) equals it on their torch references.

The references are what tests/engine/test_lean_decoder.py holds against transformers' forward; here
the whole forward (prefill, then a tree verify) runs once on the kernels themselves.
Run: python -m pytest tests/kernels/test_lean_on_kernels.py -q
"""

import os

import pytest
import torch

from engine_helpers import tiny_target  # noqa: E402

from dominospec.models.lean import DecoderOps, LeanDecoder  # noqa: E402
from dominospec.engine.target_kv import LeanForward, StaticTargetKV  # noqa: E402
from dominospec.engine.verify_shape import branch_tree  # noqa: E402


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="the Triton ops need CUDA or TRITON_INTERPRET=1 (tests/kernels sets it)")
def test_the_lean_forward_on_the_triton_ops_equals_it_on_the_references():
    target = tiny_target("qwen3", vocab=32, dtype=torch.float32, layers=2, head_dim=16)  # the kernels' smallest head
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target.model.to(device)
    with torch.inference_mode():
        results = []
        for ops in (DecoderOps.reference(), DecoderOps.triton()):
            runner = StaticTargetKV(LeanForward(LeanDecoder(target.model, ops)), [0, 1], capacity=32, max_rows=8,
                                    graphs=False)
            ids = torch.randint(3, 30, (1, 12), generator=torch.Generator().manual_seed(5)).to(device)
            runner.forward(ids[:, :6], 1)
            results.append(runner.forward(ids[:, 6:], 6, tree=branch_tree((3, 2), device)))
    (a, fa), (b, fb) = results
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fb, fa, rtol=1e-5, atol=1e-5)
