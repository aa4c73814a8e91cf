"""The built-in server in mode `dominotree` (serve.mode): a real process, a real HTTP client.

Greedy chat answers equal the target's own AR answers; a sampled request with a seed is repeatable
and its usage adds up; /server_info names the tree (DOMINOTREE, N + 1 verify rows).
Run: python -m pytest tests/serve/test_dominotree_serve.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
from serve_helpers import CHATS, KEY_ENV, authorised_client, running_server

from dominospec.engine import SpecEngine

LIMITS = dict(mode="dominotree", max_queue=2, max_body_bytes=65536, max_prompt_tokens=256, max_tokens_limit=1000,
              default_max_tokens=16, api_key_env=KEY_ENV, num_threads=1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import yaml

    root = tmp_path_factory.mktemp("dominotree")
    with running_server(root, LIMITS) as process:
        raw = yaml.safe_load(process.params.read_text())
        assert raw["engine"]["tree"]["nodes"] >= 1
        yield process


def test_greedy_chat_is_lossless_and_server_info_names_the_tree(server):
    from dominospec.config import load_params
    from dominospec.data.chat import render_prompt as render
    from dominospec.target import load_target

    target = load_target(load_params(server.params).target)
    ar = SpecEngine(target, None, "ar", params=dataclasses.replace(load_params(server.params).engine, linear="torch"))
    with authorised_client(server) as client:
        info = client.get("/server_info").json()
        assert info["mode"] == "dominotree" and info["speculative_algorithm"] == "DOMINOTREE"
        nodes = load_params(server.params).engine.tree.nodes
        assert info["speculative_num_draft_tokens"] == nodes + 1
        for messages in CHATS:
            ids = render(target.tokenizer, messages, {})
            expected = ar.generate(ids, 24)
            answer = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0,
                                                                "max_tokens": 24}).json()
            assert answer["choices"][0]["message"]["content"] == expected.text
            assert answer["usage"]["completion_tokens"] == len(expected.token_ids)
        sampled = [client.post("/v1/chat/completions", json={"messages": CHATS[0], "temperature": 0.8, "seed": 7,
                                                              "max_tokens": 20}).json() for _ in range(2)]
        assert sampled[0]["choices"][0]["message"] == sampled[1]["choices"][0]["message"]
        usage = sampled[0]["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > usage["prompt_tokens"]
