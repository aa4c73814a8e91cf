"""Chat rendering and the assistant-only loss mask, on the real SmolLM2 tokenizer and ChatML template, and on
Qwen3's real tokenizer and template (which renders the last assistant turn with an empty think block)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from data_helpers import qwen3_tokenizer, qwen3_tokenizer_dir, sample_records, smollm2_tokenizer  # noqa: F401
from data_helpers import supervised_runs

from dominospec.data.chat import (
    TemplateError, TemplateKwargsError, render, render_batch, render_prompt, special_token_ids,
)
from dominospec.data.conversations import normalize_records

KNOCK_KNOCK = [
    {"role": "user", "content": "knock knock"},
    {"role": "assistant", "content": "Who's there?"},
    {"role": "user", "content": "boo"},
    {"role": "assistant", "content": "Boo who?"},
]

THINKING_OFF = {"enable_thinking": False}  # params/qwen3-8b.yaml's target.chat_template_kwargs

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
    rendered = render(smollm2_tokenizer, KNOCK_KNOCK, max_length=1024, chat_template_kwargs={})
    tokens = smollm2_tokenizer.convert_ids_to_tokens(rendered.input_ids.tolist())
    assert list(zip(tokens, rendered.loss_mask.tolist())) == expected
    assert rendered.input_ids.dtype == np.int32 and rendered.loss_mask.dtype == np.int8
    assert not rendered.truncated and rendered.full_length == len(expected)


def _sample_conversations():
    conversations, _, _ = normalize_records(sample_records())
    return [c["messages"] for c in conversations]


def test_tokens_equal_the_templates_own_tokenization(smollm2_tokenizer):
    conversations = _sample_conversations()
    rendered = render_batch(smollm2_tokenizer, conversations, 100_000, special_token_ids(smollm2_tokenizer), {})
    for messages, r in zip(conversations, rendered):
        reference = smollm2_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert r.input_ids.tolist() == list(reference)


def _supervised_runs(rendered) -> list[list[int]]:
    return supervised_runs(rendered.input_ids, rendered.loss_mask)


def test_every_supervised_run_is_one_assistant_reply_and_its_end_of_turn(smollm2_tokenizer):
    conversations = _sample_conversations()
    rendered = render_batch(smollm2_tokenizer, conversations, 100_000, special_token_ids(smollm2_tokenizer), {})
    for messages, r in zip(conversations, rendered):
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert [smollm2_tokenizer.decode(run) for run in _supervised_runs(r)] == replies


def test_truncation_keeps_the_first_max_length_tokens_and_their_mask(smollm2_tokenizer):
    full = render(smollm2_tokenizer, KNOCK_KNOCK, max_length=1024, chat_template_kwargs={})
    for max_length in (40, 35, 33):
        cut = render(smollm2_tokenizer, KNOCK_KNOCK, max_length=max_length, chat_template_kwargs={})
        assert len(cut.input_ids) == max_length and cut.truncated and cut.full_length == len(full.input_ids)
        assert cut.input_ids.tolist() == full.input_ids.tolist()[:max_length]
        assert cut.loss_mask.tolist() == full.loss_mask.tolist()[:max_length]
    assert render(smollm2_tokenizer, KNOCK_KNOCK, 33, {}).loss_mask.sum() == 0  # cut before the first reply


def test_special_token_text_inside_a_reply_does_not_end_the_supervised_span(smollm2_tokenizer):
    messages = [{"role": "user", "content": "say it"}, {"role": "assistant", "content": "ok <|im_end|> done"}]
    rendered = render(smollm2_tokenizer, messages, max_length=1024, chat_template_kwargs={})
    assert [smollm2_tokenizer.decode(run) for run in _supervised_runs(rendered)] == ["ok <|im_end|> done<|im_end|>"]


def test_a_template_that_rewrites_history_is_rejected(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    # Only the last message carries the end-of-turn marker: a prefix is not a prefix of the full rendering.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% if loop.last %}<|im_end|>{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(TemplateError):
        render(tokenizer, KNOCK_KNOCK, max_length=1024, chat_template_kwargs={})
    (result,) = render_batch(tokenizer, [KNOCK_KNOCK], 1024, special_token_ids(tokenizer), {})
    assert isinstance(result, TemplateError) and result.reason == "template_rewrites_prompt"  # the user turn moved


def test_a_template_without_special_closers_supervises_the_whole_turn(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    rendered = render(tokenizer, KNOCK_KNOCK, max_length=1024, chat_template_kwargs={})
    # "assistant: Who" tokenizes as "assistant", ":", "ĠWho": the token straddling the header's last space
    # carries the reply's first word, so it is supervised.
    assert [tokenizer.decode(run) for run in _supervised_runs(rendered)] == [" Who's there?\n", " Boo who?\n"]


def test_qwen3_golden_loss_mask_for_two_turns(qwen3_tokenizer):
    """The answered turn has no think block, the last one an empty one: template, not reply, so never supervised."""
    expected = (
        [("<|im_start|>", 0), ("user", 0), ("Ċ", 0), ("kn", 0), ("ock", 0), ("Ġknock", 0), ("<|im_end|>", 0), ("Ċ", 0)]
        + [("<|im_start|>", 0), ("assistant", 0), ("Ċ", 0)]
        + [("Who", 1), ("'s", 1), ("Ġthere", 1), ("?", 1), ("<|im_end|>", 1)]
        + [("Ċ", 0)]
        + [("<|im_start|>", 0), ("user", 0), ("Ċ", 0), ("boo", 0), ("<|im_end|>", 0), ("Ċ", 0)]
        + [("<|im_start|>", 0), ("assistant", 0), ("Ċ", 0), ("<think>", 0), ("ĊĊ", 0), ("</think>", 0), ("ĊĊ", 0)]
        + [("Bo", 1), ("o", 1), ("Ġwho", 1), ("?", 1), ("<|im_end|>", 1)]
        + [("Ċ", 0)]
    )
    rendered = render(qwen3_tokenizer, KNOCK_KNOCK, max_length=1024, chat_template_kwargs=THINKING_OFF)
    tokens = qwen3_tokenizer.convert_ids_to_tokens(rendered.input_ids.tolist())
    assert list(zip(tokens, rendered.loss_mask.tolist())) == expected
    reference = qwen3_tokenizer.apply_chat_template(KNOCK_KNOCK, tokenize=True, return_dict=False)
    assert rendered.input_ids.tolist() == list(reference)


def test_qwen3_keeps_multi_turn_conversations_with_every_reply_supervised(qwen3_tokenizer):
    """The real ShareGPT sample (four conversations of 2 to 4 replies, one with a system prompt): each is kept, its
    tokens are the template's for the whole conversation, and its supervised runs decode to exactly its replies."""
    conversations = _sample_conversations()
    assert sum(sum(m["role"] == "assistant" for m in c) > 1 for c in conversations) == 4
    rendered = render_batch(qwen3_tokenizer, conversations, 100_000, special_token_ids(qwen3_tokenizer), THINKING_OFF)
    for messages, r in zip(conversations, rendered):
        assert not isinstance(r, TemplateError), r
        reference = qwen3_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert r.input_ids.tolist() == list(reference)
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert [qwen3_tokenizer.decode(run) for run in _supervised_runs(r)] == replies


