"""The built-in server over real HTTP: a real `dominospec serve` process (conftest.py), tiny models.

- Lossless through HTTP: greedy chat and completion answers equal the target's own greedy
  decoding, computed here in-process (the server runs Domino with an exported bf16 draft).
- Streaming: the deltas concatenate to the non-streaming answer (stop strings included), the last
  chunk carries finish_reason and meta_info, then `data: [DONE]`.
- meta_info is SGLang's: spec_accept_length == completion_tokens / spec_verify_ct, and
  /server_info pools τ over requests.
- Bearer key (401), queue full (503), a client that goes away frees the worker.
Malformed requests: test_errors.py.
Run: python -m pytest tests/serve/test_api.py -q
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from serve_helpers import BLOCK, CHATS, KEY, NAME, NODES, PROMPTS, SERVE, sse_events


def chat(client, messages, **fields):
    return client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, **fields})


def complete(client, prompt, **fields):
    return client.post("/v1/completions", json={"prompt": prompt, "temperature": 0, **fields})


def finish(generation) -> str:
    return {"stop_token": "stop", "stop_string": "stop", "length": "length"}[generation.finish_reason]


def test_ready_line_health_models_and_server_info(server, client):
    assert server.name == NAME and server.shape == f"domino, B={BLOCK}, K={BLOCK - 1}"
    assert client.get("/health").json() == {}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [NAME]
    assert models["data"][0]["owned_by"] == "dominospec"
    info = client.get("/server_info").json()
    assert info["mode"] == "domino" and info["speculative_algorithm"] == "DOMINOTREE"  # the default tree
    assert info["speculative_num_draft_tokens"] == NODES + 1 and info["block_size"] == BLOCK and info["num_draft"] == BLOCK - 1
    assert info["backend"] == "builtin" and info["draft"]["domino_head"] and info["api_key_required"]


def test_chat_is_lossless(client, target, reference):
    from dominospec.data.chat import render_prompt as render

    for messages in CHATS:
        ids = render(target.tokenizer, messages, {})
        expected = reference(ids, 24)
        answer = chat(client, messages, max_tokens=24).json()
        assert answer["object"] == "chat.completion" and answer["model"] == NAME
        choice = answer["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": expected.text}
        assert choice["finish_reason"] == finish(expected) and "meta_info" not in choice
        assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(expected.token_ids),
                                   "total_tokens": len(ids) + len(expected.token_ids)}


def test_completions_are_lossless(client, target, reference):
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt)["input_ids"]
        expected = reference(ids, 20)
        answer = complete(client, prompt, max_tokens=20, model=NAME).json()
        assert answer["object"] == "text_completion"
        assert answer["choices"][0]["text"] == expected.text and answer["choices"][0]["finish_reason"] == finish(expected)
        assert answer["usage"]["completion_tokens"] == len(expected.token_ids)
    default = complete(client, PROMPTS[0]).json()  # no max_tokens: serve.default_max_tokens
    assert default["usage"]["completion_tokens"] == SERVE["default_max_tokens"]


def test_meta_info_is_sglangs_and_server_info_pools_it(client):
    before = client.get("/server_info").json()["requests"]
    metas = []
    for messages in CHATS:
        answer = chat(client, messages, max_tokens=30, return_meta_info=True).json()
        meta = answer["choices"][0]["meta_info"]
        assert set(meta) == {"spec_accept_length", "spec_verify_ct", "completion_tokens", "prompt_tokens", "e2e_latency"}
        assert meta["spec_verify_ct"] >= 1 and meta["e2e_latency"] > 0
        assert meta["completion_tokens"] == answer["usage"]["completion_tokens"]
        assert meta["prompt_tokens"] == answer["usage"]["prompt_tokens"]
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
        assert 1 <= meta["spec_accept_length"] <= BLOCK + 1  # + 1: the prefill's token counts, as in SGLang
        metas.append(meta)
    info = client.get("/server_info").json()
    after = info["requests"]
    assert after["completion_tokens"] - before["completion_tokens"] == sum(m["completion_tokens"] for m in metas)
    assert after["verify_rounds"] - before["verify_rounds"] == sum(m["spec_verify_ct"] for m in metas)
    assert info["avg_spec_accept_length"] == pytest.approx(after["completion_tokens"] / after["verify_rounds"])
    assert info["internal_states"][0]["avg_spec_accept_length"] == info["avg_spec_accept_length"]


def stream(client, path, body):
    """POST with stream: true -> (all payloads, concatenated text)."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response.iter_lines()))
    chunks = [e for e in events if e != "[DONE]"]
    key = "delta" if path.endswith("chat/completions") else None
    text = "".join((c["choices"][0]["delta"].get("content", "") if key else c["choices"][0]["text"])
                   for c in chunks if c["choices"])
    return events, text


