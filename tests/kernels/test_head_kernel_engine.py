"""engine.head_kernel: triton against torch on tiny random drafts (fp32): the same chains, the same rounds.

- DraftHead's greedy chain on the prepared kernels equals the model's rollout (the torch path) token
  for token (full vocabulary and candidate pool; confidence within 1e-5);
- SpecEngine(head_kernel="triton") generates what head_kernel torch generates, with equal
  acceptance round by round (identical drafts), greedy and sampled (the race on the same uniforms);
- the switch raises a UserError naming the key where Triton cannot run.
Run: python -m pytest tests/kernels/test_head_kernel_engine.py -q
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from kernel_helpers import DEVICE  # noqa: F401  (skips the module when triton is absent)

from engine_helpers import engine_params, fit_draft, random_prompts, tiny_draft, tiny_target  # noqa: E402

from dominospec.config import load_params  # noqa: E402
from dominospec.engine import SpecEngine  # noqa: E402
from dominospec.engine.decoding import head_kernels  # noqa: E402
from dominospec.engine.draft_head import prepare_head_kernels  # noqa: E402
from dominospec.engine.draft_head import DraftHead  # noqa: E402
from dominospec.engine.sampling import Sampling  # noqa: E402
from dominospec.errors import UserError  # noqa: E402

V = 96
cpu_engine = pytest.mark.skipif(torch.cuda.is_available(), reason="the tiny engine runs on CPU, where the kernels "
                                "need TRITON_INTERPRET; on a GPU benchmarks/head_kernels_gpu.py checks them")


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("qwen3", vocab=V, dtype=torch.float32, scale=0.2)
    draft = tiny_draft(target, block_size=8, seed=4)
    return target, draft, prepare_head_kernels(draft, target.embed_tokens)


def blocks(target, n, K=7, H=32):
    g = torch.Generator().manual_seed(11)
    for i in range(n):
        z = torch.randn(K, H, generator=g)
        yield z, target.lm_head(z).detach(), torch.tensor([3 + i])


@cpu_engine
@pytest.mark.parametrize("pool_size", [0, 13])
def test_greedy_chain_equals_torch(setup, pool_size):
    target, draft, kernels = setup
    changed = 0
    with torch.inference_mode():
        for z, base, x_start in blocks(target, 4):
            args = (z, base, x_start, Sampling(), None, True)
            ref = DraftHead(draft, target.embed_tokens, True, pool_size).chain(*args)
            fast = DraftHead(draft, target.embed_tokens, True, pool_size, kernels).chain(*args)
            assert fast.tokens.tolist() == ref.tokens.tolist()
            torch.testing.assert_close(fast.confidence, ref.confidence, atol=1e-5, rtol=0)
            changed += fast.tokens.tolist() != base.argmax(-1).tolist()
    assert changed, "the head never changed a token: the comparison would only test the base argmax"


@cpu_engine
def test_engine_with_triton_head_equals_torch_head(setup):
    target, draft, _ = setup
    torch_engine = SpecEngine(target, draft, "domino", params=engine_params(candidate_pool=0))
    triton_engine = SpecEngine(target, draft, "domino", params=engine_params(head_kernel="triton"))
    assert torch_engine.head.kernels is None and triton_engine.head.kernels is not None
    for prompt in random_prompts(2, V, seed=5):
        a, b = torch_engine.generate(prompt, 12), triton_engine.generate(prompt, 12)
        assert b.token_ids == a.token_ids
        assert b.stats.accepted_lengths == a.stats.accepted_lengths  # the same drafts, round by round


@cpu_engine
def test_sampled_engine_with_triton_head_draws_as_the_torch_head(setup, monkeypatch):
    """A temperature-only sampled chain runs on the kernels (kernels.head_rollout's race) from the same
    uniforms as the torch path: with the full vocabulary (no pool order to differ) the same seed gives
    the same tokens and the same rounds."""
    import dominospec.kernels.head_rollout as kernel

    sampled_calls = []
    rollout = kernel.head_rollout

    def counted(*args, **kwargs):
        sampled_calls.append(kwargs.get("noise") is not None)
        return rollout(*args, **kwargs)

    monkeypatch.setattr(kernel, "head_rollout", counted)
    target, draft, _ = setup
    options = dict(candidate_pool=0, ngram_fork=False)
    torch_engine = SpecEngine(target, draft, "domino", params=engine_params(**options))
    triton_engine = SpecEngine(target, draft, "domino", params=engine_params(head_kernel="triton", **options))
    sampling = Sampling(temperature=0.8)
    seen = set()
    for i, prompt in enumerate(random_prompts(3, V, seed=6)):
        a = torch_engine.generate(prompt, 12, sampling, seed=i)
        b = triton_engine.generate(prompt, 12, sampling, seed=i)
        assert b.token_ids == a.token_ids
        assert b.stats.accepted_lengths == a.stats.accepted_lengths
        seen.add(tuple(a.token_ids))
    assert len(seen) == 3
    assert sampled_calls and all(sampled_calls), "the triton engine's sampled chains ran on the kernels"


@cpu_engine
@pytest.mark.parametrize("pool_size", [0, 13])
def test_static_engine_runs_the_rollout_through_its_graph_buffers(setup, pool_size):
    """With static caches the greedy rollout (pool selection included) runs on the holder's static
    inputs, one function per K (CUDA graphs on a GPU, the same function eagerly here): the same tokens
    and rounds as the torch head on the dynamic caches, and one function per K that was drafted."""
    target, draft, _ = setup
    torch_engine = SpecEngine(target, draft, "domino", params=engine_params(candidate_pool=pool_size))
    static = SpecEngine(target, draft, "domino", num_draft="auto",
                        params=engine_params(head_kernel="triton", candidate_pool=pool_size, cuda_graphs="static"))
    fixed = SpecEngine(target, draft, "domino",
                       params=engine_params(head_kernel="triton", candidate_pool=pool_size, cuda_graphs="static"))
    assert static.head.graphs is not None and torch_engine.head.graphs is None
    for prompt in random_prompts(2, V, seed=5):
        a, b = torch_engine.generate(prompt, 12), fixed.generate(prompt, 12)
        assert b.token_ids == a.token_ids
        assert b.stats.accepted_lengths == a.stats.accepted_lengths
        assert static.generate(prompt, 12).token_ids == a.token_ids  # auto-K
    keys = set(fixed.path.graphs.sets["head rollout"].functions)  # K = num_draft, or fewer near the token budget
    assert (fixed.num_draft, False) in keys and all(1 <= K <= fixed.num_draft and not c for K, c in keys)
    assert static.path.graphs.sets["head rollout"].functions  # the auto-K engine drafted through them too
    assert static.graph_failures() == {}


def test_switch_needs_cuda_or_the_interpreter(monkeypatch):
    cfg = load_params(Path(__file__).resolve().parents[2] / "params.yaml").engine
    assert cfg.head_kernel == "auto"
    triton_cfg = dataclasses.replace(cfg, head_kernel="triton")
    assert head_kernels(triton_cfg.head_kernel, torch.device("cpu"))  # interpreter (or CUDA) here
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="engine.head_kernel"):
        head_kernels(triton_cfg.head_kernel, torch.device("cpu"))


@cpu_engine
def test_auto_runs_the_torch_ops_on_a_cpu_draft(setup):
    """`auto` = Triton only where it runs compiled (a CUDA draft); here, even with the interpreter on,
    it must be the torch path (the interpreter is for tests, not for speed)."""
    target, draft, _ = setup
    engine = SpecEngine(target, draft, "domino", params=engine_params(head_kernel="auto"))
    assert engine.head.kernels is None
    assert not head_kernels(load_params(Path(__file__).resolve().parents[2] / "params.yaml").engine.head_kernel,
                            torch.device("cpu"))


@pytest.fixture(scope="module")
def trained(setup):
    """The tiny target and a draft trained on its greedy replies to 3 prompts (engine_helpers.fit_draft),
    so that DominoTree's rounds accept deep: the kernels' build is compared where it is accepted."""
    target, _, _ = setup
    ar = SpecEngine(target, None, "ar", params=engine_params())
    prompts = random_prompts(3, V, seed=7)
    replies = [ar.generate(p, NEW_TOKENS).token_ids for p in prompts]
    draft = fit_draft(target, tiny_draft(target, block_size=8, seed=4), prompts, replies, steps=80)
    return target, draft, prompts, replies


NEW_TOKENS = 24


@cpu_engine
@pytest.mark.parametrize("pool_size", [0, 13])
def test_dominotree_grown_on_the_kernels_decodes_as_on_torch_ops(trained, pool_size):
    """DominoTree with head_kernel triton grows its tree on kernels.tree_grow (the engine's grower
    says so): the same tokens and the same accepted lengths, round for round, as the torch-op build,
    and plain decoding's tokens, on 3 prompts x 24 tokens with a trained draft whose trees are
    accepted deep (pooled τ > 2). Static caches run the build through the grower's buffers."""
    target, draft, prompts, replies = trained
    params = dict(candidate_pool=pool_size, tree=dict(nodes=12, children=3), ngram_assist=False)
    torch_engine = SpecEngine(target, draft, "dominotree", params=engine_params(**params))
    fast = SpecEngine(target, draft, "dominotree", params=engine_params(head_kernel="triton", **params))
    static = SpecEngine(target, draft, "dominotree",
                        params=engine_params(head_kernel="triton", cuda_graphs="static", **params))
    assert torch_engine.grower.kernels is None and fast.grower.kernels is not None
    emitted = rounds = 0
    for prompt, reply in zip(prompts, replies):
        a, b, c = (engine.generate(prompt, NEW_TOKENS) for engine in (torch_engine, fast, static))
        assert b.token_ids == a.token_ids == c.token_ids == reply
        assert b.stats.accepted_lengths == a.stats.accepted_lengths == c.stats.accepted_lengths
        emitted, rounds = emitted + sum(b.stats.accepted_lengths), rounds + b.stats.rounds
    assert emitted / rounds > 2.0, f"pooled τ {emitted / rounds:.2f}: the trees were hardly accepted"
