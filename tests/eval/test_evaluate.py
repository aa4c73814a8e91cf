"""The `evaluate` stage and the `generate` / `evaluate` commands on a tiny setup.

A random 4-layer Llama saved with save_pretrained (word-level tokenizer with a chat template), a
random draft in checkpoints/final, a prepared dataset with a ShareGPT-style test split, and a
private MLflow store. fp32 greedy: spec output must equal AR output on every prompt.
Run: python -m pytest tests/eval -q
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from dominospec.cli import main
from dominospec.errors import UserError
from dominospec.config import load_params
from dominospec.eval.prompts import humaneval_conversations, jsonl_conversations
from dominospec.eval.stage import evaluate
from dominospec.files import sha256_file

REPO = Path(__file__).resolve().parents[2]
from engine_helpers import engine_params, fit_draft, tiny_draft, tiny_tokenizer  # noqa: E402

VOCAB = 64
TRAIN_RUN_ID = "0123456789abcdef"


def save_target(directory: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    tiny_tokenizer(VOCAB).save_pretrained(directory)
    return directory


def save_prepared(directory: Path, identity: dict) -> None:
    from datasets import Dataset, DatasetDict

    from dominospec.data.dataset import FEATURES, write_dataset

    def split(n: int, offset: int) -> Dataset:
        rows = [{"id": f"c{offset + i}", "input_ids": [5], "loss_mask": [0], "num_tokens": 1,
                 "messages": [{"role": "system", "content": "t9"}, {"role": "user", "content": f"t{10 + i} t11 t12"},
                              {"role": "assistant", "content": "t13"}, {"role": "user", "content": "t14"}]}
                for i in range(n)]
        return Dataset.from_list(rows, features=FEATURES)

    meta = {"format_version": 1, "target": identity, "mask_token_id": VOCAB - 1, "max_length": 64, "source": "test"}
    write_dataset(directory, DatasetDict({"train": split(2, 0), "val": split(1, 10), "test": split(3, 20)}), meta)


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


MINE = [  # a prompts file of the three kinds: a prompt, a blank line, a conversation
    json.dumps({"prompt": "t5 t6 t7 t8"}),
    "",
    json.dumps({"messages": [{"role": "user", "content": "t20 t21"}, {"role": "assistant", "content": "t22"},
                             {"role": "user", "content": "t23 t24 t25"}]}),
    json.dumps({"prompt": "t30 t31"}),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """-> (params path, root): tiny target, draft in checkpoints/final, prepared data, MLflow store."""
    from dominospec.target import load_target

    root = tmp_path_factory.mktemp("eval")
    target_dir = save_target(root / "target")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for key in raw["paths"]:
        raw["paths"][key] = str(root / key)
    raw["target"].update(model=str(target_dir), gguf_file=None, device="cpu", dtype="float32")
    # both comparisons on, as in the GPU presets (the CPU default turns the sampled pass off for time; tested below)
    # K fixed at B - 1: what the drafts accept is then the draft's alone (auto-K's follows the host's load;
    # it has its own test below)
    raw["evaluate"].update(suites=["sharegpt"], max_prompts=4, max_new_tokens=12, num_threads=1,
                           sampled_temperature=0.7, chain_comparison=True, num_draft=None)
    raw["mlflow"].update(tracking_uri=f"sqlite:///{root}/mlflow.db", artifact_location=str(root / "mlartifacts"))
    params_path = root / "params.yaml"
    params_path.write_text(yaml.safe_dump(raw))

    params = load_params(params_path)
    target = load_target(params.target)
    save_prepared(Path(params.paths.prepared), target.identity.as_dict())
    mine = write_jsonl(root / "mine.jsonl", MINE)
    trained_draft(params, target, [str(mine), "sharegpt"]).save_pretrained(Path(params.paths.checkpoints) / "final")
    (Path(params.paths.checkpoints) / "run.json").write_text(json.dumps({"mlflow_run_id": TRAIN_RUN_ID}))
    return params_path, root


def trained_draft(params, target, specs: list[str]):
    """A B = 4 draft trained on the target's greedy replies to the suites' prompts (engine_helpers.fit_draft),
    so that the evaluation's drafts are accepted: its τ then tells a working draft path from a broken one."""
    from dominospec.engine import SpecEngine
    from dominospec.eval.prompts import load_suite

    cfg = params.evaluate
    prompts = [p for spec in specs for p in load_suite(spec, target.tokenizer, params.target.chat_template_kwargs,
                                                       params.paths.prepared, cfg.max_prompts, cfg.max_prompt_tokens).prompts]
    ar = SpecEngine(target, None, "ar", params=engine_params())
    replies = [ar.generate(p, cfg.max_new_tokens).token_ids for p in prompts]
    return fit_draft(target, tiny_draft(target, block_size=4), prompts, replies, steps=100)




