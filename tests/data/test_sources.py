"""Reading raw records: the packaged ShareGPT file, truncated and malformed files, JSON Lines in both forms."""

from __future__ import annotations

import json

import pytest
from data_helpers import SHAREGPT_SAMPLE, sample_records

from dominospec.errors import UserError
from dominospec.data.conversations import normalize_records
from dominospec.data.sources import parse_records, read_file, read_source


def test_packaged_sharegpt_yields_all_17671_complete_conversations():
    raw = read_source("sharegpt", hub_split="train")
    assert len(raw.records) == 17671
    assert dict(raw.skipped) == {"truncated_tail": 1}
    assert all(isinstance(r, dict) and "conversations" in r for r in raw.records)
    assert raw.records[0]["id"] == "QWJhYvA_0"


def test_complete_array_file_reads_every_record_and_skips_nothing():
    raw = read_file(SHAREGPT_SAMPLE)
    assert raw.records == sample_records()
    assert not raw.skipped


def _record_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of each top-level element of a JSON array text."""
    decoder, spans, pos = json.JSONDecoder(), [], text.index("[") + 1
    while True:
        while text[pos] in " \n\t,":
            pos += 1
        if text[pos] == "]":
            return spans
        _, end = decoder.raw_decode(text, pos)
        spans.append((pos, end))
        pos = end


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.2, 0.5, 0.77, 0.99])
def test_array_cut_mid_record_keeps_the_complete_records_and_counts_the_tail(tmp_path, fraction):
    text = SHAREGPT_SAMPLE.read_text()
    spans = _record_spans(text)
    k = 6  # cut inside the 7th record
    start, end = spans[k]
    cut = start + int(fraction * (end - start))
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    raw = read_file(path)
    assert raw.records == sample_records()[:k]
    assert dict(raw.skipped) == {"truncated_tail": 1}


def test_array_cut_between_records_counts_the_unclosed_array(tmp_path):
    text = SHAREGPT_SAMPLE.read_text()
    _, end = _record_spans(text)[2]
    path = tmp_path / "cut.json"
    path.write_text(text[: end + 1])  # up to and including the comma after record 3
    raw = read_file(path)
    assert raw.records == sample_records()[:3]
    assert dict(raw.skipped) == {"truncated_tail": 1}


@pytest.mark.parametrize(
    "content, where",
    [
        ("hello world\n", "line 1 column 1"),
        ("\n\n  ShareGPT", "line 3 column 3"),
        ('[{"id": "a"},\n {oops}]', "line 2 column 3"),
        ('[{"id": "a"}] trailing', "line 1 column 15"),
        ('{"id": "a"}\n{"id": "b",, }\n{"id": "c"}\n', "line 2 column"),
    ],
)
def test_text_that_is_not_json_is_a_user_error_naming_file_and_position(tmp_path, content, where):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(UserError) as err:
        read_source(str(path), hub_split="train")
    assert str(path) in str(err.value) and where in str(err.value)


@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_empty_file_is_a_user_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=rf"{path}: the file is empty"):
        read_source(str(path), hub_split="train")


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        read_source(str(tmp_path / "nope.json"), hub_split="train")


def _as_openai(record: dict) -> dict:
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return {"id": record["id"], "messages": [{"role": roles[m["from"]], "content": m["value"]} for m in record["conversations"]]}


def test_jsonl_in_sharegpt_and_openai_forms_normalise_identically(tmp_path):
    real = [r for r in sample_records() if r["id"] in ("WJidmXp_0", "i6IyJda_0", "lheleG7_0")]
    sharegpt_lines = tmp_path / "sharegpt.jsonl"
    sharegpt_lines.write_text("".join(json.dumps(r) + "\n" for r in real))
    openai_lines = tmp_path / "openai.jsonl"
    openai_lines.write_text("".join(json.dumps(_as_openai(r)) + "\n\n" for r in real))  # blank lines are fine

    a, skipped_a, _ = normalize_records(read_source(str(sharegpt_lines), "train").records)
    b, skipped_b, _ = normalize_records(read_source(str(openai_lines), "train").records)
    assert [c["id"] for c in a] == ["i6IyJda_0", "WJidmXp_0", "lheleG7_0"]
    assert a == b
    assert not skipped_a and not skipped_b
    assert a[2]["messages"] == [
        {"role": "user", "content": "knock knock"},
        {"role": "assistant", "content": "Who's there?"},
        {"role": "user", "content": "boo"},
        {"role": "assistant", "content": "Boo who?"},
    ]


def test_jsonl_with_a_cut_last_line_counts_the_tail(tmp_path):
    lines = [json.dumps(r) for r in sample_records()[:4]]
    path = tmp_path / "cut.jsonl"
    path.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])
    raw = read_file(path)
    assert raw.records == sample_records()[:3]
    assert dict(raw.skipped) == {"truncated_tail": 1}


def test_parse_records_tells_arrays_from_lines():
    records, truncated = parse_records('  [ {"a": 1} , {"a": 2} ]  ', "mem")
    assert (records, truncated) == ([{"a": 1}, {"a": 2}], False)
    records, truncated = parse_records('{"a": 1}\n{"a": 2}', "mem")
    assert (records, truncated) == ([{"a": 1}, {"a": 2}], False)
    records, truncated = parse_records('[{"a": 1}, {"a": tr', "mem")
    assert (records, truncated) == ([{"a": 1}], True)


def test_hub_source_goes_through_datasets_load_dataset(tmp_path):
    """`hub:<id>` is read with datasets.load_dataset(id, split=hub_split); a local dataset folder needs no network."""
    folder = tmp_path / "chat_dataset"
    folder.mkdir()
    real = sample_records()[:4]
    (folder / "train.jsonl").write_text("".join(json.dumps(_as_openai(r)) + "\n" for r in real))
    raw = read_source(f"hub:{folder}", hub_split="train")
    assert raw.source == f"hub:{folder}" and not raw.skipped
    from_hub, _, _ = normalize_records(raw.records)
    from_file, _, _ = normalize_records(real)
    assert from_hub == from_file and len(from_hub) == 4


@pytest.mark.parametrize("source, message", [("hub:", "needs a dataset id"), ("hub:{tmp}/absent", "cannot load hub dataset")])
def test_unusable_hub_source_is_a_user_error(tmp_path, source, message):
    with pytest.raises(UserError, match=message):
        read_source(source.format(tmp=tmp_path), hub_split="train")
