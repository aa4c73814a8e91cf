"""Security defaults, pinned (docs/security.md): loopback bind, safetensors-only weights,
`weights_only` checkpoint loads, no `trust_remote_code` unless params set it, bounded requests.
Run: python -m pytest tests/test_security.py -q
"""

from __future__ import annotations

import ast
import asyncio
import ipaddress
import socket
from pathlib import Path

import httpx
import pytest

from dominospec.config import load_params
from dominospec.serve.builtin import bind, check_serve_params
from dominospec.serve.guards import Guards

REPO = Path(__file__).resolve().parents[1]
CODE = [p for layer in ("src", "models", "kernels", "pipeline") for p in (REPO / layer).rglob("*.py")]
PARAMS = [REPO / "params.yaml", *sorted((REPO / "params").glob("*.yaml"))]
WEIGHT_LOADERS = ("AutoModelForCausalLM", "DFlashDraftModel")  # from_pretrained on these reads weights


def calls(name: str):
    """(path, ast.Call) for every call of `*.name(...)` or `name(...)` in the shipped code."""
    for path in CODE:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called == name:
                    yield path.relative_to(REPO), node


def keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


@pytest.mark.parametrize("path", PARAMS, ids=lambda p: p.name)
def test_every_params_file_binds_loopback_and_trusts_no_remote_code(path):
    params = load_params(path)
    assert ipaddress.ip_address(socket.gethostbyname(params.serve.host)).is_loopback, params.serve.host
    assert params.target.trust_remote_code is False


def test_the_default_host_binds_loopback_only():
    sock = bind(load_params(REPO / "params.yaml").serve.host, 0)
    try:
        assert ipaddress.ip_address(sock.getsockname()[0]).is_loopback
    finally:
        sock.close()


def test_torch_load_is_weights_only_everywhere():
    loads = [(p, c) for p, c in calls("load") if ast.unparse(c.func) == "torch.load"]
    bad = [f"{p}:{c.lineno}" for p, c in loads if ast.unparse(keyword(c, "weights_only") or ast.Constant(None)) != "True"]
    assert not bad, f"torch.load without weights_only=True: {bad}"
    assert not [p for p in CODE if "import pickle" in p.read_text() or "pickle.load" in p.read_text()]


def test_model_weights_load_from_safetensors_only():
    found, bad = 0, []
    for path, call in calls("from_pretrained"):
        owner = ast.unparse(call.func.value) if isinstance(call.func, ast.Attribute) else ""
        if owner not in WEIGHT_LOADERS:
            continue  # configs and tokenizers hold no weights
        found += 1
        if not ast.unparse(keyword(call, "use_safetensors") or ast.Constant(None)).startswith("True"):  # GGUF: None
            bad.append(f"{path}:{call.lineno}")
    assert found >= 2 and not bad, bad  # the target and the draft


def test_remote_code_is_trusted_only_when_params_say_so():
    bad = []
    for path, call in calls("from_pretrained"):
        value = keyword(call, "trust_remote_code")
        if value is not None and not ast.unparse(value).endswith("trust_remote_code"):
            bad.append(f"{path}:{call.lineno}: trust_remote_code={ast.unparse(value)}")
    assert not bad, bad


def test_request_limits_are_finite_and_checked():
    serve = load_params(REPO / "params.yaml").serve
    assert 0 < serve.max_body_bytes <= 16 * 2**20 and 0 < serve.max_prompt_tokens and 0 < serve.max_queue
    assert 0 < serve.default_max_tokens <= serve.max_tokens_limit
    with pytest.raises(Exception, match="serve.max_body_bytes must be >= 1"):
        check_serve_params(type(serve)(**{**vars(serve), "max_body_bytes": 0}))


def test_a_body_over_the_limit_is_refused_before_the_app_reads_it():
    async def app(scope, receive, send):  # reads the whole body, then answers 200
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def post(body: bytes) -> httpx.Response:
        transport = httpx.ASGITransport(app=Guards(app, api_key=None, max_body_bytes=1024))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", content=body)

    assert asyncio.run(post(b"x" * 1024)).status_code == 200
    response = asyncio.run(post(b"x" * 1025))
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