def test_evaluate_writes_consistent_report_plots_and_mlflow_run(setup, tmp_path):
    params_path, root = setup
    prompts = write_jsonl(tmp_path / "mine.jsonl", MINE)
    params = load_params(params_path)
    report = evaluate(params, prompts=str(prompts))
    written = json.loads((Path(params.paths.metrics) / "eval.json").read_text())
    assert written == json.loads(json.dumps(report))

    assert set(report["suites"]) == {"mine"}
    suite = report["suites"]["mine"]
    required = {"n_prompts", "new_tokens", "acceptance_length", "acceptance_length_no_head", "ar_tokens_per_s",
                "spec_tokens_per_s", "speedup", "exact_match"}
    assert required <= set(suite)
    assert suite["n_prompts"] == 3 and suite["skipped_too_long"] == 0
    assert suite["exact_match"] == suite["exact_match_no_head"] == 1.0 and suite["divergences"] == []
    assert suite["new_tokens"] == suite["ar_new_tokens"] <= 3 * 12
    # the draft (trained on these prompts' greedy replies) is accepted: τ well above one plain step
    assert 1.5 < suite["acceptance_length"] <= report["block_size"], suite["acceptance_length"]
    assert suite["acceptance_by_position"][0] > 0.5
    assert suite["speedup"] == pytest.approx(suite["spec_tokens_per_s"] / suite["ar_tokens_per_s"]) and suite["speedup"] > 0
    # every mode on the same prompts, one schema; prompt lookup reported beside the draft's modes
    assert set(suite["modes"]) == {"ar", "ngram", "dflash", "domino", "domino_chain"}
    # Domino is DominoTree (engine.tree.shape best_first), its chain beside it: exact too
    assert suite["modes"]["domino"]["tree_round_share"] > 0 and suite["modes"]["domino_chain"]["tree_round_share"] == 0
    assert suite["modes"]["domino_chain"]["exact_match"] == 1.0 and suite["modes"]["domino_chain"]["acceptance_length"] > 1.5
    # the sampled pass: AR, head off, Domino and its chain at evaluate.sampled_temperature, τ and speed-up with SEs
    sampled = suite["sampled"]
    assert report["sampled_temperature"] == sampled["temperature"] == params.evaluate.sampled_temperature > 0
    assert set(sampled["modes"]) == {"ar", "dflash", "domino", "domino_chain"} and sampled["n_prompts"] == 3
    for mode in ("dflash", "domino", "domino_chain"):
        m = sampled["modes"][mode]
        assert 1.0 <= m["acceptance_length"] <= report["block_size"] and m["speedup_se"] is not None
        assert m["speedup"] == pytest.approx(m["tokens_per_s"] / sampled["modes"]["ar"]["tokens_per_s"])
    assert suite["exact_match_ngram"] == 1.0 and suite["modes"]["ngram"]["exact_match"] == 1.0
    assert suite["speedup_ngram"] == pytest.approx(suite["ngram_tokens_per_s"] / suite["ar_tokens_per_s"])
    assert suite["modes"]["domino"]["acceptance_length"] == suite["acceptance_length"]
    for key in ("acceptance_length_se", "acceptance_length_no_head_se", "acceptance_length_ngram_se",
                "speedup_se", "speedup_no_head_se", "speedup_ngram_se", "speedup_over_ngram_se"):
        assert suite[key] is not None and suite[key] >= 0
    # the draft's mode against prompt lookup, paired on the same prompts
    assert suite["speedup_over_ngram"] == pytest.approx(suite["spec_tokens_per_s"] / suite["ngram_tokens_per_s"])
    # τ is consistent with the counts: round tokens = new tokens - one prefill token per prompt.
    assert suite["acceptance_length"] == pytest.approx((suite["new_tokens"] - 3) / suite["verify_rounds"])
    assert len(suite["acceptance_by_position"]) == report["num_draft"] == report["block_size"] - 1 == 3
    shares = [s for s in suite["acceptance_by_position"] if s is not None]
    assert all(0 <= a <= 1 for a in shares) and shares == sorted(shares, reverse=True)
    assert {k: report[k] for k in ("device", "dtype", "block_size", "temperature", "max_new_tokens")} == {
        "device": "cpu", "dtype": "float32", "block_size": 4, "temperature": 0.0, "max_new_tokens": 12}
    assert report["draft_dir"] == str(Path(params.paths.checkpoints) / "final")
    assert report["draft_sha256"] == sha256_file(Path(report["draft_dir"]) / "model.safetensors")
    # the fixed-K walk over the AR answers: every answer token after the first is emitted by some round
    walk = suite["walk"]
    assert walk["num_draft"] == report["block_size"] - 1
    for mode in ("domino", "dflash"):
        assert walk[mode]["emitted"] == suite["ar_new_tokens"] - suite["n_prompts"], mode
        assert walk[mode]["replies"] == suite["n_prompts"]
        assert 1.0 <= walk[mode]["acceptance_length"] == walk[mode]["emitted"] / walk[mode]["rounds"] <= report["block_size"]

    plots = Path(params.paths.plots)
    rows = (plots / "eval_acceptance" / "mine.csv").read_text().splitlines()
    assert rows[0] == "position,domino,no_head" and len(rows) == 1 + 3
    assert (plots / "eval_tau.csv").read_text().splitlines()[1].startswith("mine domino,")
    assert (plots / "eval_acceptance.png").stat().st_size > 1000 and (plots / "eval_tau.png").stat().st_size > 1000

    import mlflow

    mlflow.set_tracking_uri(params.mlflow.tracking_uri)
    runs = mlflow.search_runs(experiment_names=[params.mlflow.experiment], output_format="list")
    run = next(r for r in runs if r.info.run_name == "evaluate")
    assert run.data.tags["training_run_id"] == TRAIN_RUN_ID
    assert run.data.metrics["mine/speedup"] == pytest.approx(suite["speedup"])
    assert run.data.metrics["mine/walk/domino/acceptance_length"] == pytest.approx(walk["domino"]["acceptance_length"])
    assert run.data.metrics["mine/sampled/domino/acceptance_length"] == pytest.approx(
        sampled["modes"]["domino"]["acceptance_length"])
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"eval.json", "eval_acceptance.png", "eval_tau.png"} <= artifacts