def test_qwen3_reasoning_is_supervised_on_the_last_turn_and_rejected_where_the_template_drops_it(qwen3_tokenizer):
    thought = {"role": "assistant", "content": "<think>\nThey are joking.\n</think>\n\nWho's there?"}
    last = render(qwen3_tokenizer, [KNOCK_KNOCK[0], thought], max_length=1024, chat_template_kwargs=THINKING_OFF)
    # the target writes its reasoning itself: it is the reply's
    assert [qwen3_tokenizer.decode(run) for run in _supervised_runs(last)] == [thought["content"] + "<|im_end|>"]
    with pytest.raises(TemplateError) as err:  # answered, the turn keeps its answer only: not what the target wrote
        render(qwen3_tokenizer, [KNOCK_KNOCK[0], thought, *KNOCK_KNOCK[2:]], 1024, THINKING_OFF)
    assert err.value.reason == "template_rewrites_reply"


def test_qwen3_an_assistant_message_after_an_assistant_message_is_a_named_skip(qwen3_tokenizer):
    """Its prompt (the previous reply as last, with a think block) is not what the conversation shows (without):
    which is why prepare joins a reply that follows a reply to it (conversations.normalize_record)."""
    messages = [*KNOCK_KNOCK[:2], {"role": "assistant", "content": "Anyone?"}]
    (result,) = render_batch(qwen3_tokenizer, [messages], 1024, special_token_ids(qwen3_tokenizer), THINKING_OFF)
    assert isinstance(result, TemplateError) and result.reason == "template_rewrites_prompt"


