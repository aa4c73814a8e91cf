"""Tiny targets and drafts for the engine tests, built from configs on CPU (no hub, no files)."""

from __future__ import annotations

import torch

from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig
from dominospec.target import Target, TargetIdentity

EOS = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}t3 {{ m['content'] }} {% if m['role'] == 'assistant' %}t2 {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}t4 {% endif %}"
)


def tiny_tokenizer(vocab: int):
    """Whitespace word-level tokenizer over tokens t0..t{vocab-1}; t1 BOS, t2 EOS, a toy chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", pad_token="t2")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_target(arch: str = "llama", vocab: int = 96, dtype=torch.float32, seed: int = 0, layers: int = 4,
                scale: float = 0.2, max_positions: int = 512, head_dim: int = 8) -> Target:
    """Random tiny causal LM (`llama` tied embeddings | `qwen3` untied) wrapped as a Target; 4 query
    heads of `head_dim` (hidden 32 = 4 x 8 in Llama)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    if arch == "llama":
        config = LlamaConfig(tie_word_embeddings=True, **common)
    else:
        config = Qwen3Config(head_dim=head_dim, tie_word_embeddings=False, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # larger than the default init: peaked, varied next-token distributions
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, scale)
    model.eval().requires_grad_(False)
    identity = TargetIdentity(name=f"tiny-{arch}-{seed}", revision=None, sha256=f"sha-{arch}-{seed}", dtype=str(dtype),
                              num_layers=layers, hidden_size=32, vocab_size=vocab)
    return Target(model=model, tokenizer=tiny_tokenizer(vocab), identity=identity, device=torch.device("cpu"))


def tiny_draft(target: Target, block_size: int = 4, seed: int = 1, head: bool = True, scale: float = 0.3,
               **overrides) -> DFlashDraftModel:
    """Random draft fitted to `target` (its identity recorded), in the target's dtype."""
    V = target.identity.vocab_size
    kwargs = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_theta=10000.0, block_size=block_size,
        num_target_layers=target.num_layers, emb_dim=8, use_domino_head=head, target=target.identity.as_dict(),
        dflash_config=dict(mask_token_id=V - 1, target_layer_ids=[0, target.num_layers - 2], gru_hidden_dim=16, emb_dim=8),
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    draft = DFlashDraftModel(DominoDraftConfig(**kwargs))
    with torch.no_grad():  # a visible head correction, so domino and dflash drafts differ
        for p in draft.parameters():
            if p.ndim == 2:
                p.normal_(0.0, scale)
    return draft.to(target.embed_tokens.weight.dtype).eval().requires_grad_(False)


def chat_ids(target: Target, text: str) -> list[int]:
    """One user turn rendered with the target's chat template, ready for the reply -> its token ids."""
    rendered = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
    return target.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def random_prompts(n: int, vocab: int, seed: int, min_len: int = 2, max_len: int = 12) -> list[list[int]]:
    """n random prompts of token ids in 3..vocab-2 (no BOS/EOS/MASK)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab - 1, (L,), generator=g).tolist() for L in lengths]


def repetitive_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts made of a short random phrase repeated: prompt lookup has something to find."""
    import random

    g = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [g.randrange(3, vocab - 1) for _ in range(g.randrange(2, 6))]
        out.append((phrase * 4)[: g.randrange(6, 20)])
    return out


def stats_equal_to_ar(engine, ar, max_new_tokens: int = 24) -> list:
    """Greedy generations of `engine` on the assisted-lookup prompt set (repeating phrases, then
    random prompts; vocab 8) -> their stats, each checked: the tokens equal `ar`'s, and the draft
    context and target KV hold prompt + answer - 1 rows."""
    out = []
    for prompt in repetitive_prompts(8, 8, seed=3) + random_prompts(12, 8, seed=2):
        generation = engine.generate(prompt, max_new_tokens)
        assert generation.token_ids == ar.generate(prompt, max_new_tokens).token_ids, prompt
        stats = generation.stats
        assert stats.draft_context_length == stats.target_kv_length == len(prompt) + len(generation.token_ids) - 1
        assert stats.round_tokens + 1 == len(generation.token_ids)
        out.append(stats)
    return out


def streaming_cost(k_max: int, step_ms: float = 10.0) -> "RoundCost":
    """A fixed round-cost table of a weight-streaming machine: a verify of up to k_max + 1 rows costs
    one step, the draft forward a fifth of one, a chain step a fiftieth.
    Auto-K's choices then follow the acceptance alone, not the timing of whatever machine runs the test."""
    from dominospec.engine.policy import RoundCost

    return RoundCost(verify=[step_ms] * (k_max + 1), draft=step_ms / 5, rollout_step=step_ms / 50)


