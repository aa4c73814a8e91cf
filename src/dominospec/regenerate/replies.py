"""The target answering conversations itself: every assistant turn replaced by the target's own reply.

`rewrite_conversations(target, conversations, cfg, max_length, chat_template_kwargs)` decodes a batch
of conversations together (`decoder.ReplyStream`: continuous batching, one KV slot per conversation). When a reply
is done, its conversation appends its next user/system messages to its history, renders it with
the generation prompt (and `target.chat_template_kwargs`, the form users prompt the target in) and
starts its next reply at once, while the others keep decoding.

Earlier turns are never recomputed: each conversation keeps its KV slot between turns and feeds
only what is new. Its context is the token sequence the target has seen and produced:
the first prompt, each reply's tokens, and the template text between a reply and the next
generation prompt, tokenized on its own (that text starts with the turn-closing special token,
so the split matches the full rendering's tokens). A template that does not render the history
as a prefix of the next prompt makes that conversation start afresh from its full rendering.

A conversation stops when it has no assistant turn left, or when its context has reached
`max_length` tokens (anything later would be cut off by truncation anyway); it then ends with its
last rewritten assistant turn. Greedy when `temperature == 0`, else sampled from `generator`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from dominospec.config import RegenerateParams
from dominospec.data.chat import TemplateKwargs, render_text
from dominospec.data.conversations import ASSISTANT
from dominospec.stops import stop_token_ids
from dominospec.regenerate.decoder import DecodePolicy, Reply, ReplyStream
from dominospec.regenerate.kv_batch import SlotKV, grouped_attention_on
from dominospec.target import Target


@dataclass
class Rewritten:
    """One conversation after rewriting: the new messages and what the target produced for them."""

    messages: list[dict[str, str]] = field(default_factory=list)  # ends with an assistant turn (or is empty)
    assistant_turns: int = 0
    generated_tokens: int = 0  # tokens the target generated, stop tokens and cut loops included
    replies_at_max_new_tokens: int = 0  # replies that hit `max_new_tokens` without a stop token
    replies_at_max_length: int = 0  # replies cut shorter by the room left before `max_length`
    replies_loop_cut: int = 0  # replies cut by the repetition-loop detector


@dataclass
class _Context:
    """What one conversation's slot stands for: the rendered text so far, and reply tokens not yet fed."""

    text: str = ""
    unfed: list[int] = field(default_factory=list)


def rewrite_conversations(
    target: Target, conversations: Sequence[Sequence[dict[str, str]]], cfg: RegenerateParams, max_length: int,
    chat_template_kwargs: TemplateKwargs, generator: Optional[torch.Generator] = None,
    on_tokens: Optional[Callable[[int], None]] = None,
) -> list[Rewritten]:  # fmt: skip
    """Conversations (normalised messages) + template variables -> the same conversations with the target's own
    assistant replies."""
    tokenizer = target.tokenizer
    results = [Rewritten() for _ in conversations]
    contexts = [_Context() for _ in conversations]
    cursor = [0] * len(conversations)  # index of the next unread source message
    budgets = [0] * len(conversations)
    kv = SlotKV(target.num_layers, len(conversations), capacity=64, limit=max_length + 1, device=target.device)
    stream = ReplyStream(target.model, kv, decode_policy(target, cfg), generator, on_tokens)

    def next_turn(i: int) -> None:
        """Start conversation i's next reply, or end it (no assistant turn left, or no room before max_length)."""
        source, history, context = conversations[i], results[i].messages, contexts[i]
        while cursor[i] < len(source) and source[cursor[i]]["role"] != ASSISTANT:
            history.append(dict(source[cursor[i]]))
            cursor[i] += 1
        text = render_text(tokenizer, history, True, chat_template_kwargs) if cursor[i] < len(source) else None
        if text is not None and i in stream.slot_of and not text.startswith(context.text):
            stream.end(i, compact=False)  # a template that rewrites history: start afresh from the full rendering
        if text is not None and i not in stream.slot_of:
            contexts[i] = context = _Context()
        new = [] if text is None else context.unfed + tokenizer(text[len(context.text) :], add_special_tokens=False)["input_ids"]
        room = max_length - stream.context_length(i) - len(new)
        if text is None or room <= 0:
            if i in stream.slot_of:
                stream.end(i)
            return
        context.text, budgets[i] = text, min(cfg.max_new_tokens, room)
        stream.start(i, new, budgets[i])

    with grouped_attention_on(target.model, kv):
        for i in range(len(conversations)):
            next_turn(i)
        while stream.running:
            for i, reply in stream.step():
                content = tokenizer.decode(reply.tokens, skip_special_tokens=True)
                _count(results[i], reply, budgets[i], cfg.max_new_tokens)
                results[i].messages.append({"role": ASSISTANT, "content": content})
                contexts[i] = _Context(text=contexts[i].text + content, unfed=reply.unfed)
                cursor[i] += 1  # past the source's assistant turn
                next_turn(i)
    for r in results:  # drop the unanswered messages after the last reply
        while r.messages and r.messages[-1]["role"] != ASSISTANT:
            r.messages.pop()
    return results


def _count(result: Rewritten, reply: Reply, budget: int, max_new_tokens: int) -> None:
    """Add one reply to its conversation's counts."""
    result.assistant_turns += 1
    result.generated_tokens += reply.generated
    capped = not reply.stopped and not reply.loop_cut and reply.generated >= budget
    result.replies_at_max_new_tokens += capped and budget == max_new_tokens
    result.replies_at_max_length += capped and budget < max_new_tokens
    result.replies_loop_cut += reply.loop_cut


def first_prompt_length(tokenizer: Any, messages: Sequence[dict[str, str]], chat_template_kwargs: TemplateKwargs) -> int:
    """Normalised messages + template variables -> tokens of the first generation prompt (everything before the
    first reply)."""
    first = next((k for k, m in enumerate(messages) if m["role"] == ASSISTANT), len(messages))
    text = render_text(tokenizer, messages[:first], True, chat_template_kwargs)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def decode_policy(target: Target, cfg: RegenerateParams) -> DecodePolicy:
    """Target + regenerate params -> how replies are picked and where they stop."""
    stop_ids = stop_token_ids(target.tokenizer, target.model)
    if not stop_ids:
        raise ValueError("the target has no EOS token: replies could never stop")
    pad_id = target.tokenizer.pad_token_id
    return DecodePolicy(
        stop_ids=tuple(stop_ids),
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        loop_ngram=cfg.loop_ngram or None,
        loop_repeats=cfg.loop_repeats,
        pad_id=stop_ids[0] if pad_id is None else pad_id,
    )
