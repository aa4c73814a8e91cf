"""The regenerate stage with a tiny random target on SmolLM2's tokenizer: disabled copy, rewriting, kill + resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from data_helpers import REPO, sample_records, smollm2_tokenizer, tiny_target_dir, write_params  # noqa: F401

from dominospec.errors import UserError
from dominospec.config import load_params
from dominospec.precision import resolve_dtype
from dominospec.data.dataset import read_dataset
from dominospec.data.prepare import prepare
from dominospec.regenerate.stage import regenerate, work_dir

REGENERATE = {"enabled": True, "max_conversations": 6, "original_conversations": 0, "max_val_conversations": 0, "max_turns": None,
              "max_new_tokens": 8, "temperature": 0.8, "top_p": 0.95, "batch_size": 1, "seed": 3,
              "num_threads": None}  # fmt: skip


def _rows(split) -> list[dict]:
    return [dict(r) for r in split]


def _variant(record: dict, suffix: str) -> dict:
    """A record with `suffix` added to its id and to its first message's text (where it has one)."""
    turns = record.get("conversations")
    if suffix and isinstance(turns, list) and turns and isinstance(turns[0], dict) and isinstance(turns[0].get("value"), str):
        turns = [{**turns[0], "value": f"{turns[0]['value']} {suffix}"}, *turns[1:]]
        return {**record, "id": f"{record['id']}{suffix}", "conversations": turns}
    return {**record, "id": f"{record['id']}{suffix}"}


@pytest.fixture(scope="module")
def prepared_params(tmp_path_factory, tiny_target_dir):
    """Real ShareGPT records, each also as two variants with a suffixed id and prompt, prepared for the
    tiny target (a variant's prompt differs: prepare drops train conversations opening with a val or
    test prompt)."""
    root = tmp_path_factory.mktemp("regenerate")
    records = [_variant(r, suffix) for suffix in ("", "-v1", "-v2") for r in sample_records()]
    source = root / "variants_of_real_records.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    params_file = write_params(
        root / "params.yaml",
        root,
        target={"model": str(tiny_target_dir), "gguf_file": None},
        prepare={"source": str(source), "max_length": 96, "val_fraction": 0.2, "test_fraction": 0.2},
        regenerate=REGENERATE,
    )
    params = load_params(params_file)
    prepare(params)
    return params, root


@pytest.fixture(scope="module")
def reference(prepared_params):
    """One uninterrupted enabled run: (params, prepared splits, regenerated splits, meta, metrics)."""
    params, root = prepared_params
    regenerate(params)
    prepared, _ = read_dataset(params.paths.prepared)
    regenerated, meta = read_dataset(params.paths.regenerated)
    metrics = json.loads((root / "metrics" / "regenerate.json").read_text())
    return params, prepared, regenerated, meta, metrics


def test_enabled_run_rewrites_train_replies_and_nothing_else(reference, smollm2_tokenizer):
    params, prepared, regenerated, meta, metrics = reference
    originals = {r["id"]: r for r in _rows(prepared["train"])}
    train = _rows(regenerated["train"])
    assert [r["id"] for r in train] == list(prepared["train"]["id"])[:6]  # the first max_conversations, in order
    for row in train:
        before, after = originals[row["id"]]["messages"], row["messages"]
        others_before = [m for m in before if m["role"] != "assistant"]
        others_after = [m for m in after if m["role"] != "assistant"]
        assert others_after == others_before[: len(others_after)]  # user and system turns untouched
        replies_before = [m["content"] for m in before if m["role"] == "assistant"]
        replies_after = [m["content"] for m in after if m["role"] == "assistant"]
        assert replies_after and all(a != b for a, b in zip(replies_after, replies_before))
        assert after[-1]["role"] == "assistant"
        # re-rendered and re-masked with prepare's code: the template's own tokens, cut to max_length
        reference_ids = smollm2_tokenizer.apply_chat_template(after, tokenize=True, return_dict=False)
        assert row["input_ids"] == list(reference_ids)[:96] and row["num_tokens"] == len(row["input_ids"])
        assert sum(row["loss_mask"]) > 0
    for split in ("val", "test"):
        assert _rows(regenerated[split]) == _rows(prepared[split])
    assert meta["regenerated"] == len(train) == metrics["conversations_regenerated"]
    assert metrics["tokens_generated"] > 0 and metrics["assistant_turns_regenerated"] >= len(train)
    capped = metrics["replies_at_max_new_tokens"] + metrics["replies_at_max_length"] + metrics["replies_loop_cut"]
    assert 0 < capped <= metrics["assistant_turns_regenerated"]  # 8-token replies of a random model mostly hit the cap
    assert metrics["replies_loop_cut"] == 0 and metrics["dtype"] == resolve_dtype(params.regenerate.dtype, "cpu")  # what ran
    assert not work_dir(params.paths.regenerated).exists()  # the journal is gone once the output is written


