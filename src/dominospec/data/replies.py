"""The target answering conversations itself: every assistant turn replaced by the target's own reply.

`rewrite_conversations(target, conversations, cfg, max_length)` walks a batch of conversations
turn by turn. At each step every conversation still going contributes its history so far
(already rewritten assistant turns included, the next user/system messages appended) as one
prompt; the prompts are left-padded into one batch and the target generates the replies. A
conversation stops when it has no assistant turn left, or when its prompt has reached
`max_length` tokens (anything later would be cut off by truncation anyway); it then ends with
its last rewritten assistant turn.

Greedy when `temperature == 0`, else sampled with temperature / top_p from the global torch RNG,
which the caller seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import GenerationConfig

from dominospec.config import RegenerateParams
from dominospec.data.chat import render_text
from dominospec.data.conversations import ASSISTANT
from dominospec.target import Target


@dataclass
class Rewritten:
    """One conversation after rewriting: the new messages and what the target produced for them."""

    messages: list[dict[str, str]] = field(default_factory=list)  # ends with an assistant turn (or is empty)
    assistant_turns: int = 0
    generated_tokens: int = 0  # reply tokens, the stop token included where the target emitted it


def rewrite_conversations(
    target: Target, conversations: Sequence[Sequence[dict[str, str]]], cfg: RegenerateParams, max_length: int
) -> list[Rewritten]:
    """Conversations (normalised messages) -> the same conversations with the target's own assistant replies."""
    tokenizer = target.tokenizer
    results = [Rewritten() for _ in conversations]
    cursor = [0] * len(conversations)  # index of the next unread source message
    active = list(range(len(conversations)))
    while active:
        prompts, budgets, still = [], [], []
        for i in active:
            source, history = conversations[i], results[i].messages
            while cursor[i] < len(source) and source[cursor[i]]["role"] != ASSISTANT:
                history.append(dict(source[cursor[i]]))
                cursor[i] += 1
            if cursor[i] == len(source):
                continue  # no assistant turn left
            prompt = tokenizer(render_text(tokenizer, history, add_generation_prompt=True), add_special_tokens=False)
            budget = min(cfg.max_new_tokens, max_length - len(prompt["input_ids"]))
            if budget <= 0:
                continue  # the rendering has reached max_length
            prompts.append(prompt["input_ids"])
            budgets.append(budget)
            still.append(i)
        for i, (reply, n_tokens) in zip(still, generate_replies(target, prompts, budgets, cfg)):
            results[i].messages.append({"role": ASSISTANT, "content": reply})
            results[i].assistant_turns += 1
            results[i].generated_tokens += n_tokens
            cursor[i] += 1  # past the source's assistant turn
        active = still
    for r in results:  # drop the unanswered messages after the last reply
        while r.messages and r.messages[-1]["role"] != ASSISTANT:
            r.messages.pop()
    return results


def generate_replies(
    target: Target, prompts: list[list[int]], budgets: list[int], cfg: RegenerateParams
) -> list[tuple[str, int]]:
    """Prompt token ids + per-prompt token budgets -> [(reply text, tokens generated)], one batched generate."""
    if not prompts:
        return []
    tokenizer, stop_ids = target.tokenizer, stop_token_ids(target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, T] left-padded
    attention_mask = torch.zeros_like(input_ids)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p) :] = torch.tensor(p)
        attention_mask[row, width - len(p) :] = 1
    sampling = cfg.temperature > 0
    sampling_knobs = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)  # top_k 0: no implicit top-k 50
    generation = GenerationConfig(
        max_new_tokens=max(budgets),
        do_sample=sampling,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        **(sampling_knobs if sampling else {}),
    )
    with torch.inference_mode():
        out = target.model.generate(
            input_ids=input_ids.to(target.device),
            attention_mask=attention_mask.to(target.device),
            generation_config=generation,
        )
    replies = []
    for row, budget in enumerate(budgets):
        new = out[row, width:].tolist()[:budget]  # [<= budget] this row's reply, padding after its stop
        stop = next((t for t, tok in enumerate(new) if tok in stop_ids), None)
        content = new if stop is None else new[:stop]
        n_tokens = len(new) if stop is None else stop + 1
        replies.append((tokenizer.decode(content, skip_special_tokens=True), n_tokens))
    return replies


def stop_token_ids(target: Target) -> list[int]:
    """Ids that end a reply: the tokenizer's EOS (the end-of-turn token) and the model's generation EOS ids."""
    ids: list[int] = []
    config_eos: Any = getattr(target.model.generation_config, "eos_token_id", None)
    for tid in [target.tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, list) else [config_eos])]:
        if tid is not None and tid not in ids:
            ids.append(int(tid))
    if not ids:
        raise ValueError("the target has no EOS token: replies could never stop")
    return ids
