"""Fixtures for the export tests: one tiny target per session, and one exported project per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from export_helpers import make_project, save_tiny_target, target_params


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A saved random tiny Llama (6 layers, hidden 32, vocab 300, tied LM head) + tokenizer."""
    return save_tiny_target(tmp_path_factory.mktemp("export_target") / "llama", "llama")


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    """The tiny target loaded through load_target (fp32, cpu)."""
    from dominospec.target import load_target

    return load_target(target_params(tiny_target_dir))


@pytest.fixture(scope="session")
def exported(tmp_path_factory, tiny_target_dir, tiny_target):
    """A project whose head-on checkpoint went through the export stage -> its loaded Params."""
    from dominospec.config import load_params
    from dominospec.export.stage import export

    root = tmp_path_factory.mktemp("exported")
    params = load_params(make_project(root, tiny_target_dir, tiny_target.identity.as_dict()))
    export(params)
    return params
