"""`StepBatchSampler`: batches are a function of the step (resume, ranks), and grouped by length on request."""

import random

import pytest
import torch

from dominospec.train.datamodule import GROUP_BATCHES, StepBatchSampler, collate


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(10, 1000) for _ in range(n)]


def _padding(batches: list[list[int]], lengths: list[int]) -> float:
    """Padded rows / real rows over the batches (1 = no padding)."""
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return padded / sum(lengths[i] for b in batches for i in b)


@pytest.mark.parametrize("grouped", [False, True])
def test_a_resumed_sampler_yields_what_the_uninterrupted_one_would(grouped):
    n, bs, total = 1000, 8, 400  # 125 batches an epoch: the run crosses three epochs
    lengths = _lengths(n) if grouped else None
    whole = list(StepBatchSampler(n, bs, seed=5, start_step=0, total_steps=total, lengths=lengths))
    resumed = list(StepBatchSampler(n, bs, seed=5, start_step=237, total_steps=total, lengths=lengths))
    assert len(whole) == total and resumed == whole[237:]
    assert all(len(b) == bs for b in whole)
    other_seed = list(StepBatchSampler(n, bs, seed=6, start_step=0, total_steps=total, lengths=lengths))
    assert other_seed != whole


def test_the_ungrouped_stream_is_the_seeded_permutations_in_order():
    n, bs = 50, 8
    batches = list(StepBatchSampler(n, bs, seed=3, start_step=0, total_steps=12))
    stream = [i for b in batches for i in b]
    perm0 = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
    perm1 = torch.randperm(n, generator=torch.Generator().manual_seed(4)).tolist()
    assert stream == (perm0 + perm1)[: len(stream)]


def test_grouped_epochs_cover_every_item_once_and_cut_the_padding():
    n, bs = 4096, 32
    lengths = _lengths(n, seed=1)
    per_epoch = n // bs
    grouped = list(StepBatchSampler(n, bs, seed=0, start_step=0, total_steps=per_epoch, lengths=lengths))
    flat = [i for b in grouped for i in b]
    assert sorted(flat) == list(range(n))  # one epoch: each item exactly once
    plain = list(StepBatchSampler(n, bs, seed=0, start_step=0, total_steps=per_epoch))
    assert _padding(plain, lengths) > 1.5  # uniform lengths 10..1000 in random batches of 32
    assert _padding(grouped, lengths) < 1.05
    # Batches are shuffled across the epoch, not in length order.
    longest = [max(lengths[i] for i in b) for b in grouped]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)
    # Each group of GROUP_BATCHES batches holds a slice of the epoch's permutation.
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    first_group = set(perm[: bs * GROUP_BATCHES])
    assert sum(set(b) <= first_group for b in grouped) == min(GROUP_BATCHES, per_epoch)


def test_ranks_take_disjoint_strides_of_one_grouped_batch():
    n, bs, world = 2000, 4, 2
    lengths = _lengths(n, seed=2)
    ranks = [list(StepBatchSampler(n, bs, seed=1, start_step=0, total_steps=50, rank=r, world_size=world,
                                   lengths=lengths)) for r in range(world)]
    for a, b in zip(*ranks):
        assert len(a) == len(b) == bs and not set(a) & set(b)
        both = sorted(lengths[i] for i in a + b)
        assert both[-1] - both[0] < 200  # one length group: similar lengths on every rank


def test_fewer_items_than_a_batch_fall_back_to_the_stream():
    batches = list(StepBatchSampler(5, 8, seed=0, start_step=0, total_steps=3, lengths=[3, 1, 4, 1, 5]))
    assert all(len(b) == 8 for b in batches) and set(i for b in batches for i in b) == set(range(5))


def test_collate_pads_to_the_longest_item():
    items = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.bool)} for n in (3, 5)]
    batch = collate(items)
    assert batch["input_ids"].shape == (2, 5) and batch["lengths"].tolist() == [3, 5]
    assert not batch["loss_mask"][0, 3:].any()