@pytest.mark.slow  # a subprocess start-up plus a second generation pass
def test_a_killed_run_resumes_to_the_same_result(reference, prepared_params):
    params, _, regenerated, _, _ = reference
    _, root = prepared_params
    second = root / "second"
    params_file = write_params(root / "second.yaml", second, target={"model": params.target.model, "gguf_file": None},
                               regenerate=REGENERATE,
                               paths={"prepared": params.paths.prepared})  # fmt: skip
    journal = work_dir(second / "data" / "regenerated") / "journal-train.jsonl"
    run = subprocess.Popen([sys.executable, "pipeline/regenerate.py", "--params", str(params_file)], cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (journal.is_file() and journal.read_bytes().count(b"\n") >= 2):  # header + one finished chunk
            assert run.poll() is None, "the run ended before it could be interrupted"
            assert time.monotonic() < deadline, "no chunk finished in time"
            time.sleep(0.005)
        os.kill(run.pid, signal.SIGKILL)
    finally:
        run.wait()
    assert run.returncode == -signal.SIGKILL
    finished_chunks = journal.read_bytes().count(b"\n") - 1
    assert 1 <= finished_chunks < 6
    assert not (second / "data" / "regenerated").exists()

    regenerate(load_params(params_file))
    resumed, _ = read_dataset(second / "data" / "regenerated")
    metrics = json.loads((second / "metrics" / "regenerate.json").read_text())
    assert metrics["conversations_resumed"] == finished_chunks  # batch_size 1: one conversation per chunk
    for split in ("train", "val", "test"):
        assert _rows(resumed[split]) == _rows(regenerated[split])


def test_a_journal_written_by_other_code_is_not_continued(prepared_params, monkeypatch, tmp_path):
    """The journal's fingerprint holds the code digest: chunks another version decoded are redone."""
    from dominospec.regenerate import stage
    from dominospec.regenerate.journal import Journal

    params, _ = prepared_params
    prepared, meta = read_dataset(params.paths.prepared)

    def journal(code: str) -> Journal:
        monkeypatch.setattr(stage, "code_digest", lambda: code)
        return Journal(tmp_path / "journal.jsonl", stage._fingerprint(params.regenerate, meta, prepared["train"], 2))

    first = journal("old")
    first.load()
    first.append(0, [{"row": 0}])
    assert journal("old").load() == {0: [{"row": 0}]}  # the same code continues
    assert journal("new").load() == {}


def test_batches_change_nothing_but_speed(prepared_params):
    """Greedy fp32: batches of 4 over the length-sorted rows give batch 1's rows, in the original order."""
    params, root = prepared_params
    runs = []
    for batch_size in (1, 4):
        out = root / f"greedy_batch_{batch_size}"
        greedy = {**REGENERATE, "temperature": 0.0, "dtype": "float32", "batch_size": batch_size, "max_new_tokens": 12}
        run = load_params(write_params(root / f"greedy_{batch_size}.yaml", out, target={"model": params.target.model, "gguf_file": None},
                                       regenerate=greedy, paths={"prepared": params.paths.prepared}))  # fmt: skip
        regenerate(run)
        runs.append(_rows(read_dataset(run.paths.regenerated)[0]["train"]))
    prepared, _ = read_dataset(params.paths.prepared)
    assert [r["id"] for r in runs[1]] == list(prepared["train"]["id"])[:6]
    assert runs[1] == runs[0]


@pytest.mark.parametrize(
    "bad, key",
    [({"batch_size": 0}, "batch_size"), ({"max_new_tokens": 0}, "max_new_tokens"), ({"loop_repeats": 1}, "loop_repeats"),
     ({"loop_ngram": -2}, "loop_ngram"), ({"top_p": 0.0}, "top_p"), ({"max_conversations": 0}, "max_conversations"),
     ({"max_turns": 0}, "max_turns"), ({"max_val_conversations": -1}, "max_val_conversations"),
     ({"original_conversations": -1}, "original_conversations"), ({"code_prompts": -1}, "code_prompts"),
     ({"code_prompts": 1, "code_prompts_root": "/no/such/folder"}, "code_prompts_root")],
)  # fmt: skip
def test_bad_params_are_named_in_the_error(prepared_params, tmp_path, bad, key):
    params, _ = prepared_params
    run = load_params(write_params(tmp_path / "p.yaml", tmp_path, target={"model": params.target.model, "gguf_file": None},
                                   regenerate={**REGENERATE, **bad}, paths={"prepared": params.paths.prepared}))  # fmt: skip
    with pytest.raises(UserError, match=f"regenerate.*{key}"):
        regenerate(run)
    assert not os.path.exists(run.paths.regenerated)


def test_val_is_rewritten_on_request_and_max_turns_keeps_the_first_turns(prepared_params):
    """max_val_conversations: val holds the target's own replies (for the train stage's engine walk);
    max_turns 1: every rewritten conversation ends after its first assistant turn."""
    params, root = prepared_params
    out = root / "val_and_turns"
    run = load_params(write_params(root / "val_turns.yaml", out, target={"model": params.target.model, "gguf_file": None},
                                   regenerate={**REGENERATE, "max_val_conversations": 2, "max_turns": 1},
                                   paths={"prepared": params.paths.prepared}))  # fmt: skip
    regenerate(run)
    prepared, _ = read_dataset(params.paths.prepared)
    regenerated, meta = read_dataset(run.paths.regenerated)
    metrics = json.loads((out / "metrics" / "regenerate.json").read_text())
    val = _rows(regenerated["val"])
    assert [r["id"] for r in val] == list(prepared["val"]["id"])[:2]
    originals = {r["id"]: r for r in _rows(prepared["val"])}
    for row in val + _rows(regenerated["train"]):
        roles = [m["role"] for m in row["messages"]]
        assert roles.count("assistant") == 1 and roles[-1] == "assistant"
    for row in val:
        first_reply = next(m["content"] for m in originals[row["id"]]["messages"] if m["role"] == "assistant")
        assert row["messages"][-1]["content"] != first_reply
    assert _rows(regenerated["test"]) == _rows(prepared["test"])
    assert meta["regenerated_val"] == 2 and metrics["val"]["conversations"] == 2 and metrics["max_turns"] == 1


def test_original_conversations_follow_the_rewritten_ones_unchanged(prepared_params, reference):
    """original_conversations: 3 -> train = the reference run's 6 rewritten conversations, then the
    next 3 prepared train rows exactly as prepared (max_turns null: every turn); counted in
    meta.json and the metrics. Asking for more than remain keeps what there is."""
    params, root = prepared_params
    _, prepared, rewritten, _, _ = reference
    for asked, out in ((3, root / "originals"), (10_000, root / "all_originals")):  # the e2e test covers "none left"
        run = load_params(write_params(root / f"originals_{asked}.yaml", out,
                                       target={"model": params.target.model, "gguf_file": None},
                                       regenerate={**REGENERATE, "original_conversations": asked},
                                       paths={"prepared": params.paths.prepared}))  # fmt: skip
        regenerate(run)
        train, meta = read_dataset(run.paths.regenerated)
        rows = _rows(train["train"])
        kept = min(asked, len(prepared["train"]) - 6)
        assert 0 < kept and len(rows) == len(rewritten["train"]) + kept
        assert rows[: len(rewritten["train"])] == _rows(rewritten["train"])
        assert rows[len(rewritten["train"]):] == _rows(prepared["train"].select(range(6, 6 + kept)))
        metrics = json.loads((out / "metrics" / "regenerate.json").read_text())
        assert meta["original_train"] == metrics["original_conversations"] == kept
        assert meta["regenerated"] == metrics["conversations_regenerated"] == len(rewritten["train"])
        assert metrics["original_skipped"] == {}


def test_original_conversations_keep_max_turns(prepared_params):
    """max_turns 1 -> an original conversation keeps its first user turn and its own first reply,
    rendered and masked as prepare renders them (the loss mask covers that reply only)."""
    params, root = prepared_params
    out = root / "originals_first_turn"
    run = load_params(write_params(root / "originals_first_turn.yaml", out,
                                   target={"model": params.target.model, "gguf_file": None},
                                   regenerate={**REGENERATE, "max_turns": 1, "original_conversations": 3},
                                   paths={"prepared": params.paths.prepared}))  # fmt: skip
    regenerate(run)
    prepared, _ = read_dataset(params.paths.prepared)
    train, _ = read_dataset(run.paths.regenerated)
    rows, source = _rows(train["train"])[-3:], _rows(prepared["train"].select(range(6, 9)))
    for row, original in zip(rows, source):
        roles = [m["role"] for m in row["messages"]]
        assert row["id"] == original["id"] and roles.count("assistant") == 1 and roles[-1] == "assistant"
        assert row["messages"] == original["messages"][: len(row["messages"])]  # the original reply, unchanged
        assert row["input_ids"] == original["input_ids"][: len(row["input_ids"])]  # a prefix of the full rendering
        assert 0 < sum(row["loss_mask"]) <= sum(original["loss_mask"])


def test_disabled_run_copies_every_split_unchanged(prepared_params):
    params, root = prepared_params
    out = root / "copy"
    disabled = load_params(write_params(root / "disabled.yaml", out, regenerate={"enabled": False},
                                        paths={"prepared": params.paths.prepared}))  # fmt: skip
    regenerate(disabled)
    prepared, prepared_meta = read_dataset(params.paths.prepared)
    copied, meta = read_dataset(disabled.paths.regenerated)
    assert meta == {**prepared_meta, "regenerated": 0}
    for split in ("train", "val", "test"):
        assert _rows(copied[split]) == _rows(prepared[split])
    assert json.loads((out / "metrics" / "regenerate.json").read_text())["enabled"] is False


def test_data_prepared_for_another_target_is_refused(prepared_params, tmp_path):
    params, _ = prepared_params
    foreign = tmp_path / "prepared"
    shutil.copytree(params.paths.prepared, foreign)
    meta = json.loads((foreign / "meta.json").read_text())
    meta["target"]["sha256"] = "0" * 64
    (foreign / "meta.json").write_text(json.dumps(meta))
    other = load_params(write_params(tmp_path / "p.yaml", tmp_path, target={"model": params.target.model, "gguf_file": None},
                                     regenerate=REGENERATE, paths={"prepared": str(foreign)}))  # fmt: skip
    with pytest.raises(UserError, match="re-run the prepare stage"):
        regenerate(other)
    assert not os.path.exists(other.paths.regenerated)


def test_missing_prepared_data_is_a_user_error(tmp_path):
    params = load_params(write_params(tmp_path / "p.yaml", tmp_path))
    with pytest.raises(UserError, match="run the prepare stage first"):
        regenerate(params)


def test_code_prompts_are_answered_by_the_target_and_follow_the_rewritten_ones(prepared_params, reference, tmp_path):
    """code_prompts: 2 -> train = the reference's 6 rewritten conversations, then the target's own
    answers to 2 function stubs (ids "code:..."), masked on the answer; counted in meta and metrics."""
    params, root = prepared_params
    _, _, rewritten, _, _ = reference
    tree = tmp_path / "lib"
    tree.mkdir()
    for name in ("add", "mul", "neg"):
        (tree / f"{name}.py").write_text(f'def {name}(a, b=0):\n    """{name} of two numbers."""\n    return a\n')
    out = root / "code"
    run = load_params(write_params(root / "code.yaml", out, target={"model": params.target.model, "gguf_file": None},
                                   regenerate={**REGENERATE, "code_prompts": 2, "code_prompts_root": str(tree)},
                                   paths={"prepared": params.paths.prepared}))  # fmt: skip
    regenerate(run)
    train, meta = read_dataset(run.paths.regenerated)
    rows = _rows(train["train"])
    assert rows[:6] == _rows(rewritten["train"])
    code = rows[6:]
    assert len(code) == 2 and all(r["id"].startswith("code:") and r["id"].endswith(("add", "mul", "neg")) for r in code)
    for row in code:
        user, reply = row["messages"]
        assert user["role"] == "user" and "Complete the following Python function" in user["content"]
        assert reply["role"] == "assistant" and reply["content"] and sum(row["loss_mask"]) > 0
    metrics = json.loads((out / "metrics" / "regenerate.json").read_text())
    assert meta["code_train"] == metrics["code"]["conversations"] == 2
    assert metrics["code"]["functions_found"] == 3 and metrics["code"]["tokens_generated"] > 0
    assert not work_dir(run.paths.regenerated).exists()
