"""`train.loss_vocab: sampled`: each step's softmax over its labels plus uniform negatives.

Run: python -m pytest tests/train/test_sampled_vocab.py -q
"""

import math

import pytest
import torch

from dominospec.train.objective import position_weights, weighted_ce
from dominospec.train.sampled_vocab import sample_vocabulary

V = 500


def _labels(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 60, (6, 4), generator=g)  # [N, Bk]: positives among the first 60 tokens
    mask = torch.rand(6, 4, generator=g) > 0.3
    return labels, mask


def test_the_set_holds_every_positive_and_distinct_negatives_with_their_shift():
    labels, mask = _labels()
    sv = sample_vocabulary(labels, mask, V, 100, torch.Generator().manual_seed(3))
    positives = set(labels[mask].tolist())
    ids = sv.ids.tolist()
    assert ids == sorted(set(ids)) and len(ids) == len(positives) + 100  # sorted, no duplicates
    assert positives <= set(ids) and sv.num_positives == len(positives)
    shift = math.log((V - len(positives)) / 100)
    for token, offset in zip(ids, sv.offset.tolist()):
        assert offset == (0.0 if token in positives else pytest.approx(shift))
    assert (sv.ids[sv.columns(labels)][mask] == labels[mask]).all()  # every supervised label finds its column
    again = sample_vocabulary(labels, mask, V, 100, torch.Generator().manual_seed(3))
    assert torch.equal(again.ids, sv.ids)  # a function of the seed: a resumed step draws the same set
    other = sample_vocabulary(labels, mask, V, 100, torch.Generator().manual_seed(4))
    assert not torch.equal(other.ids, sv.ids)


def test_with_every_negative_drawn_the_loss_is_the_full_softmax_loss():
    labels, mask = _labels(1)
    logits = torch.randn(6, 4, V, generator=torch.Generator().manual_seed(2)) * 3
    w = position_weights(4, 2.0)
    sv = sample_vocabulary(labels, mask, V, V, torch.Generator().manual_seed(0))
    assert sv.ids.tolist() == list(range(V)) and not sv.offset.any()
    sampled = weighted_ce(sv.shift(logits[..., sv.ids]), sv.columns(labels), mask, w)
    torch.testing.assert_close(sampled, weighted_ce(logits, labels, mask, w), rtol=0, atol=1e-5)


def test_the_shifted_partition_sum_is_unbiased():
    """E[Z_hat] = Z over draws: the mean of 2,000 draws lies within 4 standard errors of the exact
    partition sum, and without the shift it would be far below (it misses (V-P)/m of the mass)."""
    labels, mask = _labels(2)
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 2  # one row's logits
    exact = logits.exp().sum()
    estimates, unshifted = [], []
    for seed in range(2000):
        sv = sample_vocabulary(labels, mask, V, 50, torch.Generator().manual_seed(seed))
        estimates.append(sv.shift(logits[sv.ids]).exp().sum())
        unshifted.append(logits[sv.ids].exp().sum())
    est = torch.stack(estimates)
    se = est.std() / math.sqrt(est.numel())
    assert abs(est.mean() - exact) < 4 * se
    assert torch.stack(unshifted).mean() < 0.5 * exact


def test_bad_negative_count_is_refused():
    labels, mask = _labels()
    with pytest.raises(ValueError, match="num_negatives"):
        sample_vocabulary(labels, mask, V, 0, torch.Generator())
