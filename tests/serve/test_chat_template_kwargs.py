"""A chat request's `chat_template_kwargs` (SGLang's and vLLM's extension) over the served ones
(`target.chat_template_kwargs`), on Qwen3's real tokenizer and template, without a server."""

from __future__ import annotations

import json

import pytest
from data_helpers import qwen3_tokenizer, qwen3_tokenizer_dir  # noqa: F401

from dominospec.serve.app import render_chat
from dominospec.serve.errors import ApiError
from dominospec.serve.requests import ChatRequest, parse_request

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SERVED = {"enable_thinking": False}  # params/qwen3-8b.yaml


def prompt(tokenizer, body: dict) -> str:
    request = parse_request(json.dumps({"messages": MESSAGES, **body}).encode(), ChatRequest)
    return tokenizer.decode(render_chat(tokenizer, request.chat_messages(), request.template_kwargs(SERVED)))


def test_a_request_renders_the_served_form_unless_it_sets_its_own(qwen3_tokenizer):
    served = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt(qwen3_tokenizer, {}) == served + "<think>\n\n</think>\n\n"  # thinking off, as trained
    assert prompt(qwen3_tokenizer, {"chat_template_kwargs": None}) == served + "<think>\n\n</think>\n\n"
    assert prompt(qwen3_tokenizer, {"chat_template_kwargs": {"enable_thinking": True}}) == served
    assert prompt(qwen3_tokenizer, {"chat_template_kwargs": {"other": 1}}) == served + "<think>\n\n</think>\n\n"


def test_an_argument_of_apply_chat_template_is_a_400_naming_the_field(qwen3_tokenizer):
    with pytest.raises(ApiError) as err:
        prompt(qwen3_tokenizer, {"chat_template_kwargs": {"tokenize": True}})
    assert err.value.status == 400 and err.value.param == "chat_template_kwargs" and "'tokenize'" in err.value.message
