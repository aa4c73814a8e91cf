"""Chat-template rendering with the assistant-only loss mask, for any template.

The mask marks the tokens the target itself produces when it answers: the content of every
assistant message and the special token that closes its turn (SmolLM2: `<|im_end|>`, the
end-of-turn token generation stops on). System and user turns, the generation prompt (the
assistant header `<|im_start|>assistant\\n`, and with Qwen3's `enable_thinking: false` the empty
think block `<think>\\n\\n</think>\\n\\n` after it) and template glue after the closing token (`\\n`)
stay 0.

Every rendering passes `chat_template_kwargs` (params `target.chat_template_kwargs`) to the
template: the prompt the target answers here is the one users run it with. A template that never
reads a variable renders the same text with it (SmolLM2).

How, without knowing the template: render the whole conversation once; the tokens are always
that rendering's (what the target sees at inference). For assistant message k, its *served
prompt* is `messages[:k]` rendered with the generation prompt, its *plain prompt* the same without
the kwargs, and its *reply* is `messages[:k+1]` rendered (turn k as the last turn) less the longest
of the two that prefixes it (Qwen3, thinking off: the served one; a reply that carries its own
`<think>` reasoning follows the plain one, as the target writes it with thinking on). In the whole
rendering turn k starts after the longest of the two that prefixes it, and the reply must follow
there (checked: `TemplateError`, with a reason). The plain prompt is how Qwen3 renders an answered
turn: its header without the think block, which the template keeps for the turns after the last
user message only. So an answered reply's row context lacks the served prompt's empty think block
(4 tokens); its text and every earlier token are what users' later prompts hold. The whole rendering is
tokenized once with character offsets; a token belongs to turn k when it overlaps the reply's
span (so a token merging the header's last space with the reply's first word counts as the
reply's), and the turn's supervised tokens run from its first token to its last special token.
"""

from __future__ import annotations

import bisect
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from dominospec.data.conversations import ASSISTANT
from dominospec.errors import UserError

Messages = Sequence[dict[str, str]]
TemplateKwargs = Mapping[str, Any]  # params `target.chat_template_kwargs`


class TemplateKwargsError(UserError):
    """A chat_template_kwargs key that is an argument of `apply_chat_template`, not a template variable."""


class TemplateError(ValueError):
    """The chat template renders a conversation inconsistently with its own prefixes; `reason` names how
    (a key of prepare's `skipped`)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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


def render_text(tokenizer: Any, messages: Messages, add_generation_prompt: bool,
                chat_template_kwargs: TemplateKwargs) -> str:
    """messages -> the chat template's text (no tokenization); `chat_template_kwargs` are template variables
    (TemplateKwargsError for one that is an argument of `apply_chat_template`: `tokenize`, `chat_template`, ...)."""
    clash = sorted(_arguments(type(tokenizer)).intersection(chat_template_kwargs))
    if clash:
        raise TemplateKwargsError(f"chat_template_kwargs: {', '.join(map(repr, clash))} set what `apply_chat_template` "
                                  "does, not a variable of the chat template")
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **chat_template_kwargs
    )


def assistant_spans(
    tokenizer: Any, messages: Messages, chat_template_kwargs: TemplateKwargs
) -> tuple[str, list[tuple[int, int]]]:
    """messages + template variables -> (full rendering, [(start, end) character span of each assistant reply in it,
    header excluded]).

    Raises TemplateError with a reason: `template_rewrites_prompt` when neither turn k's served nor its plain
    prompt prefixes the full rendering or `messages[:k+1]`'s (the target would be prompted with other text than the
    row shows); `template_rewrites_reply` when turn k, rendered as the last turn, is not in the full rendering after
    its prompt (e.g. Qwen3 drops an answered turn's reasoning, and with thinking on its empty think block).
    """
    full = render_text(tokenizer, messages, False, chat_template_kwargs)
    spans: list[tuple[int, int]] = []
    for k, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        served = render_text(tokenizer, messages[:k], True, chat_template_kwargs)
        plain = render_text(tokenizer, messages[:k], True, {}) if chat_template_kwargs else served
        turn = render_text(tokenizer, messages[: k + 1], False, chat_template_kwargs)
        prompts = sorted({served, plain}, key=len, reverse=True)  # longest first
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


@functools.cache
def _arguments(tokenizer_class: type) -> frozenset[str]:
    """The names `apply_chat_template` takes itself (and `messages`, the template's own): never template variables."""
    named = inspect.signature(tokenizer_class.apply_chat_template).parameters.values()
    return frozenset(p.name for p in named if p.kind is not p.VAR_KEYWORD) | {"messages", "conversations"}


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of every special token (the ones a turn can be closed with)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special)
    return ids


def render_batch(
    tokenizer: Any, conversations: Sequence[Messages], max_length: int, special_ids: set[int],
    chat_template_kwargs: TemplateKwargs,
) -> list[Rendered | TemplateError]:  # fmt: skip
    """Conversations -> one Rendered each (or the TemplateError that prevented it), tokenized in one batch."""
    texts, all_spans, results = [], [], []
    for messages in conversations:
        try:
            text, spans = assistant_spans(tokenizer, messages, chat_template_kwargs)
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


def render(tokenizer: Any, messages: Messages, max_length: int, chat_template_kwargs: TemplateKwargs) -> Rendered:
    """One conversation -> Rendered; raises TemplateError."""
    (result,) = render_batch(tokenizer, [messages], max_length, special_token_ids(tokenizer), chat_template_kwargs)
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


def render_prompt(tokenizer: Any, messages: Messages, chat_template_kwargs: TemplateKwargs) -> list[int]:
    """Chat messages + template variables -> token ids of the chat template's rendering with the generation
    prompt: what evaluate, `generate` and the built-in server feed the target."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the target's tokenizer has no chat template: prompts cannot be rendered as chat")
    text = render_text(tokenizer, messages, True, chat_template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
