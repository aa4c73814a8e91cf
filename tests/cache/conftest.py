"""Fixtures for the cache tests: tiny targets saved once per session and loaded through load_target."""

from __future__ import annotations

from pathlib import Path

import pytest
from cache_helpers import save_tiny_target, target_params


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory) -> dict[str, Path]:
    """{'llama': dir, 'qwen3': dir} of saved tiny targets, built once per session."""
    root = tmp_path_factory.mktemp("targets")
    return {arch: save_tiny_target(root / arch, arch) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def loaded_targets(tiny_targets):
    """{'llama': Target, 'qwen3': Target} loaded through load_target."""
    from dominospec.target import load_target

    return {arch: load_target(target_params(d)) for arch, d in tiny_targets.items()}
