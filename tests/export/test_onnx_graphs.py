"""ONNX graphs of the exported draft: checked, run by onnxruntime, equal to PyTorch within fp32 rounding.

Tolerance: |ORT - torch| <= 1e-5 x max|torch| per output. Both compute in fp32 with different
kernels and op orders; measured on this draft the difference is <= 1.1e-6 of the output scale
(about 10 fp32 ulps after two layers), so 1e-5 leaves 10x headroom while staying four orders below
the signal: the base logits here span about +-4 and the argmax is compared exactly.
Run: python -m pytest tests/export/test_onnx_graphs.py -q
"""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dominospec.export.onnx_graphs import passthrough_step, write_single
from dominospec.models.domino import DFlashDraftModel

RTOL_OF_MAX = 1e-5


def session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def assert_close(got: np.ndarray, want: torch.Tensor) -> None:
    want = want.detach().numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= RTOL_OF_MAX * np.abs(want).max()


@pytest.fixture(scope="module")
def draft(exported) -> DFlashDraftModel:
    """The exported draft in fp32: the weights the graphs hold."""
    return DFlashDraftModel.from_pretrained(exported.paths.draft).float().eval()


@pytest.fixture(scope="module")
def lm_head(tiny_target) -> torch.Tensor:
    return tiny_target.lm_head.weight.detach().float()  # [V, H]


def test_graphs_pass_the_checker_and_declare_the_interface(exported):
    block, step = onnx.load(exported.paths.onnx), onnx.load(exported.paths.onnx_rollout)
    for model in (block, step):
        onnx.checker.check_model(model)
        assert model.opset_import[0].version == 17

    def dims(values):
        return {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in values}

    assert dims(block.graph.input) == {"block_embeds": [1, 4, 32], "block_positions": [1, 4],
                                       "target_features": [1, "context_length", 64]}
    assert dims(block.graph.output) == {"base_logits": [1, 4, 300], "z": [1, 4, 32]}
    assert dims(step.graph.input) == {"z": [1, 32], "state": [1, 20], "token_embed": [1, 32], "base_logits": [1, 300]}
    assert dims(step.graph.output) == {"new_state": [1, 20], "logits": [1, 300], "token": [1]}


@pytest.mark.parametrize("context_length", [1, 13])  # neither is the traced length (5)
def test_block_graph_matches_pytorch(exported, draft, lm_head, context_length):
    g = torch.Generator().manual_seed(context_length)
    embeds = torch.randn(1, 4, 32, generator=g)
    positions = torch.arange(context_length, context_length + 4)[None]
    features = torch.randn(1, context_length, 64, generator=g)
    u, z = session(exported.paths.onnx).run(None, {
        "block_embeds": embeds.numpy(), "block_positions": positions.numpy(), "target_features": features.numpy()})
    with torch.no_grad():
        z_ref = draft(embeds, positions, target_features=features)
        u_ref = z_ref @ lm_head.T
    assert_close(z, z_ref)
    assert_close(u, u_ref)
    assert np.abs(u_ref.numpy()).max() > 2  # the tolerance is small against the logits' scale


def test_rollout_step_matches_pytorch(exported, draft):
    g = torch.Generator().manual_seed(1)
    z, state, embed, base = torch.randn(1, 32, generator=g), torch.randn(1, 20, generator=g), \
        torch.randn(1, 32, generator=g), 5 * torch.randn(1, 300, generator=g)
    new_state, logits, token = session(exported.paths.onnx_rollout).run(None, {
        "z": z.numpy(), "state": state.numpy(), "token_embed": embed.numpy(), "base_logits": base.numpy()})
    with torch.no_grad():
        state_ref = draft.gru_step(embed, state)
        logits_ref = base + draft.correction(z, state_ref)
    assert_close(new_state, state_ref)
    assert_close(logits, logits_ref)
    assert token.tolist() == logits_ref.argmax(-1).tolist()
    assert not torch.allclose(logits_ref, base, atol=1e-2)  # the head's correction is really there


def test_onnx_rollout_drafts_the_same_tokens_as_the_model(exported, draft, lm_head, tiny_target):
    """The documented driving loop over both graphs == DFlashDraftModel.rollout (greedy)."""
    embed_table = tiny_target.embed_tokens.weight.detach().float()  # [V, H]
    block, step = session(exported.paths.onnx), session(exported.paths.onnx_rollout)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        S = 6 + seed
        last_token = int(torch.randint(3, 290, (1,), generator=g))
        block_ids = torch.tensor([last_token] + [299] * 3)
        features = torch.randn(1, S, 64, generator=g)
        positions = torch.arange(S, S + 4)[None]
        u, z = block.run(None, {"block_embeds": embed_table[block_ids][None].numpy(),
                                "block_positions": positions.numpy(), "target_features": features.numpy()})
        state, previous, tokens = np.zeros((1, 20), np.float32), last_token, []
        for j in range(3):  # K = B - 1 drafts
            state, _, token = step.run(None, {"z": z[:, j], "state": state, "token_embed": embed_table[[previous]].numpy(),
                                              "base_logits": u[:, j]})
            previous = int(u[0, j].argmax()) if j < 1 else int(token[0])  # pure_draft_prefix_len = 1
            tokens.append(previous)
        with torch.no_grad():
            z_ref = draft(embed_table[block_ids][None], positions, target_features=features)
            ref = draft.rollout(z_ref[:, :3], z_ref[:, :3] @ lm_head.T, torch.tensor([last_token]),
                                tiny_target.embed_tokens)
        assert tokens == ref.tokens[0].tolist(), seed


def test_head_off_step_passes_the_base_logits_through():
    model = passthrough_step(H=32, G=20, V=300, opset=17)
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    state, base = np.random.rand(1, 20).astype(np.float32), np.random.rand(1, 300).astype(np.float32)
    new_state, logits, token = sess.run(None, {"z": np.zeros((1, 32), np.float32), "state": state,
                                               "token_embed": np.zeros((1, 32), np.float32), "base_logits": base})
    assert np.array_equal(new_state, state) and np.array_equal(logits, base) and token.tolist() == [int(base.argmax())]


def test_graph_with_one_file_per_weight_is_rewritten_with_one_sidecar(exported, tmp_path):
    """What the tracer writes past 2 GB (a file per weight) ends up as <name> + <name>.data."""
    traced_dir = tmp_path / "traced"
    traced_dir.mkdir()
    model = onnx.load(exported.paths.onnx_rollout)
    onnx.save_model(model, str(traced_dir / "step.onnx"), save_as_external_data=True, all_tensors_to_one_file=False,
                    size_threshold=0)
    assert len(list(traced_dir.iterdir())) > 2
    out = tmp_path / "out" / "step.onnx"
    out.parent.mkdir()
    write_single(traced_dir / "step.onnx", out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["step.onnx", "step.onnx.data"]
    feeds = {"z": np.ones((1, 32), np.float32), "state": np.zeros((1, 20), np.float32),
                   "token_embed": np.ones((1, 32), np.float32), "base_logits": np.zeros((1, 300), np.float32)}
    want = session(exported.paths.onnx_rollout).run(None, feeds)
    got = session(out).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert Path(str(out) + ".data").stat().st_size > 1000
