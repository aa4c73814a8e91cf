"""The built-in server accepts what SGLang 0.5.23's OpenAI routes accept, where the two differed
(the differences kept, and why, are listed in src/dominospec/serve/requests.py):

- `model` is not checked: a client written for SGLang sends "default" (SGLang's own examples do);
  the answer echoes the request's model, as SGLang's does, or the served name when there is none;
- message roles are SGLang's set, in any case ("User", "developer", "tool", ...);
- a completion request does not take the target's generation_config sampling defaults (SGLang
  applies them to chat only).
Run: python -m pytest tests/serve/test_sglang_alignment.py -q
"""

from __future__ import annotations

import pytest
from serve_helpers import CHATS, NAME, sse_events

from dominospec.engine import Sampling
from dominospec.serve.requests import ROLES, ChatRequest, CompletionRequest, parse_request

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GENERATION_CONFIG = {"temperature": 0.3, "top_p": 0.8, "top_k": 20}


@pytest.mark.parametrize("path, body", [
    (CHAT, {"model": "default", "messages": CHATS[0]}),
    (CHAT, {"model": "gpt-4o", "messages": CHATS[0], "stream": True}),
    (COMPLETIONS, {"model": "default", "prompt": "t5 t6"}),
    (COMPLETIONS, {"model": "some/other-name", "prompt": "t5 t6", "stream": True}),
])
def test_any_model_name_is_served_and_echoed(client, path, body):
    response = client.post(path, json={**body, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    if body.get("stream"):
        models = {chunk["model"] for chunk in sse_events(response.text.splitlines()) if chunk != "[DONE]"}
        assert models == {body["model"]}
    else:
        assert response.json()["model"] == body["model"]


def test_an_answer_without_model_names_the_served_model(client):
    answer = client.post(CHAT, json={"messages": CHATS[0], "max_tokens": 2}).json()
    assert answer["model"] == NAME


@pytest.mark.parametrize("role", ["User", "SYSTEM", "developer", "tool", "function", "root", "latest_reminder"])
def test_sglang_roles_in_any_case_are_accepted(client, role):
    messages = [{"role": role, "content": "t9"}, {"role": "user", "content": "t5"}]
    response = client.post(CHAT, json={"model": "default", "messages": messages, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text


def test_roles_reach_the_template_in_lower_case():
    body = parse_request(b'{"messages": [{"role": "User", "content": "a"}, {"role": "Developer", "content": "b"}]}',
                         ChatRequest)
    assert [m["role"] for m in body.chat_messages()] == ["user", "developer"]
    assert set(ROLES) == {"system", "user", "assistant", "developer", "tool", "function", "root", "latest_reminder"}


def test_generation_config_defaults_apply_to_chat_only():
    chat = parse_request(b'{"messages": [{"role": "user", "content": "a"}]}', ChatRequest)
    completion = parse_request(b'{"prompt": "a"}', CompletionRequest)
    assert chat.sampling(GENERATION_CONFIG) == Sampling(temperature=0.3, top_p=0.8, top_k=20)
    assert completion.sampling(GENERATION_CONFIG) == Sampling(temperature=1.0, top_p=1.0, top_k=0)
    given = parse_request(b'{"prompt": "a", "temperature": 0.5, "top_k": 5}', CompletionRequest)
    assert given.sampling(GENERATION_CONFIG) == Sampling(temperature=0.5, top_p=1.0, top_k=5)

