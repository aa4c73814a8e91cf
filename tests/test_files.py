"""dominospec.files: atomic writes leave the old or the new content, never a partial file."""

import errno
import json
import os

import pytest

from dominospec import files
from dominospec.errors import UserError


def test_write_json_replaces_atomically_with_sorted_keys(tmp_path):
    path = tmp_path / "deep" / "m.json"
    files.write_json(path, {"b": 1, "a": [1, 2]})
    assert path.read_text() == json.dumps({"a": [1, 2], "b": 1}, indent=2) + "\n"
    files.write_json(path, {"c": 3})
    assert json.loads(path.read_text()) == {"c": 3}
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.json"]


def test_full_disk_keeps_the_old_file_and_names_it(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    files.write_json(path, {"old": True})

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(UserError, match=r"disk full while writing .*m\.json .*MiB free"):
        files.write_json(path, {"new": True})
    assert json.loads(path.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_other_os_errors_propagate_unchanged(tmp_path, monkeypatch):
    def denied(fd):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(os, "fsync", denied)
    with pytest.raises(PermissionError):
        files.write_atomic(tmp_path / "x.bin", b"123")
    assert list(tmp_path.iterdir()) == []


def test_replace_path_swaps_a_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    tmp = files.temp_sibling(out)
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    files.replace_path(tmp, out)
    assert [p.name for p in out.iterdir()] == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_sha256_file_matches_hashlib(tmp_path):
    import hashlib

    data = os.urandom(files.CHUNK + 123)  # crosses a chunk boundary
    (tmp_path / "blob").write_bytes(data)
    assert files.sha256_file(tmp_path / "blob") == hashlib.sha256(data).hexdigest()


def test_source_digest_follows_content_and_names_not_caches(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "b.py").write_text("y = 2\n")
    before = files.source_digest({"pkg": root})
    (root / "sub" / "__pycache__").mkdir()
    (root / "sub" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"compiled")
    (root / "notes.txt").write_text("not code")
    assert files.source_digest({"pkg": root}) == before
    (root / "a.py").write_text("x = 2\n")
    edited = files.source_digest({"pkg": root})
    assert edited != before
    (root / "a.py").rename(root / "c.py")
    assert files.source_digest({"pkg": root}) not in (before, edited)  # same bytes under another name


def test_code_digest_covers_the_package_its_models_and_kernels():
    import importlib.util
    from pathlib import Path

    folders = {name: Path(importlib.util.find_spec(name).submodule_search_locations[0]) for name in files.CODE_PACKAGES}
    assert (folders["dominospec.models"] / "domino" / "modeling_domino.py").is_file()  # the draft's code
    assert next(folders["dominospec.kernels"].glob("*.py"), None) is not None  # the Triton kernels
    expected = files.source_digest({f"{name}:0": folder for name, folder in folders.items()})
    assert files.code_digest() == expected  # all three folders, none left out
