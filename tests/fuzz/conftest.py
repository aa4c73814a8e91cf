"""The fuzz suite's end-of-run report: how many inputs each property tried (fuzz_helpers.TRIED)."""

from __future__ import annotations

from fuzz_helpers import TRIED


def pytest_terminal_summary(terminalreporter):
    if TRIED:
        per_test = ", ".join(f"{name} {n}" for name, n in sorted(TRIED.items()))
        terminalreporter.write_line(f"fuzzed inputs: {sum(TRIED.values())} ({per_test})")
