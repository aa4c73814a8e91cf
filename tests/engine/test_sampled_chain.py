"""The sampled Domino chain drawn from uniforms drawn first (engine.draft_head): the exponential race
draws from q; the graph's buffer path (the holder's "sampled chain", eager here) and the plain path draw what an
independent step-by-step reference draws from the same uniforms.

- `_Draws`: 40,000 draws from a fixed q, by chi-square; a token of q = 0 is never drawn; the belief
  of each draw is q at the drawn token.
- the holder's "sampled chain" (enabled=False) runs the function a CUDA graph would capture, on its static buffers;
  it and the plain path draw, with the same generator seed, the tokens and q of the race written out
  step by step in this test (`race_chain`), for K = 1..B-1 and a pool.
Run: python -m pytest tests/engine/test_sampled_chain.py -q
"""

import pytest
import torch
from engine_helpers import tiny_draft, tiny_target
from scipy.stats import chisquare

from dominospec.engine.draft_head import DraftHead, _Draws
from dominospec.engine.graphs import DraftGraphs
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


def race_chain(draft, embed_tokens, z, base, x_start, sampling, noise, cand):
    """The sampled chain written out step by step (an independent reference): slot j scores u_j
    (j < P, the whole vocabulary) or u_j + W2 . SiLU(W1 . [z_j ; s_j]) over the pool `cand` (None: the
    vocabulary), q_j = sampling.probs of that, d_j = argmax q_j / -log noise[j] (its first columns),
    and the GRU reads d_j -> (tokens [K], q [K, V] scattered over the vocabulary)."""
    K, V = base.shape
    P = int(draft.config.pure_draft_prefix_len)
    state = draft.gru_step(embed_tokens(x_start), z.new_zeros(1, draft.config.gru_hidden_dim))  # s_0 [1, G]
    tokens, probs = [], []
    for j in range(K):
        if j < P:
            logits, ids = base[j], torch.arange(V)
        else:
            ids = torch.arange(V) if cand is None else cand
            delta = draft.embed_proj[2].weight[ids] @ draft.correction_hidden(z[j][None], state)[0]  # [N]
            logits = base[j, ids] + delta
        q = sampling.probs(logits[None])[0]  # [N]
        position = int((q / noise[j, :q.shape[0]].log().neg()).argmax())
        tokens.append(int(ids[position]))
        probs.append(torch.zeros(V, dtype=q.dtype).index_copy_(0, ids, q))
        state = draft.gru_step(embed_tokens(torch.tensor([tokens[-1]])), state)
    return tokens, torch.stack(probs)


@pytest.mark.parametrize("pool_size", [0, 17])
def test_the_graph_buffers_draw_what_the_written_out_race_draws(pool_size):
    """The graph's function on its static buffers (the holder's "sampled chain", eager on CPU) and the engine's plain
    path against `race_chain` on the same uniforms (the request's generator, drawn as the buffers draw
    them): the same tokens, q and beliefs, for K = 1..B-1, the full vocabulary and a pool."""
    target = tiny_target("llama", vocab=V, dtype=torch.float64, scale=0.2)
    draft = tiny_draft(target, block_size=8, seed=2)
    B, H = 8, 32
    g = torch.Generator().manual_seed(0)
    z_all = torch.randn(B, H, generator=g, dtype=torch.float64)
    base_all = target.lm_head(z_all).detach()
    sampling = Sampling(temperature=0.8, top_p=0.9)
    plain = DraftHead(draft, target.embed_tokens, True, pool_size)
    buffered = DraftHead(draft, target.embed_tokens, True, pool_size,
                         graphs=DraftGraphs(B, H, V, torch.float64, torch.device("cpu"), enabled=False), sampled=True)
    differs = 0
    with torch.inference_mode():
        for K in range(1, B):
            z, base, x_start = z_all[:K], base_all[:K], torch.tensor([3 + K])
            noise = torch.empty(K, V).uniform_(generator=torch.Generator().manual_seed(K))
            tokens, q = race_chain(draft, target.embed_tokens, z, base, x_start, sampling, noise, plain.pool(base))
            for head in (plain, buffered):
                chain = head.chain(z, base, x_start, sampling, torch.Generator().manual_seed(K), False)
                assert chain.tokens.tolist() == tokens, K
                torch.testing.assert_close(chain.probs.double(), q.double(), rtol=1e-6, atol=1e-7)
                assert torch.equal(chain.confidence, chain.probs.gather(1, chain.tokens[:, None])[:, 0])
            differs += tokens != base.argmax(-1).tolist()
    assert differs, "every chain was the base argmax: the draws and the head were never tested"