def draft_runners_agree(target: Target, draft: DFlashDraftModel, make_runner) -> None:
    """A draft-block runner (`make_runner(mask_embeds)`) against the draft model's own cache
    (DynamicDraftBlock), fp64: z and base logits to 1e-9 through extend, blocks of S = 0..B+5 new
    rows, a crop; lengths kept; a block at the wrong start refused."""
    import pytest

    from dominospec.engine.draft_block import DynamicDraftBlock

    embed, lm_head = target.embed_tokens, target.lm_head
    B, F = draft.config.block_size, draft.fc.weight.shape[1]
    mask = torch.full((B - 1,), int(draft.config.mask_token_id))
    with torch.inference_mode():
        mask_embeds = embed(mask)
        dynamic, runner = DynamicDraftBlock(draft, lm_head, embed, mask_embeds), make_runner(mask_embeds)
        g = torch.Generator().manual_seed(1)
        rows = lambda n: torch.randn(1, n, F, generator=g, dtype=torch.float64)  # noqa: E731
        prompt = rows(12)
        for each in (dynamic, runner):
            each.extend(prompt)
        start = 12
        for S, K, crop_to in [(0, B - 1, None), (3, 4, None), (B, B, None), (B + 5, 2, None), (1, 1, 20)]:
            features = rows(S) if S else None
            x_start = torch.randint(3, 7, (1,), generator=g)
            a_z, a_u = dynamic.block(features, x_start, start + S, K)
            b_z, b_u = runner.block(features, x_start, start + S, K)
            assert b_z.shape == a_z.shape == (K, draft.config.hidden_size)
            torch.testing.assert_close(b_z, a_z, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(b_u, a_u, rtol=1e-9, atol=1e-9)
            assert runner.length == dynamic.length == start + S
            start += S
            if crop_to is not None:
                dynamic.crop(crop_to)
                runner.crop(crop_to)
                start = crop_to
        with pytest.raises(ValueError, match="block starts at"):
            runner.block(None, x_start, start + 1, 1)


def engine_params(**overrides):
    """params.yaml's `engine:` as the plain engine (common.cli.plain_engine: a chain, no pool, no
    lookups, torch ops, dynamic caches) with `overrides` -> config.EngineParams."""
    from pathlib import Path

    from common.cli import plain_engine
    from dominospec.config import load_params

    return plain_engine(load_params(Path(__file__).resolve().parents[2] / "params.yaml").engine, **overrides)


def fit_draft(target: Target, draft: DFlashDraftModel, prompts: list[list[int]], replies: list[list[int]],
              steps: int, lr: float = 3e-3, anchors: int = 24, negatives: int | None = None,
              gamma: float = 2.0, seed: int = 0) -> DFlashDraftModel:
    """`draft` trained in place for `steps` AdamW steps with the project's objective (dominospec.train.
    objective: anchors re-drawn on the replies every step, position-weighted CE, the base-anchored
    curriculum over the first half; with `negatives` a sampled softmax of that many negatives, as
    train.loss_vocab: sampled) on prompt + reply -> the draft, eval and frozen. It memorises the
    replies (the target's own greedy ones): a cheap draft that the engine accepts deep."""
    import torch.nn.functional as F

    from dominospec.train import objective as O
    from dominospec.train.sampled_vocab import sample_vocabulary

    config, mask_id = draft.config, int(draft.config.mask_token_id)
    sequences = [torch.tensor(p + r) for p, r in zip(prompts, replies)]
    T = max(len(s) for s in sequences)
    ids = torch.stack([F.pad(s, (0, T - len(s)), value=mask_id) for s in sequences])  # [B, T]
    supervised = torch.zeros_like(ids, dtype=torch.bool)  # the replies' positions: labels x[a+1..] lie in them
    for b, (p, r) in enumerate(zip(prompts, replies)):
        supervised[b, len(p) - 1: len(p) + len(r)] = True
    with torch.no_grad():  # not inference mode: the features enter autograd's graph
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i + 1] for i in config.target_layer_ids], dim=-1)  # [B, T, n*H]
    embed, head = target.embed_tokens, target.lm_head.weight  # [V, H]
    draft.requires_grad_(True).train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    weights = O.position_weights(config.block_size, gamma)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        blocks = O.make_blocks(ids, supervised, anchors, config.block_size, mask_id, g)
        labels = blocks.labels
        if negatives is None:
            base, final = O.draft_block_logits(draft, embed, lambda z: F.linear(z, head), features, blocks)
        else:
            sampled = sample_vocabulary(labels, blocks.label_mask, head.shape[0], negatives, g)
            rows = head.index_select(0, sampled.ids)  # [V', H]
            base, final = O.draft_block_logits(draft, embed, lambda z: F.linear(z, rows), features, blocks,
                                               vocab_ids=sampled.ids)
            base, final, labels = sampled.shift(base), sampled.shift(final), sampled.columns(labels)
        loss, _, _ = O.domino_loss(base, final, labels, blocks.label_mask, weights,
                                   O.curriculum_lambda(step, steps, 0.5))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval().requires_grad_(False)
