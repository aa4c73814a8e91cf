"""Chat-template rendering with the assistant-only loss mask, for any template.

The mask marks the tokens the target itself produces when it answers: the content of every
assistant message and the special token that closes its turn (SmolLM2: `<|im_end|>`, the
end-of-turn token generation stops on). System and user turns, the assistant header
(`<|im_start|>assistant\\n`), a thinking template's empty think block (Qwen3:
`<think>\\n\\n</think>\\n\\n`) and template glue after the closing token (`\\n`) stay 0.

How, without knowing the template: render the whole conversation once; the tokens are always
that rendering's (what the target sees at inference). For assistant message k, its *prompts* are
`messages[:k]` rendered with the generation prompt, and, when the template has a thinking switch
(`enable_thinking`), also with thinking off (Qwen3: the same plus the empty think block). Its
*reply* is `messages[:k+1]` rendered (turn k as the last turn) less the longest of its prompts
that prefixes it. In the whole rendering turn k starts after the longest of its prompts that
prefixes it, and the reply must follow there (checked: `TemplateError`, with a reason). So a
template may render a turn differently while it is the last one (Qwen3 adds the empty think
block), as long as what the target says is the same text. The whole rendering is tokenized once
with character offsets; a token belongs to turn k when it overlaps the reply's span (so a token
merging the header's last space with the reply's first word counts as the reply's), and the
turn's supervised tokens run from its first token to its last special token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dominospec.data.conversations import ASSISTANT
from dominospec.errors import UserError

Messages = Sequence[dict[str, str]]


class TemplateError(ValueError):
    """The chat template renders a conversation inconsistently with its own prefixes; `reason` names how
    (a key of prepare's `skipped`)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


THINKING_OFF = {"enable_thinking": False}  # the switch of Qwen3-style templates; ignored by the others


@dataclass
class Rendered:
    """One conversation as training data; `input_ids` and `loss_mask` are already cut to max_length."""

    input_ids: np.ndarray  # [T] int32, T <= max_length
    loss_mask: np.ndarray  # [T] int8, 1 on supervised (assistant) tokens
    full_length: int  # tokens before truncation
    token_ids_seen: np.ndarray  # [U] the distinct ids of the full (untruncated) rendering

    @property
    def truncated(self) -> bool:
        return self.full_length > len(self.input_ids)


def render_text(tokenizer: Any, messages: Messages, add_generation_prompt: bool = False, **switches: Any) -> str:
    """messages -> the chat template's text (no tokenization); `switches` are template variables (THINKING_OFF)."""
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **switches
    )


def assistant_spans(tokenizer: Any, messages: Messages) -> tuple[str, list[tuple[int, int]]]:
    """messages -> (full rendering, [(start, end) character span of each assistant reply in it, header excluded]).

    Raises TemplateError with a reason: `template_rewrites_prompt` when no prompt of turn k prefixes the full
    rendering or `messages[:k+1]`'s (the target would be prompted with other text than the row shows);
    `template_rewrites_reply` when turn k, rendered as the last turn, is not in the full rendering after its
    prompt (e.g. Qwen3 drops an answered turn's reasoning).
    """
    full = render_text(tokenizer, messages)
    # A template that never reads the switch renders the same text with it (Jinja): skip the second render.
    thinking = THINKING_OFF if any(k in str(tokenizer.chat_template) for k in THINKING_OFF) else None
    spans: list[tuple[int, int]] = []
    for k, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        prompts = [render_text(tokenizer, messages[:k], add_generation_prompt=True)]
        if thinking:
            prompts.append(render_text(tokenizer, messages[:k], add_generation_prompt=True, **thinking))
        prompts = sorted(set(prompts), key=len, reverse=True)  # longest first
        turn = render_text(tokenizer, messages[: k + 1])
        head = next((p for p in prompts if turn.startswith(p)), None)  # turn k's prompt, as last turn
        prompt = next((p for p in prompts if full.startswith(p)), None)  # turn k's prompt, in the conversation
        if head is None or prompt is None:  # e.g. Qwen3 right after an assistant message (its think block moves)
            raise TemplateError("template_rewrites_prompt", f"no prompt of assistant message {k} prefixes its rendering")
        reply, start = turn[len(head) :], len(prompt)
        # Invariant: prompt ⊑ full, the reply follows it there, and the replies are non-empty and in order.
        if not reply or not full.startswith(reply, start) or (spans and start < spans[-1][1]):
            raise TemplateError("template_rewrites_reply", f"assistant message {k} differs from its last-turn rendering")
        spans.append((start, start + len(reply)))
    return full, spans


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of every special token (the ones a turn can be closed with)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special)
    return ids


def render_batch(
    tokenizer: Any, conversations: Sequence[Messages], max_length: int, special_ids: set[int]
) -> list[Rendered | TemplateError]:
    """Conversations -> one Rendered each (or the TemplateError that prevented it), tokenized in one batch."""
    texts, all_spans, results = [], [], []
    for messages in conversations:
        try:
            text, spans = assistant_spans(tokenizer, messages)
        except TemplateError as err:
            results.append(err)
            continue
        results.append(None)
        texts.append(text)
        all_spans.append(spans)
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else None
    j = 0
    for i, slot in enumerate(results):
        if slot is not None:
            continue
        ids, offsets = encoded["input_ids"][j], encoded["offset_mapping"][j]
        results[i] = _to_rendered(ids, offsets, all_spans[j], max_length, special_ids)
        j += 1
    return results


def render(tokenizer: Any, messages: Messages, max_length: int) -> Rendered:
    """One conversation -> Rendered; raises TemplateError."""
    (result,) = render_batch(tokenizer, [messages], max_length, special_token_ids(tokenizer))
    if isinstance(result, TemplateError):
        raise result
    return result


def _to_rendered(
    ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]], max_length: int, special_ids: set[int]
) -> Rendered:
    starts = [a for a, _ in offsets]  # [T] character offsets, non-decreasing
    ends = [b for _, b in offsets]
    mask = np.zeros(len(ids), dtype=np.int8)  # [T]
    for start, end in spans:
        # turn tokens [first, stop): those ending after the span starts and starting before it ends
        first, stop = bisect.bisect_right(ends, start), bisect.bisect_left(starts, end)
        closing = [t for t in range(first, stop) if ids[t] in special_ids]
        last = closing[-1] if closing else stop - 1  # no special closer: the whole turn is supervised
        mask[first : last + 1] = 1
    full = np.asarray(ids, dtype=np.int32)
    return Rendered(
        input_ids=full[:max_length],
        loss_mask=mask[:max_length],
        full_length=len(ids),
        token_ids_seen=np.unique(full),
    )


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Chat messages -> token ids of the chat template's rendering with the generation prompt: what
    evaluate, `generate` and the built-in server feed the target."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the target's tokenizer has no chat template: prompts cannot be rendered as chat")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
