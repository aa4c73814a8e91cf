"""The `card` stage: the exported draft's README.md quotes this run's evaluation of these very weights, or says
why it does not (missing, or measured on other weights), and never shows another draft's numbers.

Run: python -m pytest tests/export/test_model_card.py -q
"""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from dominospec.card.render import sglang_lines
from dominospec.card.stage import card
from dominospec.cli import stage_main
from dominospec.errors import UserError
from dominospec.eval.headline import headline_rows
from dominospec.export import check_export_dir
from dominospec.files import sha256_file, write_json


@pytest.fixture
def project(exported, tmp_path):
    """A copy of the exported project (draft dir + metrics) of its own -> its Params."""
    for name in ("draft", "metrics"):
        shutil.copytree(getattr(exported.paths, name), tmp_path / name)
    paths = dataclasses.replace(exported.paths, draft=str(tmp_path / "draft"), metrics=str(tmp_path / "metrics"))
    return dataclasses.replace(exported, paths=paths)


def weights_sha(params) -> str:
    return sha256_file(Path(params.paths.draft) / "model.safetensors")


def write_evaluation(params, draft_sha256: str) -> None:
    """eval.json and serve_eval.json as the evaluate and serve_eval stages write them (the keys the card reads)."""
    metrics = Path(params.paths.metrics)
    modes = {"ar": {"acceptance_length": 1.0, "acceptance_length_se": 0.0, "tokens_per_s": 24.35, "speedup": 1.0,
                    "speedup_se": None, "exact_match": None},
             "domino": {"acceptance_length": 2.2354, "acceptance_length_se": 0.1063, "tokens_per_s": 45.716,
                        "speedup": 1.8772, "speedup_se": 0.0907, "exact_match": 1.0}}
    write_json(metrics / "eval.json", {
        "draft_sha256": draft_sha256, "spec_mode": "domino", "temperature": 0.0, "max_new_tokens": 128, "block_size": 4,
        "num_draft_setting": "auto", "num_draft": 3, "dtype": "float32", "device": "cpu", "device_name": "x86_64",
        "versions": {"torch": "2.13.0"}, "sampled_temperature": None,
        "suites": {"sharegpt": {"n_prompts": 16, "acceptance_length": 2.2354, "speedup": 1.8772,
                                "speedup_over_ngram": 1.1713, "exact_match": 1.0, "modes": modes}},
    })
    level = {"acceptance_length": 1.9248, "tokens_per_s": 31.2457, "latency_p50_s": 2.116, "errors": 0}
    write_json(metrics / "serve_eval.json", {
        "draft_sha256": draft_sha256, "backend": "builtin", "serve_mode": "domino", "max_prompts": 4,
        "max_new_tokens": 64, "temperature": 0.0, "date": "2026-12-06T16:59:26+00:00", "empty_suites": {},
        "suites": {"sharegpt": {"c1": {**level, "concurrency": 1}, "c4": {**level, "concurrency": 4, "tokens_per_s": 31.7439}}},
    })


def write_headline(params) -> None:
    metrics = Path(params.paths.metrics)
    write_json(metrics / "headline.json",
               headline_rows(metrics / "eval.json", metrics / "serve_eval.json", params.headline.digits))


NUMBERS = ("2.235", "1.877", "31.25", "31.74")  # τ, × AR, served tokens/s at c = 1 and c = 4, as the card prints them