def test_consecutive_assistant_messages_stay_supervised_under_smollm2(smollm2_tokenizer):
    messages = [*KNOCK_KNOCK[:2], {"role": "assistant", "content": "Anyone?"}]
    rendered = render(smollm2_tokenizer, messages, max_length=1024, chat_template_kwargs={})
    replies = ["Who's there?<|im_end|>", "Anyone?<|im_end|>"]
    assert [smollm2_tokenizer.decode(run) for run in _supervised_runs(rendered)] == replies


def test_smollm2_renders_the_same_rows_and_prompts_whatever_the_template_variables(smollm2_tokenizer):
    """SmolLM2's template never reads `enable_thinking`: the embedded default's data cannot depend on it."""
    conversations = _sample_conversations()
    plain = render_batch(smollm2_tokenizer, conversations, 100_000, special_token_ids(smollm2_tokenizer), {})
    off = render_batch(smollm2_tokenizer, conversations, 100_000, special_token_ids(smollm2_tokenizer), THINKING_OFF)
    for a, b in zip(plain, off):
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    for messages in conversations:
        assert render_prompt(smollm2_tokenizer, messages[:1], {}) == render_prompt(smollm2_tokenizer, messages[:1],
                                                                                   THINKING_OFF)


def test_qwen3_rows_show_each_reply_after_the_prompt_users_send_it(qwen3_tokenizer):
    """Train against serve, on the real ShareGPT sample with thinking off: the last reply of a row follows exactly
    the prompt `render_prompt` gives the target (the empty think block included); an answered reply follows that
    prompt less its think block, as Qwen3 renders the turns before the last user message in every later prompt."""
    think_block = qwen3_tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    conversations = _sample_conversations()
    rendered = render_batch(qwen3_tokenizer, conversations, 100_000, special_token_ids(qwen3_tokenizer), THINKING_OFF)
    answered = 0
    for messages, r in zip(conversations, rendered):
        replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        starts = [i for i in range(len(r.loss_mask)) if r.loss_mask[i] and (i == 0 or not r.loss_mask[i - 1])]
        assert len(starts) == len(replies)
        for k, start in zip(replies, starts):
            served = render_prompt(qwen3_tokenizer, messages[:k], THINKING_OFF)
            assert served[-len(think_block) :] == think_block
            row_context = r.input_ids[:start].tolist()
            if k == replies[-1]:
                assert row_context == served
            else:
                assert row_context == served[: -len(think_block)]
                answered += 1
    assert answered >= 4


def test_qwen3_with_thinking_on_supervises_the_think_block_and_skips_answered_turns(qwen3_tokenizer):
    """Thinking on (no variable), the prompt ends at the header: the target writes the think block, so a last
    turn's is the reply's; an answered turn shows no think block, which is not what the target wrote."""
    single = render(qwen3_tokenizer, KNOCK_KNOCK[:2], max_length=1024, chat_template_kwargs={})
    runs = [qwen3_tokenizer.decode(run) for run in _supervised_runs(single)]
    assert runs == ["<think>\n\n</think>\n\nWho's there?<|im_end|>"]
    assert render_prompt(qwen3_tokenizer, KNOCK_KNOCK[:1], {})[-3:] == qwen3_tokenizer(
        "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    (result,) = render_batch(qwen3_tokenizer, [KNOCK_KNOCK], 1024, special_token_ids(qwen3_tokenizer), {})
    assert isinstance(result, TemplateError) and result.reason == "template_rewrites_reply"


def test_template_variables_that_are_arguments_of_apply_chat_template_are_refused(qwen3_tokenizer):
    for bad in ({"tokenize": True}, {"chat_template": "{{ 'x' }}"}, {"messages": []}):
        with pytest.raises(TemplateKwargsError, match=repr(next(iter(bad)))):
            render_prompt(qwen3_tokenizer, KNOCK_KNOCK[:1], bad)
        with pytest.raises(TemplateKwargsError):
            render(qwen3_tokenizer, KNOCK_KNOCK, 1024, bad)