def test_every_mode_runs_in_plain_fp32_with_the_same_engine_options(setup, tmp_path, monkeypatch):
    """A process that trained first has TF32 on; evaluate runs plain fp32 (exactness) and restores it.
    AR runs with the engine options the speculative modes get (CUDA graphs on a GPU): a fair baseline."""
    from dominospec.eval import stage

    seen = {}
    run_suite = stage.run_suite

    def spy(suite, engines, *args, **kwargs):
        seen["precision"] = torch.get_float32_matmul_precision()
        seen["options"] = {mode: engine.params for mode, engine in engines.items()}
        if "calls" in seen:  # the first suite's greedy pass is recorded
            return run_suite(suite, engines, *args, **kwargs)
        seen["modes"], seen["calls"] = list(engines), []
        originals = {mode: engine.generate for mode, engine in engines.items()}
        for mode, engine in engines.items():  # record the order the modes run in
            monkeypatch.setattr(engine, "generate", lambda *a, _mode=mode, _run=engine.generate, **k:
                                seen["calls"].append(_mode) or _run(*a, **k))
        try:
            return run_suite(suite, engines, *args, **kwargs)
        finally:
            for mode, engine in engines.items():
                monkeypatch.setattr(engine, "generate", originals[mode])

    monkeypatch.setattr(stage, "run_suite", spy)
    torch.set_float32_matmul_precision("high")
    try:
        evaluate(load_params(setup[0]), out=str(tmp_path / "eval.json"))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")
    assert seen["precision"] == "highest"
    modes, calls = seen["modes"], seen["calls"]  # prompt i runs every mode once, starting at mode i (rotated)
    prompts = [calls[i:i + len(modes)] for i in range(0, len(calls), len(modes))]
    assert len(prompts) >= 2 and all(sorted(p) == sorted(modes) for p in prompts)
    assert [p[0] for p in prompts] == [modes[i % len(modes)] for i in range(len(prompts))]
    assert set(seen["options"]) == {"ar", "ngram", "dflash", "domino", "domino_chain"}
    chain = seen["options"].pop("domino_chain")  # the configured options with a chain for DominoTree
    assert len({id(options) for options in seen["options"].values()}) == 1
    assert chain == seen["options"]["domino"].with_tree(shape="chain") and chain.tree.shape == "chain"


