"""`engine.linear`: packed, torch, or auto (the faster one-row forward on this machine), and the
way back from packed kernels (`unpack_linears`).

Run: python -m pytest tests/engine/test_linear_choice.py -q
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import engine_params, random_prompts, tiny_draft, tiny_target

from dominospec.config import load_params
from dominospec.engine import SpecEngine
from dominospec.runtime.prepare import one_row_seconds, prepare_target
from dominospec.runtime.packed import PackedLinear, pack_linears, unpack_linears
from dominospec.errors import UserError

ENGINE = load_params(Path(__file__).resolve().parents[2] / "params.yaml").engine
LINEARS = 4 * 7 + 1  # q k v o gate up down per layer + lm_head (tiny_target, 4 layers)


def packed_count(model: torch.nn.Module) -> int:
    return sum(isinstance(m, PackedLinear) for m in model.modules())


def clock(*seconds: float):
    """A timer that returns these durations in turn (packed is timed first, then torch's)."""
    values = iter(seconds)
    return lambda: next(values)


def test_unpacking_restores_the_same_weights_and_outputs():
    target = tiny_target("llama", vocab=96, dtype=torch.float32)  # tied embeddings
    model = target.model
    ids = torch.tensor([random_prompts(1, 96, seed=3, min_len=9)[0]])
    before = model(input_ids=ids).logits
    embedding = model.get_input_embeddings().weight
    assert pack_linears(model) == LINEARS
    assert unpack_linears(model) == LINEARS and packed_count(model) == 0
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert model.lm_head.weight.data_ptr() == embedding.data_ptr()  # still tied: no copy was made
    assert not any(p.requires_grad for p in model.parameters())
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


@pytest.mark.parametrize("packed_s, torch_s, chosen", [
    (1.0, 2.0, "packed"),   # packed faster (the AMD EPYC)
    (2.0, 1.0, "torch"),    # torch's faster (the Intel Xeon with AMX)
    (1.01, 1.0, "packed"),  # within the tie margin: packed, which also serves multi-row verifies well
])
def test_auto_keeps_the_faster_kernels(packed_s, torch_s, chosen):
    target = tiny_target("qwen3", vocab=96, dtype=torch.float32)
    cfg = dataclasses.replace(ENGINE, linear="auto")
    assert prepare_target(target, cfg, timer=clock(packed_s, torch_s)) == chosen
    assert packed_count(target.model) == (LINEARS if chosen == "packed" else 0)
    draft = tiny_draft(target, block_size=4, seed=4)
    assert SpecEngine(target, draft, "domino", None, dataclasses.replace(cfg, linear=chosen)).decoding.packed == (chosen == "packed")


def test_explicit_choices_and_what_cannot_be_packed():
    target = tiny_target("qwen3", vocab=96, dtype=torch.float32)
    assert prepare_target(target, dataclasses.replace(ENGINE, linear="torch")) == "torch"
    assert packed_count(target.model) == 0
    assert prepare_target(target, dataclasses.replace(ENGINE, linear="packed")) == "packed"
    assert packed_count(target.model) == LINEARS
    assert prepare_target(target, dataclasses.replace(ENGINE, linear="packed")) == "packed"  # again: the same
    assert packed_count(target.model) == LINEARS
    assert prepare_target(target, dataclasses.replace(ENGINE, linear="torch")) == "torch"  # and back
    assert packed_count(target.model) == 0
    fp64 = tiny_target("qwen3", vocab=96, dtype=torch.float64)  # oneDNN packs fp32/bf16 only
    never = clock()  # auto must not time anything when nothing can be packed
    assert prepare_target(fp64, dataclasses.replace(ENGINE, linear="auto"), timer=never) == "torch"


def test_auto_must_be_resolved_before_an_engine_is_built():
    target = tiny_target("qwen3", vocab=96, dtype=torch.float32)
    with pytest.raises(UserError, match="engine.linear: auto .*prepare_target"):
        SpecEngine(target, None, "ar", None, dataclasses.replace(ENGINE, linear="auto"))


def test_auto_with_the_real_timer_stays_lossless():
    """The real clock picks either kernel; whichever it is, AR and Domino give the plain target's tokens."""
    target = tiny_target("qwen3", vocab=96, dtype=torch.float32, scale=0.2)
    prompts = random_prompts(6, 96, seed=2)
    reference = [SpecEngine(target, None, "ar", params=engine_params()).generate(p, 16).token_ids for p in prompts]
    assert one_row_seconds(target) > 0
    cfg = dataclasses.replace(ENGINE, linear="auto")
    chosen = prepare_target(target, cfg)
    options = dataclasses.replace(cfg, linear=chosen)
    draft = tiny_draft(target, block_size=4, seed=4)
    for engine in (SpecEngine(target, None, "ar", None, options), SpecEngine(target, draft, "domino", None, options)):
        assert [engine.generate(p, 16).token_ids for p in prompts] == reference