def test_a_card_before_evaluate_says_the_draft_awaits_it(project):
    text = card(project)
    readme = Path(project.paths.draft) / "README.md"
    assert readme.read_text() == text
    assert sorted(p.name for p in readme.parent.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert check_export_dir(project.paths.draft) == []  # the card leaves the export SGLang loads as it was
    assert weights_sha(project) in text
    assert text.count("Not measured yet") == 3  # eval.json, serve_eval.json, headline.json
    for row in ("| val_acceptance_length | 2.346 |", "| conversations_read | 17 |", "| skipped.empty | 2 |",
                "| tokens | 4321 |", "| gru_hidden_dim (G) | 20 |", "| target_layer_ids | [1, 3] |"):
        assert row in text, row
    assert "gru_hidden_dim: 20" in text and f"max_steps: {project.train.max_steps}" in text  # draft + train params
    # fp32 target: the card says why SGLang cannot serve it instead of showing a launch that fails
    assert "SGLang cannot serve it as configured: target.dtype: SGLang's Domino runtime needs bfloat16" in text
    assert "--speculative-domino-candidate-pool-size" not in text  # no flag advice for a launch that cannot run
    assert "make serve" in text
    assert "license:" not in text


def test_the_card_quotes_this_runs_evaluation_of_these_weights(project):
    write_evaluation(project, weights_sha(project))
    write_headline(project)
    text = card(project)
    assert "Not measured yet" not in text and "Not quoted" not in text
    assert "| sharegpt | 2.235 | 1.877 | 1.171 | 1 | 1.925 | 31.25 |" in text  # headline.json's row
    assert "| domino | 2.235 ± 0.11 | 45.72 | 1.877 ± 0.091 | 1 |" in text  # eval.json's modes
    assert "| sharegpt | 4 | 1.925 | 31.74 | 2.116 | 0 |" in text  # serve_eval.json at c = 4
    assert "on x86_64 (cpu), torch 2.13.0" in text and "builtin backend (mode `domino`)" in text


@pytest.mark.parametrize("stale", ["eval.json", "serve_eval.json"])
def test_an_evaluation_of_other_weights_is_not_quoted(project, stale):
    """A document of another draft is named, its numbers left out, and so is headline.json built on it."""
    write_evaluation(project, weights_sha(project))
    write_headline(project)
    path = Path(project.paths.metrics) / stale
    path.write_text(json.dumps({**json.loads(path.read_text()), "draft_sha256": "f" * 64}))
    text = card(project)
    assert f"`{path}` describes draft weights ffffffffffff, not these ({weights_sha(project)[:12]})" in text
    assert "`headline.json` sums up" in text.replace(f"`{path.parent}/", "`") and "1.171" not in text
    kept = "31.74" if stale == "eval.json" else "45.72"  # the other document still describes these weights
    assert kept in text and [n for n in NUMBERS if n in text] == (["31.25", "31.74"] if stale == "eval.json"
                                                                    else ["2.235", "1.877"])


def test_a_headline_of_an_older_run_is_not_quoted(project):
    write_evaluation(project, weights_sha(project))
    write_headline(project)
    path = Path(project.paths.metrics) / "headline.json"
    rows = json.loads(path.read_text())
    rows["sharegpt"]["tau"] = 9.875  # not what eval.json on these weights gives
    path.write_text(json.dumps(rows))
    text = card(project)
    assert "does not hold the numbers of eval.json and serve_eval.json on these weights" in text
    assert "9.875" not in text and "| domino | 2.235" in text


def test_an_incomplete_export_gets_no_card(project):
    (Path(project.paths.draft) / "model.safetensors").unlink()
    with pytest.raises(UserError, match="is not a complete export.*model.safetensors is missing"):
        card(project)
    assert not (Path(project.paths.draft) / "README.md").exists()


def test_the_license_goes_into_the_front_matter(project):
    licensed = dataclasses.replace(project, card=dataclasses.replace(project.card, license="apache-2.0"))
    assert card(licensed).splitlines()[:3] == ["---", 'base_model: "llama"', 'license: "apache-2.0"']


def test_the_pipeline_script_writes_the_card(project, tmp_path):
    import yaml

    raw = yaml.safe_load(Path(project.source).read_text())
    raw["paths"].update(draft=project.paths.draft, metrics=project.paths.metrics)
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert stage_main("card", ["--params", str(params_file)]) == 0
    assert weights_sha(project) in (Path(project.paths.draft) / "README.md").read_text()


def test_model_card_sglang_launch_is_the_one_make_serve_runs(exported, tiny_target_dir):
    """A bf16 HF target: the card shows exactly the argv `dominospec serve --backend sglang` executes."""
    params = dataclasses.replace(exported, target=dataclasses.replace(exported.target, dtype="bfloat16"))
    config = json.loads((Path(exported.paths.draft) / "config.json").read_text())
    draft, serve = exported.paths.draft, exported.serve
    assert sglang_lines(params, config)[1] == (
        f"python -m sglang.launch_server --model-path {tiny_target_dir} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {draft} --speculative-num-draft-tokens 4 "
        f"--host {serve.host} --port {serve.port} --dtype bfloat16"
        + "".join(f" {a}" for a in serve.sglang_args)
    )