def test_the_comparisons_off_run_neither_the_chain_nor_the_sampled_pass(setup, tmp_path):
    """evaluate.chain_comparison false and sampled_temperature null: the four modes, greedy only; the
    report says there was no sampled pass."""
    params_path, _ = setup
    raw = yaml.safe_load(params_path.read_text())
    raw["evaluate"].update(sampled_temperature=None, chain_comparison=False, max_new_tokens=6)
    off = tmp_path / "params.yaml"
    off.write_text(yaml.safe_dump(raw))
    report = evaluate(load_params(off), out=str(tmp_path / "off.json"))
    suite = report["suites"]["sharegpt"]
    assert set(suite["modes"]) == {"ar", "ngram", "dflash", "domino"}
    assert "sampled" not in suite and report["sampled_temperature"] is None
    assert all(suite["modes"][m]["exact_match"] == 1.0 for m in ("ngram", "dflash", "domino"))


def test_auto_k_records_the_measured_round_cost_and_stays_exact(setup, tmp_path):
    params_path, _ = setup
    raw = yaml.safe_load(params_path.read_text())
    raw["evaluate"]["num_draft"] = "auto"
    auto_params = tmp_path / "params.yaml"
    auto_params.write_text(yaml.safe_dump(raw))
    report = evaluate(load_params(auto_params), out=str(tmp_path / "auto.json"))
    assert report["num_draft_setting"] == "auto"
    assert set(report["auto_k"]) == {"ngram", "dflash", "domino", "domino_chain"}
    chain = report["auto_k"]["domino_chain"]
    K, lookup_k = report["num_draft"], report["engine"]["ngram_num_draft"] if report["engine"]["ngram_assist"] else 0
    # a chain's verify is measured for K drafts and, with ngram_assist, for a lookup of ngram_num_draft tokens;
    # with ngram_fork for both at once
    fork = lookup_k and report["engine"]["ngram_fork"]
    rows = K + lookup_k + 1 if fork else max(K, lookup_k) + 1
    assert len(chain["cost_ms"]["verify"]) == rows and len(chain["round_over_ar_step_by_k"]) == K + 1
    assert chain["round_over_ar_step_by_k"][0] == 1.0 and 0 <= chain["k_at_end"] <= K
    assert all(0 <= a <= 1 for a in chain["acceptance_estimate_at_end"])
    if lookup_k:  # the lookups' own model: a lookup round pays no draft forward
        lookup = chain["lookup"]
        assert len(lookup["acceptance_estimate_at_end"]) == lookup_k and 0 <= lookup["k_at_end"] <= lookup_k
        assert lookup["round_over_ar_step_by_k"][1] < chain["round_over_ar_step_by_k"][1]
    if fork:
        kd, kl = chain["fork"]["k_at_end"]
        assert 0 <= kd <= K and 0 <= kl <= lookup_k
    tree, N = report["auto_k"]["domino"], report["engine"]["tree"]["nodes"]  # DominoTree's auto-budget: by nodes verified
    assert report["engine"]["tree"]["shape"] == "best_first" and "fork" not in tree
    assert tree["cost_ms"]["tree_build"] > 0 and len(tree["cost_ms"]["verify"]) == N + lookup_k * bool(fork) + 1
    expected = tree["dominotree"]["expected_tokens_by_nodes"]
    assert len(expected) == N + 1 and expected[0] == 1.0 and expected == sorted(expected)
    assert 0 <= tree["dominotree"]["nodes_at_end"] <= N
    # one measurement of the machine: the engine verifying the most rows measured it, the others took it
    assert chain["cost_ms"]["verify"] == tree["cost_ms"]["verify"][:rows]
    sharegpt = report["suites"]["sharegpt"]
    assert sharegpt["exact_match"] == sharegpt["exact_match_no_head"] == sharegpt["exact_match_ngram"] == 1.0
    assert sharegpt["modes"]["domino_chain"]["exact_match"] == 1.0


