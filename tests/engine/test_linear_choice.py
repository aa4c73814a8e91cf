"""`engine.linear: auto`: both paths of a PackedLinear compute the same function, the faster one is kept.

- A packed model switched to the plain path (`set_packed`) gives the unpacked model's logits, and
  the packed path gives them within fp32 rounding; with 1-row inputs plain and more rows packed,
  each input takes its own path.
- `choose_linear` keeps, for 1-row and for 8-row forwards each, whichever path its timing says is
  faster (timings forced every way): packed, mixed, or the model as loaded (nn.Linear again, tied
  weights still tied); it packs nothing where nothing is packable (fp64).
- `prepare_target` resolves `auto` to packed | torch; `engine_options` of the result packs the
  draft path exactly when the target was packed; greedy decoding then equals the plain engine's.
Run: python -m pytest tests/engine/test_linear_choice.py -q
"""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import random_prompts, tiny_draft, tiny_target

from dominospec.config import load_params
from dominospec.engine import SpecEngine, linear_choice
from dominospec.engine.configure import engine_options, prepare_target
from dominospec.engine.linear_choice import VERIFY_ROWS, choose_linear
from dominospec.engine import packed as packed_module
from dominospec.engine.packed import PackedLinear, pack_linears, packable, set_packed

torch_linear = torch.nn.functional.linear

PARAMS = Path(__file__).resolve().parents[2] / "params.yaml"
pytestmark = pytest.mark.skipif(not packable(torch.zeros(1, 1)), reason="oneDNN linear packing unavailable")


def logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits


def test_both_paths_of_a_packed_model_compute_the_plain_function(monkeypatch):
    target = tiny_target("qwen3", vocab=96)
    ids = torch.tensor([random_prompts(1, 96, seed=1, min_len=12, max_len=12)[0]])
    reference, step_reference = logits(target.model, ids), logits(target.model, ids[:, :1])
    packed = copy.deepcopy(target.model)
    assert pack_linears(packed) > 0
    assert set_packed(packed, False, False) == sum(isinstance(m, PackedLinear) for m in packed.modules())
    assert torch.equal(logits(packed, ids), reference)  # plain path: the same F.linear on the same weights
    set_packed(packed, True, True)
    torch.testing.assert_close(logits(packed, ids), reference, rtol=1e-4, atol=1e-4)
    set_packed(packed, False, True)  # 1-row inputs plain, more rows packed
    plain_calls = []
    monkeypatch.setattr(packed_module.F, "linear", lambda *a: plain_calls.append(1) or torch_linear(*a))
    assert torch.equal(logits(packed, ids[:, :1]), step_reference) and plain_calls
    plain_calls.clear()
    torch.testing.assert_close(logits(packed, ids), reference, rtol=1e-4, atol=1e-4)
    assert not plain_calls  # 12 rows: every layer took the packed path


def forced(one_row_packed_ms, one_row_plain_ms, rows_packed_ms, rows_plain_ms):
    return {(1, True): one_row_packed_ms, (1, False): one_row_plain_ms,
            (VERIFY_ROWS, True): rows_packed_ms, (VERIFY_ROWS, False): rows_plain_ms}


@pytest.mark.parametrize("timings, expected, flags", [
    (forced(1, 2, 1, 2), "packed", (True, True)),  # packed faster everywhere (the EPYC)
    (forced(2, 1, 1, 2), "packed", (False, True)),  # the AR step plain, the verify packed
    (forced(2, 1, 2, 1), "torch", None),  # plain faster everywhere: unpacked again
])
def test_the_faster_path_is_kept_for_each_row_class(monkeypatch, timings, expected, flags):
    target = tiny_target("llama", vocab=96)
    monkeypatch.setattr(linear_choice, "step_ms", lambda model: timings)
    assert choose_linear(target.model) == (expected, timings)
    layers = [m for m in target.model.modules() if isinstance(m, PackedLinear)]
    assert bool(layers) == (flags is not None)
    assert all((m.packed_one_row, m.packed_rows) == flags for m in layers)
    if flags is None:  # the model as loaded, the tied LM head still tied
        assert target.model.lm_head.weight.data_ptr() == target.model.model.embed_tokens.weight.data_ptr()


def test_the_measurement_runs_on_the_real_forward():
    target = tiny_target("llama", vocab=96)
    choice, timings = choose_linear(target.model)
    assert set(timings) == {(1, True), (1, False), (VERIFY_ROWS, True), (VERIFY_ROWS, False)}
    assert all(0 < ms < 10_000 for ms in timings.values())
    faster_packed = [timings[r, True] < timings[r, False] for r in (1, VERIFY_ROWS)]
    assert choice == ("packed" if any(faster_packed) else "torch")


def test_nothing_packable_means_torch():
    target = tiny_target("llama", vocab=8, dtype=torch.float64)
    assert choose_linear(target.model) == ("torch", {})
    assert not any(isinstance(m, PackedLinear) for m in target.model.modules())


@pytest.mark.parametrize("choice", ["packed", "torch"])
def test_prepare_target_resolves_auto_and_the_engine_follows(monkeypatch, choice):
    cfg = dataclasses.replace(load_params(PARAMS).engine, linear="auto", draft_dtype=None, candidate_pool=0)
    timings = forced(1, 2, 1, 2) if choice == "packed" else forced(2, 1, 2, 1)
    monkeypatch.setattr(linear_choice, "step_ms", lambda model: timings)
    plain = tiny_target("llama", vocab=96)
    target = tiny_target("llama", vocab=96)
    draft = tiny_draft(target, block_size=4, head=True)
    resolved = prepare_target(target, cfg)
    assert resolved.linear == choice and engine_options(resolved).packed == (choice == "packed")
    engine = SpecEngine(target, draft, "domino", None, engine_options(resolved))
    assert isinstance(engine.draft_lm_head, PackedLinear) == (choice == "packed")
    ar = SpecEngine(plain, None, "ar")
    for prompt in random_prompts(3, 96, seed=4):
        assert engine.generate(prompt, 12).token_ids == ar.generate(prompt, 12).token_ids
