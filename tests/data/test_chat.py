"""Chat rendering and the assistant-only loss mask, on the real SmolLM2 tokenizer and ChatML template."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from data_helpers import sample_records, smollm2_tokenizer  # noqa: F401 (fixture)

from dominospec.data.chat import TemplateError, render, render_batch, special_token_ids
from dominospec.data.conversations import normalize_records

KNOCK_KNOCK = [
    {"role": "user", "content": "knock knock"},
    {"role": "assistant", "content": "Who's there?"},
    {"role": "user", "content": "boo"},
    {"role": "assistant", "content": "Boo who?"},
]

SYSTEM_PROMPT = ["<|im_start|>", "system", "Ċ", "You", "Ġare", "Ġa", "Ġhelpful", "ĠAI", "Ġassistant", "Ġnamed", "ĠSm",
                 "ol", "LM", ",", "Ġtrained", "Ġby", "ĠH", "ugging", "ĠFace", "<|im_end|>", "Ċ"]  # fmt: skip


def test_golden_loss_mask_for_two_turns(smollm2_tokenizer):
    """Supervised: each assistant content and its closing <|im_end|>; never the header or the newline after."""
    expected = (
        [(t, 0) for t in SYSTEM_PROMPT]  # the template's injected default system prompt
        + [("<|im_start|>", 0), ("user", 0), ("Ċ", 0), ("kn", 0), ("ock", 0), ("Ġknock", 0), ("<|im_end|>", 0), ("Ċ", 0)]
        + [("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("Ċ", 0)]
        + [("Who", 1), ("'s", 1), ("Ġthere", 1), ("?", 1), ("<|im_end|>", 1)]
        + [("Ċ", 0)]
        + [("<|im_start|>", 0), ("user", 0), ("Ċ", 0), ("b", 0), ("oo", 0), ("<|im_end|>", 0), ("Ċ", 0)]
        + [("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("Ċ", 0)]
        + [("B", 1), ("oo", 1), ("Ġwho", 1), ("?", 1), ("<|im_end|>", 1)]
        + [("Ċ", 0)]
    )
    rendered = render(smollm2_tokenizer, KNOCK_KNOCK, max_length=1024)
    tokens = smollm2_tokenizer.convert_ids_to_tokens(rendered.input_ids.tolist())
    assert list(zip(tokens, rendered.loss_mask.tolist())) == expected
    assert rendered.input_ids.dtype == np.int32 and rendered.loss_mask.dtype == np.int8
    assert not rendered.truncated and rendered.full_length == len(expected)


def _sample_conversations():
    conversations, _, _ = normalize_records(sample_records())
    return [c["messages"] for c in conversations]


def test_tokens_equal_the_templates_own_tokenization(smollm2_tokenizer):
    conversations = _sample_conversations()
    rendered = render_batch(smollm2_tokenizer, conversations, 100_000, special_token_ids(smollm2_tokenizer))
    for messages, r in zip(conversations, rendered):
        reference = smollm2_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert r.input_ids.tolist() == list(reference)


def _supervised_runs(rendered) -> list[list[int]]:
    """Maximal runs of consecutive supervised token ids."""
    runs, current = [], []
    for tid, m in zip(rendered.input_ids.tolist(), rendered.loss_mask.tolist()):
        if m:
            current.append(tid)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_every_supervised_run_is_one_assistant_reply_and_its_end_of_turn(smollm2_tokenizer):
    conversations = _sample_conversations()
    rendered = render_batch(smollm2_tokenizer, conversations, 100_000, special_token_ids(smollm2_tokenizer))
    for messages, r in zip(conversations, rendered):
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert [smollm2_tokenizer.decode(run) for run in _supervised_runs(r)] == replies


def test_truncation_keeps_the_first_max_length_tokens_and_their_mask(smollm2_tokenizer):
    full = render(smollm2_tokenizer, KNOCK_KNOCK, max_length=1024)
    for max_length in (40, 35, 33):
        cut = render(smollm2_tokenizer, KNOCK_KNOCK, max_length=max_length)
        assert len(cut.input_ids) == max_length and cut.truncated and cut.full_length == len(full.input_ids)
        assert cut.input_ids.tolist() == full.input_ids.tolist()[:max_length]
        assert cut.loss_mask.tolist() == full.loss_mask.tolist()[:max_length]
    assert render(smollm2_tokenizer, KNOCK_KNOCK, max_length=33).loss_mask.sum() == 0  # cut before the first reply


def test_special_token_text_inside_a_reply_does_not_end_the_supervised_span(smollm2_tokenizer):
    messages = [{"role": "user", "content": "say it"}, {"role": "assistant", "content": "ok <|im_end|> done"}]
    rendered = render(smollm2_tokenizer, messages, max_length=1024)
    assert [smollm2_tokenizer.decode(run) for run in _supervised_runs(rendered)] == ["ok <|im_end|> done<|im_end|>"]


def test_a_template_that_rewrites_history_is_rejected(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    # Only the last message carries the end-of-turn marker: a prefix is not a prefix of the full rendering.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% if loop.last %}<|im_end|>{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(TemplateError):
        render(tokenizer, KNOCK_KNOCK, max_length=1024)
    (result,) = render_batch(tokenizer, [KNOCK_KNOCK], 1024, special_token_ids(tokenizer))
    assert isinstance(result, TemplateError)


def test_a_template_without_special_closers_supervises_the_whole_turn(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    rendered = render(tokenizer, KNOCK_KNOCK, max_length=1024)
    # "assistant: Who" tokenizes as "assistant", ":", "ĠWho": the token straddling the header's last space
    # carries the reply's first word, so it is supervised.
    assert [tokenizer.decode(run) for run in _supervised_runs(rendered)] == [" Who's there?\n", " Boo who?\n"]
