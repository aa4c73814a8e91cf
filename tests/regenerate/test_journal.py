"""The resume journal: durable units, torn last lines, stale fingerprints."""

from __future__ import annotations

import json

from dominospec.regenerate.journal import Journal


def test_units_survive_a_reload(tmp_path):
    journal = Journal(tmp_path / "work" / "j.jsonl", {"seed": 1})
    assert journal.load() == {}
    journal.append(0, [{"id": "a"}])
    journal.append(2, [{"id": "c"}, {"id": "d"}])
    assert Journal(tmp_path / "work" / "j.jsonl", {"seed": 1}).load() == {0: [{"id": "a"}], 2: [{"id": "c"}, {"id": "d"}]}


def test_a_torn_last_line_is_cut_away_and_appending_continues_cleanly(tmp_path):
    path = tmp_path / "j.jsonl"
    journal = Journal(path, {"seed": 1})
    journal.load()
    journal.append(0, [{"id": "a"}])
    intact = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"unit": 1, "entries": [{"id": "b"')  # the run died mid-write
    reloaded = Journal(path, {"seed": 1})
    assert reloaded.load() == {0: [{"id": "a"}]}
    assert path.read_bytes() == intact
    reloaded.append(1, [{"id": "b"}])
    assert Journal(path, {"seed": 1}).load() == {0: [{"id": "a"}], 1: [{"id": "b"}]}


def test_a_journal_for_other_inputs_is_discarded(tmp_path, capsys):
    path = tmp_path / "j.jsonl"
    old = Journal(path, {"seed": 1})
    old.load()
    old.append(0, [{"id": "a"}])
    assert Journal(path, {"seed": 2}).load() == {}
    assert "made for other inputs" in capsys.readouterr().err
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"fingerprint": {"seed": 2}}]


def test_unreadable_lines_end_the_valid_prefix(tmp_path):
    path = tmp_path / "j.jsonl"
    journal = Journal(path, {"k": [1, 2]})
    journal.load()
    journal.append(0, [1])
    with open(path, "a") as f:
        f.write('"not a unit"\n{"unit": 5, "entries": [5]}\n')
    assert Journal(path, {"k": [1, 2]}).load() == {0: [1]}
