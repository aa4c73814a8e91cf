"""Fuzzed ShareGPT / JSON Lines files: every input ends in records (with a counted truncated tail) or
a UserError naming the file, and a file cut anywhere keeps exactly its complete records.
Run: python -m pytest tests/fuzz/test_fuzz_sources.py -q
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from fuzz_helpers import JSON, TEXT, fuzz
from hypothesis import given
from hypothesis import strategies as st

from dominospec.data.sources import parse_records, read_file
from dominospec.errors import UserError

MESSAGE = st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "system"]), "value": TEXT})
SHAREGPT_RECORD = st.fixed_dictionaries({"id": TEXT, "conversations": st.lists(MESSAGE, max_size=4)})
RECORD = st.one_of(SHAREGPT_RECORD, st.dictionaries(TEXT, JSON, max_size=4))
LAYOUTS = ("array", "array_pretty", "jsonl")
DIR = Path(tempfile.mkdtemp(prefix="fuzz_sources_"))


def serialize(records: list, layout: str) -> tuple[str, list[tuple[int, int]]]:
    """records -> (file text, (start, end) offsets of each record in it)."""
    parts, spans = [], []
    head, sep, tail = {"array": ("[", ", ", "]"), "array_pretty": ("[\n  ", ",\n  ", "\n]\n"), "jsonl": ("", "\n", "\n")}[layout]
    pos = len(head)
    for i, record in enumerate(records):
        text = json.dumps(record)
        spans.append((pos, pos + len(text)))
        parts.append(text)
        pos += len(text) + len(sep)
    return head + sep.join(parts) + (tail if records or layout != "jsonl" else ""), spans


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def edits(data: st.DataObject, raw: bytes) -> bytes:
    """A few random byte edits (replace, insert, delete) of `raw`."""
    out = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        at = data.draw(st.integers(0, len(out)), label="at")
        kind = data.draw(st.sampled_from(["replace", "insert", "delete"]), label="kind")
        chunk = data.draw(st.binary(min_size=1, max_size=3) | st.sampled_from([b"[", b"]", b"{", b"}", b",", b'"', b"\\u",
                                                                              b"\n", b"0" * 5000, b"[" * 3000]),
                          label="bytes")
        if kind == "replace":
            out[at:at + len(chunk)] = chunk
        elif kind == "insert":
            out[at:at] = chunk
        else:
            del out[at:at + len(chunk)]
    return bytes(out)


@given(records=st.lists(RECORD, max_size=5), layout=st.sampled_from(LAYOUTS), data=st.data())
@fuzz(400)
def test_any_file_gives_records_or_an_error_naming_it(records, layout, data):
    raw = serialize(records, layout)[0].encode()
    raw = data.draw(st.one_of(st.just(raw), st.binary(max_size=64)), label="start") if data.draw(st.booleans()) else edits(data, raw)
    path = DIR / "records.json"
    path.write_bytes(raw)
    try:
        read = read_file(path)
    except UserError as err:
        assert str(path) in str(err)
        return
    assert set(read.skipped) <= {"truncated_tail"} and all(n == 1 for n in read.skipped.values())
    assert isinstance(read.records, list)


@given(records=st.lists(RECORD | JSON, max_size=5), layout=st.sampled_from(LAYOUTS), data=st.data())
@fuzz(400)
def test_a_cut_file_keeps_exactly_its_complete_records(records, layout, data):
    if layout == "jsonl":  # a JSON Lines file is told by its first character: '{'
        records = [r for r in records if isinstance(r, dict)]
    text, spans = serialize(records, layout)
    cut = data.draw(st.integers(0, len(text)), label="cut")
    if not text[:cut].strip():
        try:
            parse_records(text[:cut], "cut.json")
        except UserError as err:
            assert "cut.json" in str(err) and "empty" in str(err)
            return
        raise AssertionError("an empty file must be refused")
    got, truncated = parse_records(text[:cut], "cut.json")
    # complete: records whose text ends before the cut; a bare number that the cut ends may have lost digits
    complete = sum(end < cut or (end == cut and not is_number(r)) for r, (_, end) in zip(records, spans))
    if layout == "jsonl":
        inside = any(start < cut < end for start, end in spans)  # a line boundary is a complete file
        assert (got, truncated) == (records[:complete], inside)
    else:
        assert (got, truncated) == (records[:complete], cut <= text.rindex("]"))  # the closing "]" is cut