@pytest.mark.parametrize("stop", [None, "t4"])
def test_streaming_concatenates_to_the_answer(client, stop):
    for messages in CHATS:
        body = {"messages": messages, "temperature": 0, "max_tokens": 40, "stop": stop, "return_meta_info": True}
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        events, text = stream(client, "/v1/chat/completions", body)
        assert events[-1] == "[DONE]" and text == whole["message"]["content"]
        assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"]["role"] == "assistant"
        last = events[-2]["choices"][0]
        assert last["finish_reason"] == whole["finish_reason"] and last["delta"] == {}
        assert last["meta_info"]["completion_tokens"] == whole["meta_info"]["completion_tokens"]
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    for prompt in PROMPTS:
        body = {"prompt": prompt, "temperature": 0, "max_tokens": 40, "stop": stop,
                "stream_options": {"include_usage": True}}
        whole = client.post("/v1/completions", json=body).json()
        events, text = stream(client, "/v1/completions", body)
        assert text == whole["choices"][0]["text"] and events[-1] == "[DONE]"
        assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]  # include_usage chunk
        assert events[-3]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_stop_strings_cut_the_answer(client, reference, target):
    ids = target.tokenizer(PROMPTS[0])["input_ids"]
    free = reference(ids, 30).text
    stop = free.split()[4]
    answer = complete(client, PROMPTS[0], max_tokens=30, stop=[stop, "never-there"]).json()["choices"][0]
    assert answer["finish_reason"] == "stop" and answer["text"] == free[: free.index(stop)]


def test_sampling_is_reproducible_by_seed(client):
    body = dict(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50)
    a, b = (complete(client, PROMPTS[1], seed=7, **body).json() for _ in range(2))
    c = complete(client, PROMPTS[1], seed=8, **body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] != c["choices"][0]["text"]


def test_bearer_key(server, client):
    body = {"prompt": PROMPTS[0], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"]["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes stay open
    assert client.post("/v1/completions", json=body).status_code == 200


def wait_for(client, predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.get("/server_info").json()
        if predicate(info["requests"]):
            return info
        time.sleep(0.05)
    raise AssertionError(f"/server_info never satisfied the condition: {info['requests']}")


def test_queue_full_and_disconnects_free_the_worker(server, client, target, reference):
    long_prompt = PROMPTS[0]
    assert reference(target.tokenizer(long_prompt)["input_ids"], 950).finish_reason == "length"  # no early stop
    start = client.get("/server_info").json()["requests"]
    queued: dict = {}

    def send_queued():
        queued["response"] = complete(client, PROMPTS[1], max_tokens=4)

    with httpx.Client(base_url=server.url, headers=client.headers, timeout=60) as streaming:
        with streaming.stream("POST", "/v1/completions",
                              json={"prompt": long_prompt, "max_tokens": 950, "temperature": 0, "stream": True}) as long:
            lines = long.iter_lines()
            next(e for e in sse_events(lines) if e["choices"][0]["text"])  # generating now
            waiter = threading.Thread(target=send_queued)
            waiter.start()
            wait_for(client, lambda r: r["waiting"] == 1)  # the one queue slot is taken
            busy = complete(client, PROMPTS[1], max_tokens=4)
            assert busy.status_code == 503
            assert busy.json()["error"]["code"] == "queue_full" and busy.json()["error"]["type"] == "server_error"
            next(sse_events(lines))  # the long generation is still running
        # leaving the blocks closes the stream and the connection: the client is gone
    waiter.join(timeout=30)
    assert queued["response"].status_code == 200
    assert queued["response"].json()["usage"]["completion_tokens"] == 4
    counts = wait_for(client, lambda r: r["aborted"] == start["aborted"] + 1)["requests"]
    assert counts["rejected"] == start["rejected"] + 1 and counts["running"] == 0

    # A non-streaming client that gives up is noticed too (the server polls it).
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 950, "temperature": 0}, timeout=0.5)
    wait_for(client, lambda r: r["aborted"] == start["aborted"] + 2 and r["running"] == 0)
    assert chat(client, CHATS[0], max_tokens=3).status_code == 200
