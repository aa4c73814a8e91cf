"""An append-only JSON Lines journal of finished work, so a killed run resumes where it stopped.

Line 1 is a header `{"fingerprint": {...}}` naming the inputs the work depends on; every further
line is one finished unit `{"unit": int, "entries": [...]}`, written with a single write, flushed
and fsynced. On load, a torn last line (the run died mid-write) is cut away, and a journal whose
fingerprint differs from the current inputs is discarded: its work would not match.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


class Journal:
    """Finished units of work (unit index -> entries) for one fingerprint of the inputs."""

    def __init__(self, path: str | Path, fingerprint: dict[str, Any]):
        self.path = Path(path)
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back from JSON

    def load(self) -> dict[int, list[Any]]:
        """The journal file -> {unit: entries}; starts a fresh journal when there is none or it is stale."""
        if not self.path.is_file():
            return self._start()
        data = self.path.read_bytes()
        units: dict[int, list[Any]] = {}
        good = 0  # byte length of the valid prefix
        for number, line in enumerate(data.split(b"\n")[:-1]):  # the part after the last newline is torn
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            if not isinstance(record, dict):
                break
            if number == 0:
                if record.get("fingerprint") != self.fingerprint:
                    print(f"{self.path}: made for other inputs; starting afresh", file=sys.stderr)
                    return self._start()
            elif isinstance(record.get("unit"), int) and isinstance(record.get("entries"), list):
                units[record["unit"]] = record["entries"]
            else:
                break
            good += len(line) + 1
        if good == 0:
            return self._start()
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
        return units

    def append(self, unit: int, entries: list[Any]) -> None:
        """Record one finished unit, durably."""
        self._write_line({"unit": unit, "entries": entries})

    def remove(self) -> None:
        """Delete the journal (after the result it fed is safely written)."""
        self.path.unlink(missing_ok=True)

    def _start(self) -> dict[int, list[Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        self._write_line({"fingerprint": self.fingerprint})
        return {}

    def _write_line(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with open(self.path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
