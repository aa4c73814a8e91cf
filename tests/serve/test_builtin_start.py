"""The built-in server measures auto-K's round cost while it starts, not inside its first request.

A cost measured on a cold process overprices every shape (first allocations, first kernel runs),
and auto-K then drafts little or nothing for the whole life of the server.
Run: python -m pytest tests/serve/test_builtin_start.py -q
"""

import pytest
from serve_helpers import tiny_project

from dominospec.config import load_params
from dominospec.serve.builtin import load_service


@pytest.mark.parametrize("num_draft, calibrated", [("auto", True), (2, False)])
def test_auto_k_cost_is_measured_at_start_up(tmp_path, num_draft, calibrated):
    service = load_service(load_params(tiny_project(tmp_path, mode="domino", num_draft=num_draft)))
    engine = service.worker.engine
    assert engine.auto == calibrated
    assert (engine.cost is not None) == calibrated
    if calibrated:
        assert len(engine.cost.verify) == engine.max_verify + 1 and all(ms > 0 for ms in engine.cost.verify)
