"""The regenerate stage on the static decoder, with a tiny random target on SmolLM2's tokenizer and real ShareGPT
records: every assistant turn, sampled replies, self-written prompts, dedup, and a killed run that resumes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from data_helpers import REPO, sample_records, smollm2_tokenizer, tiny_target_dir, write_params  # noqa: F401
from datasets import Dataset

from dominospec.config import load_params
from dominospec.data.chat import render_text
from dominospec.data.dataset import read_dataset
from dominospec.data.prepare import prepare
from dominospec.errors import UserError
from dominospec.regenerate.decoder import Reply
from dominospec.regenerate.dedup import Dedup
from dominospec.regenerate.prompts import conversation_prompts, magpie_prefix, magpie_verdict
from dominospec.regenerate.stage import regenerate, work_dir

STATIC = {"enabled": True, "decoder": "static", "max_conversations": 8, "original_conversations": 0,
          "max_val_conversations": 2, "max_turns": None, "max_new_tokens": 12, "batch_size": 8, "dtype": "float32",
          "samples": 1, "sample_temperatures": [1.0], "magpie_prompts": 6, "magpie_max_prompt_tokens": 10,
          "magpie_min_prompt_tokens": 1, "dedup": "tokens", "chunk_replies": 8, "prefill_tokens": 256,
          "num_threads": None}  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_target_dir):
    """Real ShareGPT records prepared for the tiny target (max_length 160) -> (root, source file)."""
    root = tmp_path_factory.mktemp("static")
    source = root / "records.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in sample_records()))
    params = load_params(_params(root, root / "base", tiny_target_dir, source))
    prepare(params)
    return root, source, params.paths.prepared


def _params(root, out, target_dir, source, prepared_path=None, **regenerate_keys):
    return write_params(out.with_suffix(".yaml"), out, target={"model": str(target_dir), "gguf_file": None},
                        prepare={"source": str(source), "max_length": 160, "val_fraction": 0.2, "test_fraction": 0.1},
                        regenerate={**STATIC, **regenerate_keys},
                        **({"paths": {"prepared": str(prepared_path)}} if prepared_path else {}))


@pytest.fixture(scope="module")
def run(prepared, tiny_target_dir):
    """One uninterrupted static run -> (params, prepared splits, regenerated splits, metrics)."""
    root, source, prepared_path = prepared
    params_file = _params(root, root / "run", tiny_target_dir, source)
    params = load_params(params_file)
    _paths_with(params_file, prepared_path)
    params = load_params(params_file)
    regenerate(params)
    splits, _ = read_dataset(prepared_path)
    out, meta = read_dataset(params.paths.regenerated)
    return params, splits, out, meta, json.loads((root / "run" / "metrics" / "regenerate.json").read_text())


def _paths_with(params_file, prepared_path) -> None:
    import yaml

    raw = yaml.safe_load(params_file.read_text())
    raw["paths"]["prepared"] = str(prepared_path)
    params_file.write_text(yaml.safe_dump(raw, sort_keys=False))


def test_every_assistant_turn_is_a_prompt_given_the_conversation_so_far():
    data = Dataset.from_list([
        {"id": "a", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                                 {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                                 {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"}]},
        {"id": "b", "messages": [{"role": "user", "content": "v1"}, {"role": "assistant", "content": "b1"}]},
    ])  # fmt: skip
    prompts = conversation_prompts(data, 2, None, "sharegpt")
    assert [p.id for p in prompts] == ["a", "a/turn1", "b"]
    assert [m["content"] for m in prompts[1].as_messages()] == ["s", "u1", "a1", "u2"]  # the source's replies before it
    assert [p.id for p in conversation_prompts(data, 2, 1, "sharegpt")] == ["a", "b"]
    assert [p.id for p in conversation_prompts(data, 1, None, "sharegpt")] == ["a", "a/turn1"]


def test_dedup_keeps_the_first_and_counts_repeats_per_source():
    seen = Dedup("tokens")
    assert seen.first("a", [1, 2, 3], []) and not seen.first("b", [1, 2, 3], []) and seen.first("b", [1, 2], [])
    assert seen.duplicates == Counter({"b": 1})
    text = Dedup("text")
    assert text.first("a", [], [{"role": "user", "content": "Hello  World"}])
    assert not text.first("c", [9], [{"role": "user", "content": "hello world "}])
    assert text.first("c", [9], [{"role": "assistant", "content": "hello world"}]) and text.duplicates == Counter({"c": 1})
    assert Dedup("none").first("a", [1], []) and Dedup("none").first("a", [1], [])


def test_magpie_prefix_is_the_templates_user_header_and_the_filter_names_its_reason(smollm2_tokenizer):
    prefix = magpie_prefix(smollm2_tokenizer, {})
    assert prefix.endswith("<|im_start|>user\n") and "<|im_start|>system\n" in prefix
    assert render_text(smollm2_tokenizer, [{"role": "user", "content": "hi"}], False, {}).startswith(prefix + "hi")
    special = {1, 2}

    def verdict(tokens, stopped=True, loop=False, text="a question"):
        return magpie_verdict(Reply(tokens, len(tokens) + stopped, stopped, loop, []), text, special, 3)

    assert verdict([5, 6, 7]) is None
    assert verdict([5, 6, 7], stopped=False) == "no_end_of_turn"
    assert verdict([5, 6, 7], loop=True) == "loop"
    assert verdict([5, 6]) == "too_short"
    assert verdict([5, 6, 7], text="  ") == "empty"
    assert verdict([5, 1, 7]) == "special_token"


def test_static_run_writes_one_sequence_per_reply_from_every_source(run, smollm2_tokenizer):
    params, splits, out, meta, metrics = run
    train = list(out["train"])
    sources = metrics["sources"]
    count = min(8, len(splits["train"]))
    turns = conversation_prompts(splits["train"], count, None, "sharegpt")
    assert sources["sharegpt"]["prompts"] == len(turns) > count  # multi-turn: more prompts than conversations
    assert sources["sharegpt"]["replies"] == 2 * (len(turns) - sources["sharegpt"]["skipped"].get(
        "prompt_reaches_max_length", 0))  # the greedy reply and one sample each
    written = metrics["magpie_prompts"]  # a random model's continuations mostly run to the cap: dropped
    assert written["asked"] == 6 and sum(v for k, v in written.items() if k != "asked") == 6
    assert sources.get("magpie", {}).get("prompts", 0) == written.get("kept", 0)
    for name, counts in sources.items():
        if name == "val":
            continue
        skipped = sum(v for k, v in counts["skipped"].items() if k != "prompt_reaches_max_length")
        assert counts["sequences"] == counts["replies"] - skipped - counts["duplicates"]
    assert metrics["conversations_regenerated"] == len(train) == sum(metrics["sequences_by_source"].values())
    ids = [r["id"] for r in train]
    assert len(set(ids)) == len(ids) and any("/turn1" in i for i in ids) and any("/T1-1" in i for i in ids)
    keys = [tuple(r["input_ids"]) for r in train]
    assert len(set(keys)) == len(keys)  # dedup: tokens
    by_id = {r["id"]: r for r in train}
    for row in train[:20]:
        prompt = row["messages"][:-1]
        text = render_text(smollm2_tokenizer, prompt, True, {})
        prompt_ids = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
        n = len(prompt_ids)
        assert row["input_ids"][:n] == prompt_ids and row["loss_mask"] == [0] * n + [1] * (len(row["input_ids"]) - n)
        reply = row["input_ids"][n:]
        assert smollm2_tokenizer.decode(reply, skip_special_tokens=True) == row["messages"][-1]["content"]
        sample = by_id.get(f"{row['id']}/T1-1")
        if sample is not None:
            assert sample["input_ids"][:n] == prompt_ids and sample["input_ids"] != row["input_ids"]
    assert metrics["splits"]["val"] == len(out["val"]) > 0 and all("/T" not in r["id"] for r in out["val"])
    assert list(out["test"]) == list(splits["test"])
    assert not work_dir(params.paths.regenerated).exists()


def test_static_greedy_first_turns_equal_the_stream_decoders(prepared, tiny_target_dir):
    """max_turns 1, greedy, no samples: the static stage writes the replies today's stage writes, with
    either decode attention (rows: the Triton kernel, interpreted)."""
    root, source, prepared_path = prepared
    replies = {}
    for decoder, attention in (("stream", "auto"), ("static", "padded"), ("static", "rows")):
        keys = dict(decoder=decoder, max_turns=1, samples=0, magpie_prompts=0, dedup="none", max_val_conversations=0,
                    loop_ngram=2, loop_repeats=3, linear="torch", attention=attention)
        params_file = _params(root, root / f"{decoder}-{attention}", tiny_target_dir, source, **keys)
        _paths_with(params_file, prepared_path)
        params = load_params(params_file)
        regenerate(params)
        out, _ = read_dataset(params.paths.regenerated)
        replies[attention] = {r["id"]: r["messages"][-1]["content"] for r in out["train"]}
        if decoder == "static":
            metrics = json.loads((root / f"{decoder}-{attention}" / "metrics" / "regenerate.json").read_text())
            assert metrics["attention"] == attention
    prepared_splits, _ = read_dataset(prepared_path)
    assert replies["padded"] == replies["rows"] == replies["auto"]
    assert len(replies["rows"]) == min(8, len(prepared_splits["train"]))


def test_rows_attention_off_cuda_needs_the_interpreter(prepared, tiny_target_dir, monkeypatch):
    root, source, prepared_path = prepared
    params_file = _params(root, root / "no-interpreter", tiny_target_dir, source, attention="rows")
    _paths_with(params_file, prepared_path)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(UserError, match="regenerate.attention: rows runs a Triton kernel"):
        regenerate(load_params(params_file))


def test_static_only_keys_are_refused_on_the_stream_decoder(prepared, tiny_target_dir):
    root, source, prepared_path = prepared
    params_file = _params(root, root / "refused", tiny_target_dir, source, decoder="stream")
    with pytest.raises(UserError, match="needs regenerate.decoder: static"):
        regenerate(load_params(params_file))


def test_a_killed_static_run_resumes_without_redoing_finished_chunks(prepared, run, tiny_target_dir):
    """SIGKILL the real stage once a chunk of train replies is journaled; the rerun reads those back and ends
    with what the uninterrupted run wrote. The killed run decodes with the rows attention (interpreted), the
    uninterrupted one with padded: every source's replies (greedy, sampled, self-written prompts) agree."""
    root, source, prepared_path = prepared
    params_file = _params(root, root / "killed", tiny_target_dir, source, chunk_replies=4, attention="rows")
    _paths_with(params_file, prepared_path)
    params = load_params(params_file)
    journal = work_dir(params.paths.regenerated) / "journal-static-train.jsonl"
    log = root / "killed.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "pipeline/regenerate.py", "--params", str(params_file)], cwd=REPO,
                                stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (journal.is_file() and journal.read_bytes().count(b"\n") >= 2):  # header + one chunk
            assert proc.poll() is None, f"the run ended before it could be killed:\n{log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "no chunk journaled in time"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (root / "killed" / "data" / "regenerated").exists()
    finished = journal.read_bytes().count(b"\n") - 1
    regenerate(load_params(params_file))
    metrics = json.loads((root / "killed" / "metrics" / "regenerate.json").read_text())
    assert metrics["resumed_replies"] >= 4 * finished >= 4
    assert metrics["tokens_generated_this_run"] < metrics["tokens_generated"] + sum(
        v["tokens_generated"] for k, v in metrics["sources"].items() if k == "val")
    resumed, _ = read_dataset(params.paths.regenerated)
    _, _, clean, _, _ = run
    for split in ("train", "val", "test"):
        assert list(resumed[split]) == list(clean[split])


