"""The candidate pool of the Domino rollout (engine.draft_head), against kernel-free references.

- M = V (and M = 0): identical to the model's own full-vocabulary rollout (tokens and logits).
- M < V: identical to a reference that scores the full vocabulary with the model's correction and
  masks every token outside `topk(max_{j >= P} u_j, M)` to -inf; when sampling, q is 0 outside
  the pool and sums to 1.
Run: python -m pytest tests/engine/test_pool.py -q
"""

import pytest
import torch
from engine_helpers import tiny_draft, tiny_target

from dominospec.engine.draft_head import DraftHead, candidate_pool
from dominospec.engine.sampling import Sampling

V = 96


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", vocab=V, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=8, seed=2)
    g = torch.Generator().manual_seed(0)
    K, H = 7, 32
    z = torch.randn(K, H, generator=g, dtype=torch.float64)
    base = target.lm_head(z).detach()
    return target, draft, z, base, torch.tensor([5])


def reference_chain(draft, z, base, x_start, embed, pool):
    """Greedy chain over full-vocabulary corrected logits, masked outside `pool` (None = no mask)."""
    P = draft.config.pure_draft_prefix_len
    state = draft.gru_step(embed(x_start), torch.zeros(1, draft.config.gru_hidden_dim, dtype=z.dtype))
    tokens, logits = [], []
    for j in range(z.shape[0]):
        q = base[j] if j < P else base[j] + draft.correction(z[j][None], state)[0]
        if j >= P and pool is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[pool] = True
            q = q.masked_fill(~keep, float("-inf"))
        tokens.append(int(q.argmax()))
        logits.append(q)
        state = draft.gru_step(embed(torch.tensor([tokens[-1]])), state)
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("pool_size", [0, V, V + 5])
def test_full_pool_is_the_full_vocabulary(setup, pool_size):
    target, draft, z, base, x_start = setup
    with torch.inference_mode():
        chain = DraftHead(draft, target.embed_tokens, True, pool_size).chain(z, base, x_start, Sampling(), None, True)
        full = draft.rollout(z, base, x_start, target.embed_tokens)
    assert chain.tokens.tolist() == full.tokens.tolist()
    probs = torch.softmax(full.logits, -1).gather(1, full.tokens[:, None])[:, 0]
    torch.testing.assert_close(chain.confidence, probs.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("pool_size", [1, 4, 17])
def test_pool_equals_masked_reference(setup, pool_size):
    target, draft, z, base, x_start = setup
    with torch.inference_mode():
        pool = candidate_pool(base, 1, pool_size)
        assert pool.shape == (pool_size,)
        expected, _ = reference_chain(draft, z, base, x_start, target.embed_tokens, pool)
        chain = DraftHead(draft, target.embed_tokens, True, pool_size).chain(z, base, x_start, Sampling(), None, True)
        assert chain.tokens.tolist() == expected
        assert all(t in pool.tolist() for t in chain.tokens[1:].tolist())


def test_sampled_pool_q_lives_on_the_pool(setup):
    target, draft, z, base, x_start = setup
    pool_size = 9
    with torch.inference_mode():
        pool = set(candidate_pool(base, 1, pool_size).tolist())
        chain = DraftHead(draft, target.embed_tokens, True, pool_size).chain(
            z, base, x_start, Sampling(temperature=1.0), torch.Generator().manual_seed(1), confidence=True)
    outside = torch.tensor([i not in pool for i in range(V)])
    assert chain.probs.shape == (7, V)
    torch.testing.assert_close(chain.probs.sum(-1), torch.ones(7), rtol=1e-6, atol=1e-6)
    assert float(chain.probs[1:, outside].abs().max()) == 0.0
    assert float(chain.probs[0, outside].max()) > 0  # the pure-draft slot draws from the full vocabulary
    rows = torch.arange(7)
    assert torch.all(chain.probs[rows, chain.tokens] > 0)
    torch.testing.assert_close(chain.confidence, chain.probs[rows, chain.tokens])
