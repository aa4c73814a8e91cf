"""The regenerate tests share the data tests' helpers (real ShareGPT records, the tokenizer, tiny targets)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
