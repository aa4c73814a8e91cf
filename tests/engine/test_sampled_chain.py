"""The sampled Domino chain drawn from uniforms drawn first (engine.draft_head): the exponential race
draws from q; the graph's buffer path (`SampledChains`, eager here) equals the plain path for one seed.

- `_Draws`: 40,000 draws from a fixed q, by chi-square; a token of q = 0 is never drawn; the belief
  of each draw is q at the drawn token.
- `SampledChains(enabled=False)` runs the function a CUDA graph would capture, on its static buffers:
  tokens, q and beliefs equal the plain path's with the same generator seed, for K = 1..B-1 and a pool.
Run: python -m pytest tests/engine/test_sampled_chain.py -q
"""

import pytest
import torch
from engine_helpers import tiny_draft, tiny_target
from scipy.stats import chisquare

from dominospec.engine.draft_head import DraftHead, SampledChains, _Draws
from dominospec.engine.sampling import Sampling

V = 96


def test_the_exponential_race_draws_from_q():
    q = torch.tensor([0.5, 0.25, 0.0, 0.125, 0.0625, 0.0625])
    logits = q.log()[None]  # Sampling at T = 1 turns these back into q
    n = 40_000
    noise = torch.rand(n, q.numel(), generator=torch.Generator().manual_seed(3))
    draws = _Draws(Sampling(temperature=1.0), noise, q.numel(), None)
    picked = torch.cat([draws(logits) for _ in range(n)])
    counts = torch.bincount(picked, minlength=q.numel()).double()
    assert counts[2] == 0  # q = 0: never
    keep = q > 0
    assert chisquare(counts[keep].numpy(), (q[keep].double() * n).numpy()).pvalue > 1e-3
    beliefs = torch.stack(draws.beliefs)
    assert torch.allclose(beliefs, q[picked], atol=1e-6)


def test_a_biased_race_fails_the_same_test():
    """argmax q·E (not q / E) favours the likely tokens: the chi-square above must reject it."""
    q = torch.tensor([0.5, 0.25, 0.125, 0.125])
    noise = torch.rand(40_000, 4, generator=torch.Generator().manual_seed(3))
    picked = (q * noise.log().neg()).argmax(-1)
    counts = torch.bincount(picked, minlength=4).double()
    assert chisquare(counts.numpy(), (q.double() * 40_000).numpy()).pvalue < 1e-6


@pytest.mark.parametrize("pool_size", [0, 17])
def test_the_graph_buffers_draw_what_the_plain_path_draws(pool_size):
    target = tiny_target("llama", vocab=V, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=8, seed=2)
    B, H = 8, 32
    g = torch.Generator().manual_seed(0)
    z_all = torch.randn(B, H, generator=g, dtype=torch.float64)
    base_all = target.lm_head(z_all).detach()
    sampling = Sampling(temperature=0.8, top_p=0.9)
    plain = DraftHead(draft, target.embed_tokens, True, pool_size)
    buffered = DraftHead(draft, target.embed_tokens, True, pool_size,
                         sampled=SampledChains(B, H, V, torch.float64, torch.device("cpu"), enabled=False))
    with torch.inference_mode():
        for K in range(1, B):
            z, base, x_start = z_all[:K], base_all[:K], torch.tensor([3 + K])
            a = plain.chain(z, base, x_start, sampling, torch.Generator().manual_seed(K), False)
            b = buffered.chain(z, base, x_start, sampling, torch.Generator().manual_seed(K), False)
            assert a.tokens.tolist() == b.tokens.tolist()
            assert a.probs.shape == (K, V) and torch.equal(a.probs, b.probs) and torch.equal(a.confidence, b.confidence)
            assert torch.allclose(a.probs.sum(-1), torch.ones(K, dtype=a.probs.dtype))
            assert torch.equal(a.confidence, a.probs.gather(1, a.tokens[:, None])[:, 0])
