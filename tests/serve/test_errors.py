"""Malformed requests to the built-in server: each gets its 4xx status and an OpenAI-shaped JSON
error naming the field, and the server keeps answering (real process of conftest.py).
Run: python -m pytest tests/serve/test_errors.py -q
"""

from __future__ import annotations

import pytest
from serve_helpers import CHATS, NAME, SERVE

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
OK_CHAT = {"messages": CHATS[0], "max_tokens": 2}
OK_PROMPT = {"prompt": "t5 t6", "max_tokens": 2}


def with_(base: dict, **changes) -> dict:
    body = {**base, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


DROP = object()

# (path, json body, status, param, code)
BAD_FIELDS = [
    (CHAT, with_(OK_CHAT, messages=DROP), 400, "messages", "missing_field"),
    (CHAT, with_(OK_CHAT, messages=[]), 400, "messages", "invalid_value"),
    (CHAT, with_(OK_CHAT, messages="t5"), 400, "messages", "invalid_value"),
    (CHAT, with_(OK_CHAT, messages=[{"role": "robot", "content": "t5"}]), 400, "messages[0].role", "invalid_value"),
    (CHAT, with_(OK_CHAT, messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", "invalid_value"),
    (CHAT, with_(OK_CHAT, messages=[{"role": "user"}]), 400, "messages[0].content", "missing_field"),
    (CHAT, with_(OK_CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content", "invalid_value"),
    (CHAT, with_(OK_CHAT, temperature=-0.5), 400, "temperature", "invalid_value"),
    (CHAT, with_(OK_CHAT, temperature="0.5"), 400, "temperature", "invalid_value"),
    (CHAT, with_(OK_CHAT, temperature=True), 400, "temperature", "invalid_value"),
    (CHAT, with_(OK_CHAT, top_p=0), 400, "top_p", "invalid_value"),
    (CHAT, with_(OK_CHAT, top_p=1.5), 400, "top_p", "invalid_value"),
    (CHAT, with_(OK_CHAT, top_k=-2), 400, "top_k", "invalid_value"),
    (CHAT, with_(OK_CHAT, top_k=2.5), 400, "top_k", "invalid_value"),
    (CHAT, with_(OK_CHAT, max_tokens=0), 400, "max_tokens", "invalid_value"),
    (CHAT, with_(OK_CHAT, max_tokens=SERVE["max_tokens_limit"] + 1), 400, "max_tokens", "invalid_value"),
    (CHAT, with_(OK_CHAT, max_completion_tokens=SERVE["max_tokens_limit"] + 1), 400, "max_completion_tokens",
     "invalid_value"),
    (CHAT, with_(OK_CHAT, max_tokens="10"), 400, "max_tokens", "invalid_value"),
    (CHAT, with_(OK_CHAT, stop=["a", "b", "c", "d", "e"]), 400, "stop", "invalid_value"),
    (CHAT, with_(OK_CHAT, stop=[3]), 400, "stop", "invalid_value"),
    (CHAT, with_(OK_CHAT, stop=""), 400, "stop", "invalid_value"),
    (CHAT, with_(OK_CHAT, seed=-1), 400, "seed", "invalid_value"),
    (CHAT, with_(OK_CHAT, seed=2**64), 400, "seed", "invalid_value"),
    (CHAT, with_(OK_CHAT, n=2), 400, "n", "invalid_value"),
    (CHAT, with_(OK_CHAT, stream="yes"), 400, "stream", "invalid_value"),
    (CHAT, with_(OK_CHAT, return_meta_info=1), 400, "return_meta_info", "invalid_value"),
    (CHAT, with_(OK_CHAT, stream_options={"include_usage": "y"}), 400, "stream_options.include_usage", "invalid_value"),
    (CHAT, with_(OK_CHAT, model=7), 400, "model", "invalid_value"),
    (CHAT, with_(OK_CHAT, messages=[{"role": "user", "content": "t5 " * 300}]), 400, "messages", "prompt_too_long"),
    (CHAT, with_(OK_CHAT, chat_template_kwargs="no"), 400, "chat_template_kwargs", "invalid_value"),
    (CHAT, with_(OK_CHAT, chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs", "invalid_value"),
    (COMPLETIONS, with_(OK_PROMPT, prompt=DROP), 400, "prompt", "missing_field"),
    (COMPLETIONS, with_(OK_PROMPT, prompt=""), 400, "prompt", "invalid_value"),
    (COMPLETIONS, with_(OK_PROMPT, prompt=["t5"]), 400, "prompt", "invalid_value"),
    (COMPLETIONS, with_(OK_PROMPT, prompt="t5 " * 300), 400, "prompt", "prompt_too_long"),
    (COMPLETIONS, with_(OK_PROMPT, max_tokens=-3), 400, "max_tokens", "invalid_value"),
]

# (path, raw body) -> 400 invalid_json, param null
BAD_JSON = [
    (CHAT, b'{"messages": ['),
    (CHAT, b""),
    (CHAT, b"[1, 2]"),
    (CHAT, b'"just a string"'),
    (CHAT, b'{"messages": [], "temperature": NaN}'),
    (COMPLETIONS, b'{"prompt": "t5", "top_p": Infinity}'),
    (COMPLETIONS, b"\xff\xfe\x00garbage"),
    (COMPLETIONS, b"[" * 40000),  # nested past Python's recursion limit, under the body limit
]


def assert_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["param"] == param and error["code"] == code
    if param:
        assert param.split("[")[0].split(".")[0] in error["message"]  # the message names the field
    return error


@pytest.mark.parametrize("path, body, status, param, code", BAD_FIELDS,
                         ids=[f"{p.rsplit('/', 1)[1]}-{param}-{i}" for i, (p, _, _, param, _) in enumerate(BAD_FIELDS)])
def test_bad_fields(client, path, body, status, param, code):
    assert_error(client.post(path, json=body), status, param, code)


@pytest.mark.parametrize("path, raw", BAD_JSON, ids=range(len(BAD_JSON)))
def test_bad_json(client, path, raw):
    assert_error(client.post(path, content=raw, headers={"Content-Type": "application/json"}), 400, None, "invalid_json")


def test_bodies_over_the_limit_get_413_declared_or_chunked(client):
    big = b'{"prompt": "' + b"t5 " * (SERVE["max_body_bytes"] // 3 + 10) + b'"}'
    assert_error(client.post(COMPLETIONS, content=big), 413, None, "body_too_large")

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    assert_error(client.post(COMPLETIONS, content=chunks()), 413, None, "body_too_large")  # no Content-Length


def test_unknown_routes_and_methods(client):
    assert_error(client.get("/v1/nothing"), 404, None, "not_found")
    assert_error(client.post("/generate", json={}), 404, None, "not_found")
    assert_error(client.get(CHAT), 405, None, "method_not_allowed")
    assert_error(client.delete("/health"), 405, None, "method_not_allowed")


def test_extra_fields_are_ignored_and_content_parts_accepted(client):
    body = {**OK_CHAT, "user": "me", "logprobs": False, "frequency_penalty": 0, "model": NAME,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "t5 "}, {"type": "text", "text": "t6"}]}]}
    assert client.post(CHAT, json=body).status_code == 200
    assert client.post(COMPLETIONS, content=b'{"prompt": "t5", "max_tokens": 1}').status_code == 200  # no content type


def test_the_server_still_answers_after_all_that(client):
    info = client.get("/server_info").json()
    assert info["requests"]["failed"] == 0
    answer = client.post(CHAT, json={**OK_CHAT, "max_tokens": 5, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
    assert client.get("/health").status_code == 200
