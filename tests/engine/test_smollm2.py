"""The engine on the real embedded target (SmolLM2-135M-Instruct, fp32 CPU) with an untrained draft.

Short generations: greedy spec == greedy AR token for token in both draft modes, the chat
end-of-turn token stops generation, and the known answer comes out.
Run: python -m pytest tests/engine/test_smollm2.py -q
"""

from pathlib import Path

import pytest
import torch

from engine_helpers import chat_ids as chat, engine_params

from dominospec.config import load_params
from dominospec.engine import SpecEngine
from dominospec.models.domino import DFlashDraftModel, DominoDraftConfig
from dominospec.target import default_layer_ids, load_target

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_target(load_params(REPO / "params.yaml").target)


def random_draft(target, block_size: int) -> DFlashDraftModel:
    """An untrained one-layer draft shaped for the target (MASK: an unused special token)."""
    tc = target.model.config
    torch.manual_seed(0)
    config = DominoDraftConfig(
        vocab_size=target.identity.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=1, num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=tc.hidden_size // tc.num_attention_heads, rope_theta=100000.0, block_size=block_size,
        num_target_layers=target.num_layers, emb_dim=64, target=target.identity.as_dict(),
        dflash_config=dict(mask_token_id=target.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                           target_layer_ids=default_layer_ids(target.num_layers, 5), gru_hidden_dim=128, emb_dim=64),
    )
    return DFlashDraftModel(config).eval().requires_grad_(False)


def test_smollm2_greedy_spec_equals_ar_and_stops_at_end_of_turn(smollm2):
    ar = SpecEngine(smollm2, None, "ar", params=engine_params())
    assert 2 in ar.stop_ids  # <|im_end|>, the chat end-of-turn token
    france = chat(smollm2, "What is the capital of France?")
    answer = ar.generate(france, 20)
    assert answer.text == "The capital of France is Paris." and answer.finish_reason == "stop_token"
    draft = random_draft(smollm2, block_size=8)
    prompts = [france, chat(smollm2, "Write a haiku about autumn leaves.")]
    for prompt in prompts:
        expected = ar.generate(prompt, 12)
        for mode in ("dflash", "domino"):
            out = SpecEngine(smollm2, draft, mode, params=engine_params()).generate(prompt, 12)
            assert out.token_ids == expected.token_ids, mode
            assert out.stats.target_kv_length == out.stats.draft_context_length == len(prompt) + len(out.token_ids) - 1
