"""One `dominospec serve` process for all of tests/serve (tiny project, see serve_helpers.py), the
served target loaded in-process as the reference, and an authorised HTTP client."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import KEY, KEY_ENV, SERVE, ServerProcess, tiny_project


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    process = ServerProcess(tiny_project(root, **SERVE), root / "server.log", env={KEY_ENV: KEY})
    try:
        yield process.start()
    finally:
        process.stop()


@pytest.fixture(scope="session")
def target(server):
    """The served target, loaded in this process: the reference for losslessness."""
    from dominospec.config import load_params
    from dominospec.target import load_target

    return load_target(load_params(server.params).target)


@pytest.fixture(scope="session")
def reference(server, target):
    """(prompt ids, max_new_tokens) -> the target's own greedy Generation (AR, in-process)."""
    import dataclasses

    from dominospec.config import load_params
    from dominospec.engine import SpecEngine

    params = dataclasses.replace(load_params(server.params).engine, linear="torch")
    engine = SpecEngine(target, None, "ar", params=params)
    return lambda ids, n: engine.generate(ids, n)


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c