def test_stage_runs_params_suites_and_out_keeps_pipeline_outputs_apart(setup, tmp_path):
    params_path, _ = setup
    out = tmp_path / "report.json"
    assert main(["evaluate", "--params", str(params_path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    sharegpt = report["suites"]["sharegpt"]
    assert sharegpt["n_prompts"] == 3 and sharegpt["exact_match"] == 1.0
    assert (tmp_path / "report_plots" / "eval_acceptance" / "sharegpt.csv").is_file()


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "mine.jsonl:2: not valid JSON"),
        ('["a list"]', 'mine.jsonl:2: expected an object with exactly one of "prompt" or "messages"'),
        ('{"prompt": "t5", "messages": []}', "exactly one of"),
        ('{"prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"messages": [{"role": "robot", "content": "t5"}]}', "messages[0] must be"),
        ('{"messages": "t5"}', '"messages" must be a non-empty list'),
    ],
)
def test_malformed_jsonl_lines_are_named(tmp_path, line, message):
    path = write_jsonl(tmp_path / "mine.jsonl", [json.dumps({"prompt": "t5"}), line])
    with pytest.raises(UserError) as err:
        list(jsonl_conversations(path))
    assert message in str(err.value)


def test_evaluate_command_reports_a_bad_prompts_file_without_traceback(setup, tmp_path, capsys):
    params_path, _ = setup
    bad = write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"prompt": "t5"}), "{oops"])
    assert main(["evaluate", "--params", str(params_path), "--prompts", str(bad)]) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["domino", "dominotree"])
def test_generate_command_prints_answer_then_tau_and_speed(setup, capsys, mode):
    params_path, _ = setup
    assert main(["generate", "--params", str(params_path), "--prompt", "t5 t6 t7", "--mode", mode]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith(f"[{mode}, B=4, K=3, T=0.0]") and "τ " in lines[-1] and "tokens/s" in lines[-1]
    assert lines[0].startswith("t")  # the decoded answer of the word-level tokenizer


def test_sampled_pass_setting(setup):
    from dominospec.eval.stage import second_sampling
    from dominospec.engine import Sampling

    cfg = load_params(setup[0]).evaluate
    assert second_sampling(cfg, Sampling()) == Sampling(temperature=cfg.sampled_temperature)
    assert second_sampling(dataclasses.replace(cfg, sampled_temperature=None), Sampling()) is None
    assert second_sampling(cfg, Sampling(temperature=cfg.sampled_temperature)) is None  # the first pass already is
    with pytest.raises(UserError, match="evaluate.sampled_temperature"):
        second_sampling(dataclasses.replace(cfg, sampled_temperature=0.0), Sampling())


def test_humaneval_suite_reads_all_tasks_as_chat_requests():
    tasks = list(humaneval_conversations())
    assert len(tasks) == 164
    assert all(len(t) == 1 and t[0]["role"] == "user" and "def " in t[0]["content"] for t in tasks)
