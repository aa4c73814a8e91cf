"""Presets (params/NAME.yaml) hold only what differs from params.yaml; `dominospec preset NAME` writes
one into params.yaml, checked first and atomically, keeping the file's comments."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dominospec.config import ParamsError, load_params, read_params
from dominospec.presets import apply_preset, preset_names

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "params").glob("*.yaml"))


def comments(text: str) -> list[str]:
    """The comments of a YAML text (whole-line and end-of-line), stripped; none of our values holds a '#'."""
    return [line.split("#", 1)[1].strip() for line in text.splitlines() if "#" in line and line.split("#", 1)[1].strip()]


def leaves(raw: dict, prefix: str = ""):
    """A raw params mapping -> (dotted key, value) for every non-mapping value."""
    for key, value in raw.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.fixture
def checkout(tmp_path):
    """A copy of params.yaml and params/ -> the copy's params.yaml."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO / "params", tmp_path / "params")
    return tmp_path / "params.yaml"


def test_there_are_presets():
    assert [p.stem for p in PRESETS] == preset_names(REPO / "params.yaml") and PRESETS


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_a_preset_resolves_to_full_valid_params(preset):
    params = load_params(preset)  # every key present and typed, or it raises
    assert params.source == preset and params.target.model and params.draft.block_size > 1


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_a_preset_says_only_what_differs(preset):
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    flat_base = dict(leaves(base))
    same = [key for key, value in leaves(yaml.safe_load(preset.read_text())) if flat_base.get(key) == value]
    assert not same, f"{preset.name} repeats params.yaml's values of {same}"
    repeated = set(comments(preset.read_text())) & set(comments((REPO / "params.yaml").read_text()))
    assert not repeated, f"{preset.name} repeats params.yaml's comments {sorted(repeated)}"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_applying_a_preset_writes_what_it_loads_as_and_keeps_the_comments(checkout, preset):
    before = checkout.read_text()
    changed = apply_preset(preset.stem, checkout)
    after = checkout.read_text()
    # against the preset over the untouched params.yaml of the repository, not over the file just rewritten
    # (an edit outside the preset's keys would show on both sides of that)
    assert yaml.safe_load(after) == read_params(preset)
    assert load_params(checkout) == load_params(preset)
    assert sorted(changed) == sorted(key for key, _ in leaves(yaml.safe_load(preset.read_text())))
    assert after.startswith(f"# preset: {preset.stem};")
    overridden = {key.rsplit(".", 1)[1] for key in changed}
    for line in before.splitlines():  # every comment survives, except an override's, which the preset replaced
        key = re.match(r"\s*(\w+):", line)
        if "#" in line and not (key and key.group(1) in overridden):
            assert line.split("#", 1)[1].strip() in after, line
    assert apply_preset(preset.stem, checkout) == [] and checkout.read_text() == after  # idempotent


def test_a_second_preset_is_refused_and_the_default_restores(checkout):
    first, second = preset_names(checkout)[:2]
    apply_preset(first, checkout)
    written = checkout.read_bytes()
    with pytest.raises(ParamsError, match=f"preset '{first}' is already applied.*before taking '{second}'"):
        apply_preset(second, checkout)
    assert checkout.read_bytes() == written


@pytest.mark.parametrize(
    "text, message",
    [
        ("engine:\n  candidate_poool: 64\n", "params/bad.yaml (over params.yaml): unknown key 'engine.candidate_poool'"),
        ("train:\n  max_steps: many\n", "params/bad.yaml (over params.yaml): 'train.max_steps' must be int, got str"),
        ("draft: 4\n", "params/bad.yaml (over params.yaml): 'draft' must be a mapping"),
        ("[1, 2]\n", "params/bad.yaml (over params.yaml): a preset must be a mapping"),
        ("train: {max_steps: [unclosed\n", "bad.yaml: not valid YAML"),
    ],
)
def test_a_bad_preset_names_the_key_and_leaves_params_yaml_untouched(checkout, text, message):
    (checkout.parent / "params" / "bad.yaml").write_text(text)
    before = checkout.read_bytes()
    with pytest.raises(ParamsError) as err:
        apply_preset("bad", checkout)
    assert message in str(err.value)
    assert checkout.read_bytes() == before
    assert sorted(p.name for p in checkout.parent.iterdir()) == ["params", "params.yaml"]  # no temporary left


def test_an_unknown_preset_lists_the_known_ones(checkout):
    with pytest.raises(ParamsError, match="no preset 'qwen3-9b': params/ holds qwen3-8b, smollm2-h100-draft, smollm2-h200"):
        apply_preset("qwen3-9b", checkout)


def test_read_params_overlays_mappings_and_replaces_lists(checkout):
    (checkout.parent / "params" / "small.yaml").write_text("evaluate:\n  suites: [humaneval]\n  max_prompts: 2\n")
    raw = read_params(checkout.parent / "params" / "small.yaml")
    base = yaml.safe_load(checkout.read_text())
    assert raw["evaluate"]["suites"] == ["humaneval"] and raw["evaluate"]["max_prompts"] == 2
    assert raw["evaluate"]["max_new_tokens"] == base["evaluate"]["max_new_tokens"] and raw["cache"] == base["cache"]


def test_the_preset_command_reports_errors_in_one_line(checkout):
    run = [sys.executable, "-m", "dominospec.cli", "preset"]
    bad = subprocess.run([*run, "nope"], cwd=checkout.parent, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: no preset 'nope'") and "Traceback" not in bad.stderr
    good = subprocess.run([*run, "smollm2-h200"], cwd=checkout.parent, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith("params.yaml: preset smollm2-h200,") and "draft.num_layers" in good.stdout
