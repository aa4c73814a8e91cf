"""Fuzzed params files: the repo's params.yaml with one key deleted, added or given a random value,
and raw bytes. Every file loads as typed Params or raises ParamsError naming the file and the key.
Run: python -m pytest tests/fuzz/test_fuzz_params.py -q
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import yaml
from fuzz_helpers import JSON, fuzz
from hypothesis import given
from hypothesis import strategies as st

from dominospec.config import as_flat_dict, load_params
from dominospec.errors import ParamsError

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "params.yaml").read_text())
KEYS = sorted(as_flat_dict(load_params(REPO / "params.yaml")))  # "section.key"
SECTIONS = sorted(BASE)
DIR = Path(tempfile.mkdtemp(prefix="fuzz_params_"))
YAML_VALUES = st.one_of(JSON, st.sampled_from(["1e-4", "auto", "nan", "inf", "0x10", "", "~", "null"]))


def write(text: bytes) -> Path:
    path = DIR / "params.yaml"
    path.write_bytes(text)
    return path


def mutate(raw: dict, key: str, op: str, value) -> str:
    """Apply one edit to the params dict -> the dotted key the error must name."""
    *path, name = key.split(".")  # nested sections: engine.tree.children
    parent = raw
    for part in path:
        parent = parent[part]
    if op == "delete":
        del parent[name]
    elif op == "add":
        parent[name + "_x"] = value
        return key + "_x"
    elif op == "section":
        raw[path[0]] = value
        return path[0]
    else:
        parent[name] = value
    return key


@given(key=st.sampled_from(KEYS), op=st.sampled_from(["delete", "add", "replace", "replace", "section"]),
       value=YAML_VALUES)
@fuzz(300)
def test_one_edit_loads_typed_or_names_the_key(key, op, value):
    raw = copy.deepcopy(BASE)
    named = mutate(raw, key, op, value)
    path = write(yaml.safe_dump(raw, allow_unicode=False).encode())
    try:
        params = load_params(path)
    except ParamsError as err:
        assert str(err).startswith(f"{path}: ") or str(err).startswith("params.yaml: "), err
        assert f"'{named}" in str(err), (named, str(err))  # the key itself, or one of its items ('key[0]', 'key.sub')
        return
    assert op in ("replace", "section")  # deleted and unknown keys never load
    flat = as_flat_dict(params)
    assert set(flat) == set(KEYS)
    base = BASE
    for part in key.split("."):
        base = base[part]
    if op == "replace" and isinstance(value, str) and isinstance(base, float):
        assert isinstance(flat[key], float)


@given(text=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                      st.sampled_from([b"\xff\xfe", b"[" * 5000, b"a: &a [*a]", b"{" * 200 + b"}" * 200, b"- - -"])))
@fuzz(300)
def test_any_bytes_load_or_raise_a_params_error(text):
    path = write(text)
    try:
        load_params(path)
    except ParamsError as err:
        assert str(err).startswith(f"{path}: ") or str(err).startswith("params.yaml: "), err
        return
    raise AssertionError("random bytes never make a complete params file")


def test_a_directory_or_a_missing_file_is_named():
    for path in (DIR, DIR / "missing.yaml"):
        try:
            load_params(path)
        except ParamsError as err:
            assert str(path) in str(err)
        else:
            raise AssertionError(path)
