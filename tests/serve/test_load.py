"""Load on a real `dominospec serve` process (tiny project, loopback, serve.max_queue = 4):
concurrent streaming and non-streaming clients at the queue bound all get their exact answers,
and past the bound every extra request gets 503 queue_full while the queued ones still finish.
The load is benchmarks/load.py's `run_load`. Run: python -m pytest tests/serve/test_load.py -q -s
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from serve_helpers import KEY, KEY_ENV, authorised_client, running_server

from common.http_load import run_load, send

MAX_QUEUE = 4
LIMITS = dict(max_queue=MAX_QUEUE, max_body_bytes=65536, max_prompt_tokens=256, max_tokens_limit=1000,
              default_max_tokens=16, api_key_env=KEY_ENV, num_threads=1)
TINY_PROMPTS = ["t5 t6 t7", "t200 t13 t13 t99", "t42", "t9 t100 t7 t250 t8"]
CLIENTS, REQUESTS, MAX_TOKENS = MAX_QUEUE, 6, 8  # at the bound: each client has one request in flight


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("load"), LIMITS) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    with authorised_client(server, timeout=60) as c:
        yield c


def requests_info(client) -> dict:
    return client.get("/server_info").json()["requests"]


def wait_for(client, predicate, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = requests_info(client)
        if predicate(counts):
            return counts
        time.sleep(0.02)
    raise AssertionError(f"/server_info never satisfied the condition: {counts}")


def test_clients_at_the_queue_bound_all_get_their_exact_answers(server, client):
    expected = {p: send(client, p, MAX_TOKENS, stream=False).text for p in TINY_PROMPTS}  # one at a time
    before = requests_info(client)
    result = run_load(server.url, CLIENTS, REQUESTS, MAX_TOKENS, prompts=TINY_PROMPTS, api_key=KEY)
    print(f"\nload: {result.summary()}")
    assert result.statuses() == {200: CLIENTS * REQUESTS}
    assert sum(r.stream for r in result.replies) == CLIENTS * REQUESTS // 2
    assert all(r.error is None for r in result.replies)
    texts = {r.text for r in result.replies}
    assert texts == set(expected.values())  # greedy: streamed or not, concurrent or not, the same answers
    after = requests_info(client)
    assert after["rejected"] == before["rejected"] and after["failed"] == before["failed"]
    assert after["completed"] - before["completed"] == CLIENTS * REQUESTS


def test_past_the_queue_bound_extra_requests_get_503_and_queued_ones_finish(server, client):
    extra = 6
    before = requests_info(client)
    queued: list = []
    with httpx.Client(base_url=server.url, headers=client.headers, timeout=60) as occupier:
        with occupier.stream("POST", "/v1/completions",
                             json={"prompt": TINY_PROMPTS[0], "max_tokens": 1000, "temperature": 0, "stream": True}) as long:
            lines = long.iter_lines()  # kept: a dropped iterator closes the stream, and the server aborts the job
            next(line for line in lines if line.startswith("data: "))  # the worker is busy with it
            waiters = [threading.Thread(target=lambda p=p: queued.append(send(client_for(server), p, 4, stream=False)))
                       for p in TINY_PROMPTS[:MAX_QUEUE]]
            for t in waiters:
                t.start()
            wait_for(client, lambda r: r["waiting"] == MAX_QUEUE)
            burst: list = []
            senders = [threading.Thread(target=lambda p=p: burst.append(send(client_for(server), p, 4, stream=p == "t42")))
                       for p in (TINY_PROMPTS * 2)[:extra]]
            for t in senders:
                t.start()
            for t in senders:
                t.join(timeout=30)
        # leaving the blocks closes the long stream: its job is cancelled, the queue drains
    for t in waiters:
        t.join(timeout=60)
    assert [r.status for r in burst] == [503] * extra
    assert {r.error["code"] for r in burst} == {"queue_full"}
    assert [r.status for r in queued] == [200] * MAX_QUEUE
    after = wait_for(client, lambda r: r["running"] == 0 and r["waiting"] == 0)
    assert after["rejected"] - before["rejected"] == extra


def client_for(server) -> httpx.Client:
    """A fresh authorised client (one per thread: connections are not shared across threads here)."""
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
