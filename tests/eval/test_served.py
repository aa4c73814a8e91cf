"""`dominospec evaluate --server URL` against the built-in server, run for real in a subprocess.

The tiny Llama target of the export tests (word-level tokenizer over t0..t299, given a toy chat
template here) and its exported tiny draft are served by `dominospec serve --backend builtin`;
the served evaluation runs through `dominospec.cli.main` and its numbers are checked against
answers fetched directly from the same server. Plus the pure pooling and percentile helpers.
Run: python -m pytest tests/eval/test_served.py -q
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from dominospec.cli import main
from dominospec.eval.served import percentile, pooled_acceptance

REPO = Path(__file__).resolve().parents[2]
from engine_helpers import CHAT_TEMPLATE  # noqa: E402
from export_helpers import make_project, save_tiny_target, target_params  # noqa: E402

PROMPTS = ["t5 t6 t7 t8", "t20 t21", "t30 t31 t32", "t40", "t50 t51 t52 t53 t54"]
MAX_NEW_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """-> (params path, prompts JSONL): the tiny target with a chat template, its exported draft."""
    from dominospec.config import load_params
    from dominospec.export.stage import export
    from dominospec.target import load_target
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("served")
    target_dir = save_tiny_target(root / "llama", "llama")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.chat_template = CHAT_TEMPLATE  # before the identity: the fingerprint covers tokenizer files
    tokenizer.save_pretrained(target_dir)
    identity = load_target(target_params(target_dir)).identity.as_dict()
    params_path = make_project(root / "project", target_dir, identity)
    raw = yaml.safe_load(params_path.read_text())
    raw["evaluate"].update(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, max_prompts=len(PROMPTS), num_threads=1)
    params_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    export(load_params(params_path))
    prompts = root / "tiny.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return params_path, prompts


@pytest.fixture(scope="module")
def server(project):
    """The built-in server on a free port, ready (/health 200) -> its URL; killed afterwards."""
    params_path, _ = project
    port = free_port()
    log = params_path.parent / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DOMINOSPEC_API_KEY", None)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dominospec.cli", "serve", "--params", str(params_path), "--host", "127.0.0.1",
             "--port", str(port), "--backend", "builtin"],
            stdout=out, stderr=subprocess.STDOUT, cwd=params_path.parent, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server was not ready within 60 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def direct_answers(url: str) -> list[dict]:
    """Every prompt sent once, by hand, greedy with the evaluation's settings -> the choices' meta_info."""
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    metas = []
    for i, prompt in enumerate(PROMPTS):
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_NEW_TOKENS,
                "temperature": 0.0, "seed": i, "return_meta_info": True}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        assert answer["usage"]["completion_tokens"] == answer["choices"][0]["meta_info"]["completion_tokens"]
        metas.append(answer["choices"][0]["meta_info"])
    return metas


def test_served_evaluation_matches_the_servers_own_counts(project, server, tmp_path, capsys):
    params_path, prompts = project
    out = tmp_path / "serve_eval.json"
    argv = ["evaluate", "--server", server, "--params", str(params_path), "--prompts", str(prompts),
            "--out", str(out), "--concurrency", "3"]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["server"] == server and report["concurrency"] == [1, 3]
    assert report["max_new_tokens"] == MAX_NEW_TOKENS and report["temperature"] == 0.0
    assert set(report["suites"]) == {"tiny"} and set(report["suites"]["tiny"]) == {"c1", "c3"}

    metas = direct_answers(server)
    tokens = sum(m["completion_tokens"] for m in metas)
    rounds = sum(m["spec_verify_ct"] for m in metas)
    assert tokens > 0 and rounds > 0
    for level in report["suites"]["tiny"].values():
        assert level["n_requests"] == len(PROMPTS) and level["errors"] == 0
        assert level["meta_info_requests"] == len(PROMPTS)
        assert 0 < level["completion_tokens"] <= len(PROMPTS) * MAX_NEW_TOKENS
        assert level["latency_p50_s"] <= level["latency_p99_s"] <= level["wall_s"]
        assert level["tokens_per_s"] == pytest.approx(level["completion_tokens"] / level["wall_s"])
        assert level["acceptance_length"] == pytest.approx(level["meta_completion_tokens"] / level["spec_verify_ct"])
        assert 1.0 <= level["acceptance_length"] <= 4  # the tiny draft's block size
    # Greedy and deterministic: one request at a time gives the very answers fetched by hand.
    c1, c3 = report["suites"]["tiny"]["c1"], report["suites"]["tiny"]["c3"]
    assert (c1["completion_tokens"], c1["spec_verify_ct"]) == (tokens, rounds)
    assert c1["acceptance_length"] == pytest.approx(tokens / rounds)
    # The built-in server generates one request at a time, so three in flight give the same answers.
    assert (c3["completion_tokens"], c3["spec_verify_ct"]) == (tokens, rounds)
    assert isinstance(report["server_info"]["avg_spec_accept_length_after"], float)
    table = capsys.readouterr().out
    assert f"{c1['acceptance_length']:.2f}" in table and "wrote " + str(out) in table


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = main(["evaluate", "--server", url, "--params", str(REPO / "params.yaml"), "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert code == 2 and url in err and "make serve" in err
    assert not (tmp_path / "x.json").exists()


def test_pooled_acceptance_weights_requests_by_their_verify_rounds():
    # Two requests: 10 tokens in 2 rounds (τ 5) and 3 tokens in 3 rounds (τ 1). Pooled: 13 / 5, not (5 + 1) / 2.
    assert pooled_acceptance(10 + 3, 2 + 3) == pytest.approx(2.6)
    assert pooled_acceptance(0, 0) is None  # no verify rounds: no speculative decoding


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)  # rank 0.99 * 4 = 3.96
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0) == 1.0 and percentile([1.0, 5.0], 100) == 5.0
    assert percentile([7.0], 99) == 7.0


def test_requests_carry_the_targets_chat_template_kwargs_when_it_sets_any():
    """The server must render the prompt the draft was trained on (Qwen3: thinking off); SmolLM2's requests
    ({} in params.yaml) stay as they were."""
    from dominospec.config import load_params
    from dominospec.eval.served import request_body

    cfg = load_params(REPO / "params.yaml").evaluate
    messages = [{"role": "user", "content": "t5"}]
    assert "chat_template_kwargs" not in request_body("m", messages, cfg, {}, 0, 8)
    body = request_body("m", messages, cfg, {"enable_thinking": False}, 3, 8)
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["seed"] == cfg.seed + 3
