"""Sampled softmax for the training loss (`train.loss_vocab: sampled`).

On a CPU the 49,152-way softmax of the LM head is most of a training step
(docs/journal/2026-12-01-a-cheaper-cpu-training-step.md). A fixed loss vocabulary
(`loss_vocab: data`) makes the step cheap but never pushes the other tokens' logits down, so the draft's argmax over the full vocabulary
drifts onto them. Here each step's softmax spans a fresh vocabulary instead:

    positives P   every label the step supervises (exact terms of the partition sum)
    negatives S   m tokens drawn uniformly without replacement from the other V - |P|

and the negatives' logits are shifted by log((V - |P|) / m), so that

    Z_hat = sum_{i in P} exp(l_i) + (V - |P|) / m * sum_{i in S} exp(l_i)

is an unbiased estimate of the full partition sum Z. Every token is a negative now and then,
so none escapes the push-down. With m >= V - |P| the set is the whole vocabulary, the shift is
log 1 = 0, and the loss is the full-vocabulary loss exactly. Validation always uses the full
vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampledVocab:
    """One step's softmax vocabulary.

    ids [V'] sorted token ids (positives and negatives), offset [V'] fp32 (0 on positives,
    log((V - |P|) / m) on negatives), num_positives |P|.
    """

    ids: torch.Tensor
    offset: torch.Tensor
    num_positives: int

    def columns(self, labels: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> their columns in `ids` [...]. Exact for every supervised label (the
        positives); an unsupervised one maps to some column, which its mask then ignores."""
        return torch.searchsorted(self.ids, labels.reshape(-1)).clamp(max=self.ids.numel() - 1).view(labels.shape)

    def shift(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over `ids` [..., V'] -> the same logits with the negatives' log-correction, fp32."""
        return logits.float() + self.offset


def sample_vocabulary(labels: torch.Tensor, label_mask: torch.Tensor, vocab_size: int, num_negatives: int,
                      generator: torch.Generator) -> SampledVocab:
    """labels / label_mask [...] (this step's), V, m, a CPU generator -> the step's `SampledVocab`.

    The draw depends only on the generator and the positives, so a resumed run that seeds the
    generator by step draws the same vocabulary again."""
    if num_negatives < 1:
        raise ValueError(f"num_negatives must be >= 1, got {num_negatives}")
    device = labels.device
    positives = labels[label_mask.bool()].unique().cpu()  # [P] sorted
    is_positive = torch.zeros(vocab_size, dtype=torch.bool)
    is_positive[positives] = True
    order = torch.randperm(vocab_size, generator=generator)
    negatives = order[~is_positive[order]][:num_negatives]  # [m'], m' = min(m, V - |P|)
    rest = vocab_size - positives.numel()
    shift = math.log(rest / negatives.numel()) if negatives.numel() else 0.0
    ids = torch.cat([positives, negatives])
    offset = torch.cat([torch.zeros(positives.numel()), torch.full((negatives.numel(),), shift)])
    ids, order = ids.sort()
    return SampledVocab(ids=ids.to(device), offset=offset[order].to(device), num_positives=positives.numel())


__all__ = ["SampledVocab", "sample_vocabulary"]