def test_self_written_prompts_are_the_kept_continuations_of_the_user_prefix(smollm2_tokenizer):
    """What the target writes after the user prefix (here: given replies) -> the prompts kept, counted by verdict."""
    from dominospec.regenerate.sequences import self_written_prompts

    tok, end = smollm2_tokenizer, smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    written = [("How do I sort a list in Python?", True), ("how do I  sort a list in python?", True),
               ("Tell me about the", False), ("   ", True), ("Name <|im_start|> three birds.", True),
               ("Why is the sky blue?", True)]

    class Written:
        """Stands in for the decoding phase: the replies the target wrote (tokenized texts)."""

        jobs = None

        def decode(self, phase, jobs):
            assert phase == "magpie_prompts" and len(jobs) == len(written)
            Written.jobs = jobs
            replies = []
            for text, stopped in written:
                ids = tok(text, add_special_tokens=False)["input_ids"]
                replies.append(Reply(ids, len(ids) + stopped, stopped, False, [], end if stopped else None))
            return replies

    cfg = load_params(REPO / "params.yaml").regenerate
    import dataclasses

    cfg = dataclasses.replace(cfg, magpie_prompts=len(written), magpie_min_prompt_tokens=2)
    prompts, verdicts = self_written_prompts(Written(), tok, cfg, {})
    assert [p.as_messages() for p in prompts] == [[{"role": "user", "content": "How do I sort a list in Python?"}],
                                                  [{"role": "user", "content": "Why is the sky blue?"}]]
    assert [p.id for p in prompts] == ["magpie:0", "magpie:5"] and {p.source for p in prompts} == {"magpie"}
    assert verdicts == {"asked": 6, "kept": 2, "duplicate": 1, "no_end_of_turn": 1, "empty": 1, "special_token": 1}
    prefix = tok(magpie_prefix(tok, {}), add_special_tokens=False)["input_ids"]
    assert all(list(j.prompt) == prefix and j.temperature == cfg.magpie_temperature for j in Written.jobs)
    assert len({j.seed for j in Written.jobs}) == len(written)  # each continuation its own draw
