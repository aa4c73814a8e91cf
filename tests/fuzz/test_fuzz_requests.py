"""Fuzzed request bodies: `parse_request` in-process (valid bodies with one field changed, any JSON,
any bytes), then the same kinds of bodies over HTTP against a real `dominospec serve` process.
Every body is answered (200) or refused with a 4xx and an OpenAI error naming the problem; never a
500, and the server keeps serving.
Run: python -m pytest tests/fuzz/test_fuzz_requests.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from fuzz_helpers import JSON, TEXT, fuzz
from hypothesis import example, given
from hypothesis import strategies as st

from dominospec.serve.errors import ApiError
from dominospec.serve.requests import ChatRequest, CompletionRequest, is_unicode, parse_request

from serve_helpers import KEY_ENV, authorised_client, running_server  # noqa: E402

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BASES = {CHAT: {"messages": [{"role": "user", "content": "t5 t17 t42"}], "max_tokens": 2},
         COMPLETIONS: {"prompt": "t5 t6 t7", "max_tokens": 2}}
MODELS = {CHAT: ChatRequest, COMPLETIONS: CompletionRequest}
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "stop", "seed", "n", "stream", "stream_options", "return_meta_info", "user", "logprobs"]
NUMBERS = st.one_of(st.integers(-3, 10), st.integers(), st.floats(),
                    st.sampled_from([0, 1, 1e-5, 1e-7, 1e-40, 1e-300, 5e-324, 1e300, 2**31, 2**63 - 1, 2**63]))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.just("user") | TEXT, "content": TEXT | JSON}), max_size=3)
VALUES = {"messages": MESSAGES, "prompt": TEXT, "stop": TEXT | st.lists(TEXT, max_size=5), "model": TEXT}  # else NUMBERS
# Bodies that once failed (500s found by this fuzz), tried on every run.
FOUND = [(CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),  # tokenizer TypeError
         (COMPLETIONS, b'{"prompt": "t5", "stop": ["\\ud800"]}', "stop"),
         (COMPLETIONS, b'{"prompt": "t5", "max_tokens": 2, "top_p": 1e-300}', "top_p")]  # float32 top_p 0: NaN probs
LOGITS = torch.randn(1, 300, generator=torch.Generator().manual_seed(0)) * 10  # [1, V] of the tiny target
LIMITS = dict(max_queue=4, max_body_bytes=4096, max_prompt_tokens=64, max_tokens_limit=8, default_max_tokens=4,
              api_key_env=KEY_ENV, num_threads=1)


@st.composite
def bodies(draw) -> tuple[str, bytes, str]:
    """-> (route, raw body, the field changed: '' when the whole body is random)."""
    route = draw(st.sampled_from([CHAT, COMPLETIONS]))
    kind = draw(st.sampled_from(["field", "field", "field", "drop", "json", "bytes"]))
    if kind == "bytes":
        return route, draw(st.binary(max_size=64)), ""
    if kind == "json":
        return route, json.dumps(draw(JSON)).encode(), ""
    body = dict(BASES[route])
    field = draw(st.sampled_from(FIELDS))
    if kind == "drop":
        body.pop(field, None)
    else:
        body[field] = draw(VALUES.get(field, NUMBERS) | JSON)
    return route, json.dumps(body, allow_nan=True).encode(), field


def examples(cases: list) -> callable:
    """`@example(case=c)` for each of `cases`."""
    def wrap(test):
        for case in cases:
            test = example(case=case)(test)
        return test
    return wrap


def assert_refusal(status: int, error: dict, field: str) -> None:
    assert 400 <= status < 500, (status, error)
    assert error["message"] and error["type"] == "invalid_request_error"
    if field and error["param"] is not None:  # only the changed field can be wrong
        assert error["param"].split(".")[0].split("[")[0] in (field, "messages", "prompt"), (field, error)


@given(case=bodies())
@fuzz(800)
@examples(FOUND)
def test_parse_request_returns_a_body_or_a_400(case):
    route, raw, field = case
    try:
        body = parse_request(raw, MODELS[route])
    except ApiError as err:
        assert_refusal(err.status, err.body()["error"], field)
        return
    sampling = body.sampling({"temperature": 0.7})
    if not sampling.greedy:  # the engine can draw from what the request asks for
        probs = sampling.probs(LOGITS)
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(1))
    assert body.requested_max_tokens() is None or body.requested_max_tokens() >= 1
    texts = [m["content"] for m in body.chat_messages()] if route == CHAT else [body.prompt]
    assert all(is_unicode(t) for t in [*texts, *body.stop, body.model or ""])  # what the tokenizer, streamer, answer get


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("fuzz_serve"), LIMITS) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    with authorised_client(server, timeout=30) as c:
        yield c


@given(case=bodies())
@fuzz(250)
@examples(FOUND)
def test_the_server_answers_or_refuses_every_body(server, client, case):
    route, raw, field = case
    response = client.post(route, content=raw, headers={"Content-Type": "application/json"})
    if response.status_code == 200:
        return
    assert response.headers["content-type"].startswith("application/json"), response.text
    assert_refusal(response.status_code, response.json()["error"], field)


def test_the_server_still_serves_after_the_fuzz(server, client):
    answer = client.post(COMPLETIONS, json=BASES[COMPLETIONS])
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    assert client.get("/server_info").json()["requests"]["failed"] == 0
