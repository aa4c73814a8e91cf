"""Fault isolation on a real `dominospec serve` process with faults injected (faulty_serve.py): an
exception inside one request's generation, or in its handler, fails that request only (500 with a
message; a stream ends with an error event), and the server keeps serving the next requests with
the same exact answers, on the same keep-alive connection.
Run: python -m pytest tests/serve/test_faults.py -q
"""

from __future__ import annotations

import threading

import httpx
import pytest
from faulty_serve import GENERATION_FAULT, HANDLER_FAULT
from serve_helpers import KEY_ENV, REPO, authorised_client, running_server

from common.http_load import send

LIMITS = dict(max_queue=8, max_body_bytes=65536, max_prompt_tokens=256, max_tokens_limit=64, default_max_tokens=8,
              api_key_env=KEY_ENV, num_threads=1)
GOOD = ["t5 t6 t7", "t200 t13 t13 t99"]
BAD = f"t5 {GENERATION_FAULT} t7"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {"PYTHONPATH": str(REPO / "tests" / "serve")}
    with running_server(tmp_path_factory.mktemp("faults"), LIMITS, env, module="faulty_serve") as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    with authorised_client(server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def expected(client):
    """Each good prompt's greedy answer before any fault."""
    return {p: send(client, p, 8, stream=False).text for p in GOOD}


def test_a_generation_fault_fails_that_request_only(client, expected):
    failed = client.get("/server_info").json()["requests"]["failed"]
    reply = send(client, BAD, 8, stream=False)
    assert reply.status == 500 and reply.error["code"] == "internal_error"
    assert reply.error["message"] == "generation failed: RuntimeError: injected fault"
    assert send(client, GOOD[0], 8, stream=False).text == expected[GOOD[0]]  # same connection, same answer
    assert client.get("/server_info").json()["requests"]["failed"] == failed + 1


def test_a_stream_that_faults_ends_with_an_error_event(client, expected):
    reply = send(client, BAD, 8, stream=True)
    assert reply.status == 200 and reply.text  # its first tokens went out before the fault
    assert reply.error == {"message": "generation failed: RuntimeError: injected fault", "type": "server_error",
                           "param": None, "code": "internal_error"}
    assert send(client, GOOD[1], 8, stream=True).text == expected[GOOD[1]]


def test_a_handler_fault_keeps_the_connection(client, expected):
    reply = send(client, f"t5 {HANDLER_FAULT}", 8, stream=False)
    assert reply.status == 500 and reply.error == {"message": "internal error: RuntimeError", "type": "server_error",
                                                   "param": None, "code": "internal_error"}
    assert send(client, GOOD[0], 8, stream=False).text == expected[GOOD[0]]  # no reset of the keep-alive connection


def test_faults_among_concurrent_requests_fail_only_themselves(server, client, expected):
    before = client.get("/server_info").json()["requests"]
    prompts = [BAD, GOOD[0], f"t9 {HANDLER_FAULT}", GOOD[1]] * 3  # 6 faults, 6 good, from 4 clients
    replies: dict = {}

    def client_loop(c: int) -> None:
        with httpx.Client(base_url=server.url, headers=client.headers, timeout=60) as own:
            for k in range(c, len(prompts), 4):
                replies[k] = send(own, prompts[k], 8, stream=k % 2 == 1)

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for k, prompt in enumerate(prompts):
        if prompt in expected:
            assert (replies[k].status, replies[k].error, replies[k].text) == (200, None, expected[prompt])
        elif prompt == BAD:  # non-streamed (k even)
            assert replies[k].status == 500 and "injected fault" in replies[k].error["message"]
        else:
            assert replies[k].status == 500 and replies[k].error["message"] == "internal error: RuntimeError"
    after = client.get("/server_info").json()["requests"]
    assert after["failed"] - before["failed"] == 3  # generation faults; handler faults never reach the engine
    assert client.get("/health").status_code == 200
