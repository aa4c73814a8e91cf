"""params.yaml is loaded once into typed frozen sections; bad params fail before any work, naming the key."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dominospec.config import ParamsError, as_flat_dict, load_params

REPO = Path(__file__).resolve().parents[1]


def write_params(tmp_path, mutate):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    mutate(raw)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_default_params_load_typed_and_frozen():
    params = load_params(REPO / "params.yaml")
    assert params.cache.num_feature_layers == 5
    assert isinstance(params.prepare.val_fraction, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.cache.batch_tokens = 1


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r["cache"].update(layres=[1]), "unknown key 'cache.layres'"),
        (lambda r: r.update(trainn={}), "unknown key 'trainn'"),
        (lambda r: r["cache"].pop("shard_tokens"), "missing key 'cache.shard_tokens'"),
        (lambda r: r["cache"].update(batch_tokens="many"), "'cache.batch_tokens' must be int"),
        (lambda r: r["cache"].update(batch_tokens=True), "'cache.batch_tokens' must be int"),
        (lambda r: r["cache"].update(layer_ids=[1, "x"]), "'cache.layer_ids[1]' must be int"),
        (lambda r: r["target"].update(dtype="float8"), "'target.dtype' must be one of"),
        (lambda r: r["prepare"].update(val_fraction="a lot"), "'prepare.val_fraction' must be float"),
        (lambda r: r.update(paths=[1, 2]), "'paths' must be a mapping"),
        (lambda r: r["engine"]["tree"].update(shape="wide"), "'engine.tree.shape' must be one of"),
        (lambda r: r["engine"]["tree"].pop("nodes"), "missing key 'engine.tree.nodes'"),
        (lambda r: r["engine"].update(tree=4), "'engine.tree' must be a mapping"),
    ],
)
def test_bad_params_name_the_key(tmp_path, mutate, message):
    path = write_params(tmp_path, mutate)
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert message in str(err.value)
    assert str(err.value).startswith("params.yaml:")


def test_scientific_floats_and_ints_are_accepted_as_floats(tmp_path):
    path = write_params(tmp_path, lambda r: r["prepare"].update(val_fraction="2e-2", test_fraction=0))
    params = load_params(path)
    assert params.prepare.val_fraction == 0.02 and params.prepare.test_fraction == 0.0


def test_broken_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("paths: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)
    with pytest.raises(ParamsError, match="no such params file"):
        load_params(tmp_path / "nope.yaml")


def test_flat_dict_has_dotted_keys():
    flat = as_flat_dict(load_params(REPO / "params.yaml"))
    assert flat["cache.num_feature_layers"] == 5
    assert "source" not in flat


def test_stage_script_rejects_bad_params_before_work(tmp_path):
    path = write_params(tmp_path, lambda r: r["cache"].update(layres=[1]))
    proc = subprocess.run(
        [sys.executable, str(REPO / "pipeline" / "cache.py"), "--params", str(path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown key 'cache.layres'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("old", ["tree_nodes", "tree_children"])
def test_the_old_tree_keys_fail_naming_what_replaced_them(tmp_path, old):
    """engine.tree_nodes / tree_children became the engine.tree family; no alias."""
    path = write_params(tmp_path, lambda r: r["engine"].update({old: 4}))
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value) == f"params.yaml: unknown key 'engine.{old}': replaced by engine.{old.replace('tree_', 'tree.')}"


@pytest.mark.parametrize("edit, key", [
    (lambda r: r["engine"].update(tree_width=4), "unknown key 'engine.tree_width'"),
    (lambda r: r["engine"]["tree"].update(width=4), "unknown key 'engine.tree.width'"),
    (lambda r: r["engine"]["tree"].update(shape="first_token"), "'engine.tree.shape' must be one of ['best_first', 'chain']"),
])
def test_the_first_token_tree_s_params_fail_saying_it_is_retired(tmp_path, edit, key):
    """The first-token tree is gone: its width, in either spelling, and its shape name each fail, naming
    the key and DominoTree's budget."""
    with pytest.raises(ParamsError) as err:
        load_params(write_params(tmp_path, edit))
    assert key in str(err.value) and "first-token tree is retired" in str(err.value)
    assert "engine.tree.nodes" in str(err.value)


def test_the_default_tree_is_dominotree_of_16_nodes_and_4_children():
    tree = load_params(REPO / "params.yaml").engine.tree
    assert (tree.shape, tree.nodes, tree.children) == ("best_first", 16, 4)
    flat = as_flat_dict(load_params(REPO / "params.yaml"))
    assert flat["engine.tree.shape"] == "best_first" and "engine.tree" not in flat
