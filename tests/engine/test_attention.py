"""runtime.attention: grouped-query attention without repeated keys equals transformers' sdpa.

- Several rows with a mask (every verify): the output equals `repeat_kv` + SDPA to the bit, over
  odd head groupings, lengths, tree-shaped boolean masks and additive masks, fp32 and fp64.
- One row (the AR step): within float rounding of transformers' own path.
- What it does not cover (no mask over a longer cache, position biases, one query head per
  key/value head) goes to transformers' sdpa unchanged; a causal prefill it runs itself, equal to
  the repeated path.
- A model switched to it gives the same logits on a tree verify, its forwards do run through it,
  and greedy speculative decoding with trees stays equal to AR on it.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import engine_params, random_prompts, tiny_draft, tiny_target
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

import dominospec.runtime.attention as attention
from dominospec.engine import SpecEngine
from dominospec.runtime.attention import NAME, grouped_sdpa, use_grouped_sdpa
from dominospec.engine.target_kv import DynamicTargetKV
from dominospec.engine.verify_shape import branch_tree

SHAPES = [(9, 3, 12, 300), (4, 2, 5, 37), (8, 1, 2, 9), (6, 3, 20, 61)]  # H, H_kv, T rows, S columns


def module(groups: int) -> SimpleNamespace:
    return SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)


def tree_mask(T: int, S: int, seed: int) -> torch.Tensor:
    """[1, 1, T, S] bool: every cached column, then a random tree over the T new rows (each sees itself)."""
    g = torch.Generator().manual_seed(seed)
    own = torch.rand(T, T, generator=g) < 0.5
    own = own.tril() | torch.eye(T, dtype=torch.bool)
    return torch.cat([torch.ones(T, S - T, dtype=torch.bool), own], dim=1)[None, None]


def repeated(query, key, value, mask, scale):
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask,
                                         scale=scale)
    return out.transpose(1, 2).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("H, H_kv, T, S", SHAPES)
def test_several_rows_equal_repeated_keys_to_the_bit(H, H_kv, T, S, dtype):
    g = torch.Generator().manual_seed(H * T + S)
    query, key, value = (torch.randn(1, h, n, 8, generator=g, dtype=dtype) for h, n in ((H, T), (H_kv, S), (H_kv, S)))
    for mask in (tree_mask(T, S, seed=S), torch.where(tree_mask(T, S, seed=T), 0.0, float("-inf")).to(dtype)):
        out, _ = grouped_sdpa(module(H // H_kv), query, key, value, mask, scaling=0.3)
        assert out.shape == (1, T, H, 8)
        assert torch.equal(out, repeated(query, key, value, mask, 0.3))


def test_one_row_within_rounding_of_transformers():
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, h, n, 64, generator=g) for h, n in ((9, 1), (3, 300), (3, 300)))
    out, _ = grouped_sdpa(module(3), query, key, value, None, scaling=0.125)
    theirs, _ = sdpa_attention_forward(module(3), query, key, value, None, scaling=0.125)
    assert out.shape == theirs.shape == (1, 1, 9, 64)
    torch.testing.assert_close(out, theirs, rtol=0, atol=1e-6)
    assert (out - repeated(query, key, value, None, 0.125)).abs().max() < 1e-6


def test_what_it_does_not_cover_goes_to_transformers(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(k) or ("theirs", None))
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    longer = torch.randn(1, 2, 9, 8, generator=g)
    assert grouped_sdpa(module(2), q, longer, longer, None)[0] == "theirs"  # causal over a cache, no mask
    assert grouped_sdpa(module(2), q, k, v, tree_mask(6, 6, 0), position_bias=torch.zeros(1, 4, 6, 6))[0] == "theirs"
    assert grouped_sdpa(module(1), q, torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8), tree_mask(6, 6, 0))[0] == "theirs"
    assert len(calls) == 3
    out, _ = grouped_sdpa(module(2), q, k, v, tree_mask(6, 6, 0))
    assert torch.is_tensor(out) and len(calls) == 3
    causal, _ = grouped_sdpa(module(2), q, k, v, None)  # a prefill over no cache: causal, its own
    expected = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True).transpose(1, 2)
    assert len(calls) == 3 and torch.equal(causal, expected.contiguous())


def test_switching_a_model_keeps_its_logits_and_runs_through_it(monkeypatch):
    target = tiny_target("llama", vocab=96, dtype=torch.float64)
    assert use_grouped_sdpa(target.model) and target.model.config._attn_implementation == NAME
    assert use_grouped_sdpa(target.model)  # idempotent
    ids = torch.tensor([random_prompts(1, 96, seed=3, min_len=20, max_len=20)[0]])
    tree = branch_tree([3, 3, 2], torch.device("cpu"))
    rows = torch.tensor([[5, 7, 9, 11, 13, 17, 19, 23, 29]])

    def verify() -> torch.Tensor:
        kv = DynamicTargetKV(target.model, [1, 2])
        kv.forward(ids, keep=1)
        return kv.forward(rows, keep=9, tree=tree)[0]

    calls = []
    def counted(*args, **kwargs):
        calls.append(kwargs)
        return F.scaled_dot_product_attention(*args, **kwargs)

    spy = SimpleNamespace(scaled_dot_product_attention=counted)
    monkeypatch.setattr(attention, "F", spy)
    grouped = verify()
    assert len(calls) == 2 * target.num_layers and all(c["enable_gqa"] for c in calls)  # the prefill and the verify
    target.model.set_attn_implementation("sdpa")
    torch.testing.assert_close(grouped, verify(), rtol=0, atol=1e-12)


def test_greedy_trees_equal_ar_on_grouped_attention():
    target = tiny_target("qwen3", vocab=8, dtype=torch.float32, scale=0.2)
    use_grouped_sdpa(target.model)
    draft = tiny_draft(target, block_size=4, seed=4)
    ar = SpecEngine(target, None, "ar", params=engine_params())
    spec = SpecEngine(target, draft, "domino", 3, engine_params(tree=dict(shape="best_first", nodes=8), ngram_assist=True,
                                                               ngram_fork=True))
    side_wins = 0
    for prompt in random_prompts(10, 8, seed=5):
        out = spec.generate(prompt, 24)
        assert out.token_ids == ar.generate(prompt, 24).token_ids
        side_wins += out.stats.tree_side_wins
    assert side_wins > 0  # trees did verify paths off the draft's best first token through the grouped path
