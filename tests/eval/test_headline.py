"""The `headline` stage: a few numbers per suite from small eval.json / serve_eval.json fixtures, and errors that
name the missing key and its file.
Run: python -m pytest tests/eval/test_headline.py -q
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from dominospec.config import load_params
from dominospec.errors import UserError
from dominospec.eval.headline import ENGINE_KEYS, headline, headline_rows

REPO = Path(__file__).resolve().parents[2]
SHA = "ab" * 32

EVAL = {"draft_sha256": SHA, "spec_mode": "domino", "suites": {
    "sharegpt": {"acceptance_length": 2.107883, "speedup": 1.830139, "speedup_over_ngram": 1.141284,
                 "exact_match": 1.0, "n_prompts": 16, "modes": {"ar": {"tokens_per_s": 23.3}}},
    "humaneval": {"acceptance_length": 2.143546, "speedup": 1.7712, "speedup_over_ngram": 1.0834,
                  "exact_match": 0.9375, "n_prompts": 16},
}}
SERVED = {"draft_sha256": SHA, "backend": "builtin", "empty_suites": {}, "suites": {
    "sharegpt": {"c1": {"acceptance_length": 2.05449, "tokens_per_s": 31.4159}, "c4": {"tokens_per_s": 30.0}},
    "humaneval": {"c1": {"acceptance_length": None, "tokens_per_s": 29.0001}, "c4": {"tokens_per_s": 28.0}},
}}


def write(tmp_path: Path, engine: dict, served: dict) -> tuple[Path, Path]:
    (tmp_path / "eval.json").write_text(json.dumps(engine))
    (tmp_path / "serve_eval.json").write_text(json.dumps(served))
    return tmp_path / "eval.json", tmp_path / "serve_eval.json"


def test_the_stage_writes_a_few_rounded_numbers_per_suite(tmp_path, capsys):
    write(tmp_path, EVAL, SERVED)
    params = load_params(REPO / "params.yaml")
    params = dataclasses.replace(params, paths=dataclasses.replace(params.paths, metrics=str(tmp_path)),
                                 headline=dataclasses.replace(params.headline, digits=2))
    rows = headline(params)
    assert json.loads((tmp_path / "headline.json").read_text()) == rows == {
        "sharegpt": {"tau": 2.11, "speedup_vs_ar": 1.83, "speedup_vs_ngram": 1.14, "exact_match": 1.0,
                     "served_tau": 2.05, "served_tokens_per_s": 31.42},
        "humaneval": {"tau": 2.14, "speedup_vs_ar": 1.77, "speedup_vs_ngram": 1.08, "exact_match": 0.94,
                      "served_tau": None, "served_tokens_per_s": 29.0},  # no meta_info: the served τ is unknown
    }
    assert "sharegpt: tau 2.11, speedup_vs_ar 1.83" in capsys.readouterr().out


def test_a_suite_the_served_run_found_empty_has_no_served_numbers(tmp_path):
    served = copy.deepcopy(SERVED)
    del served["suites"]["humaneval"]
    served["empty_suites"] = {"humaneval": "no prompt of at most 1024 tokens (3 longer)"}
    rows = headline_rows(*write(tmp_path, EVAL, served), digits=3)
    assert rows["humaneval"]["served_tau"] is None and rows["humaneval"]["served_tokens_per_s"] is None
    assert rows["humaneval"]["tau"] == 2.144


@pytest.mark.parametrize("file, path, key", [
    ("eval.json", ["suites", "humaneval", "speedup_over_ngram"], "suites.humaneval.speedup_over_ngram"),
    ("eval.json", ["suites"], "suites"),
    ("serve_eval.json", ["suites", "sharegpt", "c1"], "suites.sharegpt.c1"),
    ("serve_eval.json", ["suites", "humaneval"], "suites.humaneval"),
])
def test_a_missing_key_names_the_key_and_the_file(tmp_path, file, path, key):
    documents = {"eval.json": copy.deepcopy(EVAL), "serve_eval.json": copy.deepcopy(SERVED)}
    parent = documents[file]
    for step in path[:-1]:
        parent = parent[step]
    del parent[path[-1]]
    eval_json, serve_json = write(tmp_path, documents["eval.json"], documents["serve_eval.json"])
    with pytest.raises(UserError, match=rf"^{tmp_path / file}: no key '{key}'"):
        headline_rows(eval_json, serve_json, digits=3)


def test_other_unusable_inputs_are_named(tmp_path):
    eval_json, serve_json = write(tmp_path, EVAL, dict(SERVED, draft_sha256="cd" * 32))
    with pytest.raises(UserError, match="describe different drafts"):
        headline_rows(eval_json, serve_json, digits=3)
    broken = copy.deepcopy(EVAL)
    broken["suites"]["sharegpt"]["speedup"] = "fast"
    eval_json, serve_json = write(tmp_path, broken, SERVED)
    with pytest.raises(UserError, match=r"eval\.json: 'suites\.sharegpt\.speedup' must be a number, got 'fast'"):
        headline_rows(eval_json, serve_json, digits=3)
    serve_json.unlink()
    with pytest.raises(UserError, match=r"serve_eval\.json: no such metrics file"):
        headline_rows(eval_json, serve_json, digits=3)


def test_the_keys_are_those_the_evaluate_stage_writes():
    """The committed eval.json (the evaluate stage's own output) has every key the headline reads."""
    report = json.loads((REPO / "metrics" / "eval.json").read_text())
    for suite, entry in report["suites"].items():
        missing = [source for source in ENGINE_KEYS.values() if source not in entry]
        assert not missing, (suite, missing)
