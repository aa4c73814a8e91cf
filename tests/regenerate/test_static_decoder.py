"""The static-cache batched decoder against today's slot decoder and plain references, on tiny fp32 models.

Greedy replies must equal `ReplyStream`'s token for token (the same stop, loop and budget rules),
whatever the number of slots, the prefill size or the tail's shrinking; the batched forward must
compute the HF model's logits (Llama and Qwen3); the device loop check must cut where
`LoopDetector` does; sampled replies must follow the softmax and depend on their seed alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dominospec.models.lean import DecoderOps, LeanDecoder
from dominospec.regenerate import static_decoder
from dominospec.regenerate.batch_forward import ATTENTIONS, BatchForward
from dominospec.regenerate.decoder import DecodePolicy, ReplyStream
from dominospec.regenerate.kv_batch import SlotKV, grouped_attention_on
from dominospec.regenerate.loops import LoopDetector, loop_cuts
from dominospec.regenerate.picking import counter_uniform, pick
from dominospec.regenerate.static_decoder import ReplyJob, StaticDecoder

STOP = 2


def _wide(model):
    """Random weights of std 0.5: large greedy margins, so fp32 summation order never flips a token."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    return _wide(LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=1024)))


@pytest.fixture(scope="module")
def tiny_qwen3() -> Qwen3ForCausalLM:
    return _wide(Qwen3ForCausalLM(Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                              max_position_embeddings=1024)))


def _prompts(seed: int, lengths) -> list[list[int]]:
    torch.manual_seed(seed)
    return [torch.randint(3, 300, (n,)).tolist() for n in lengths]


def _stream_replies(model, prompts, budgets, policy) -> dict:
    """Today's slot decoder: {index: Reply}."""
    kv = SlotKV(model.config.num_hidden_layers, len(prompts), capacity=4, group_slots=4)
    out = {}
    with grouped_attention_on(model, kv):
        stream = ReplyStream(model, kv, policy)
        for key, (prompt, budget) in enumerate(zip(prompts, budgets)):
            stream.start(key, prompt, budget)
        while stream.running:
            out.update(stream.step())
    return out


def _static_replies(model, jobs, policy, slots, capacity=128, prefill_tokens=64, max_new_tokens=40,
                    attention="padded") -> dict:
    forward = BatchForward(LeanDecoder(model, DecoderOps.reference()), slots, capacity, attention)
    out = {}
    StaticDecoder(forward, policy, max_new_tokens, graphs=False, prefill_tokens=prefill_tokens).run(
        jobs, lambda i, reply: out.__setitem__(i, reply))
    return out


@pytest.mark.parametrize("slots, loop, attention", [
    (4, (None, 3), "padded"), (16, (None, 3), "padded"), (3, (1, 2), "padded"), (5, (2, 2), "padded"),
    (3, (1, 2), "rows"), (5, (2, 2), "rows"),  # the kernel runs interpreted: two cases, with refills and loops
])
def test_greedy_replies_equal_todays_decoder(tiny_llama, slots, loop, attention, monkeypatch):
    """More jobs than slots (refills), prompts of 1 to 40 tokens, prefills of <= 40 tokens, the tail shrunk
    to buckets of 2; either decode attention (`rows`: the Triton kernel, interpreted on the CPU)."""
    monkeypatch.setattr(static_decoder, "MIN_ROWS", 2)
    prompts = _prompts(1, (5, 31, 1, 12, 18, 7, 3, 40, 22, 9, 14, 2))
    budgets = [12, 20, 7, 1, 30, 16, 25, 9, 30, 40, 3, 33]
    policy = DecodePolicy(stop_ids=(STOP,), loop_ngram=loop[0], loop_repeats=loop[1])
    reference = _stream_replies(tiny_llama, prompts, budgets, policy)
    shrinks = []
    shrink = StaticDecoder._shrink
    monkeypatch.setattr(StaticDecoder, "_shrink", lambda self, B, busy: shrinks.append(shrink(self, B, busy)) or shrinks[-1])
    got = _static_replies(tiny_llama, [ReplyJob(tuple(p), b) for p, b in zip(prompts, budgets)], policy, slots,
                          prefill_tokens=40, attention=attention)
    assert sorted(got) == list(range(len(prompts)))
    for i, ref in reference.items():
        assert (got[i].tokens, got[i].generated, got[i].stopped, got[i].loop_cut) == \
            (ref.tokens, ref.generated, ref.stopped, ref.loop_cut), i
    assert min(shrinks) < slots  # the tail ran in smaller buckets
    if loop[0]:
        assert any(r.loop_cut for r in reference.values())  # the rule was exercised
    assert any(r.stopped for r in reference.values()) or loop[0]


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3"])
def test_batched_forward_computes_the_models_logits(name, attention, request):
    """Prefill of right-padded rows into given slots, then decode steps at different positions per row:
    the logits of every row equal the HF model's on that row's whole sequence."""
    model = request.getfixturevalue(name)
    forward = BatchForward(LeanDecoder(model, DecoderOps.reference()), 3, 64, attention)
    prompts = _prompts(2, (6, 11, 3))
    slots = torch.tensor([2, 0, 1])
    ids = torch.zeros(3, 11, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    with torch.inference_mode():
        logits = forward.prefill(slots, ids, torch.tensor([len(p) for p in prompts]))
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i], model(torch.tensor([p])).logits[0, -1], rtol=1e-4, atol=1e-4)
        by_slot = {int(s): list(p) for s, p in zip(slots, prompts)}
        for step in range(3):
            nxt = torch.tensor([7 + step, 50 + step, 90 + step])
            positions = torch.tensor([len(by_slot[s]) for s in range(3)])
            logits = forward.decode(nxt, positions, 64)
            for s in range(3):
                by_slot[s].append(int(nxt[s]))
                torch.testing.assert_close(logits[s], model(torch.tensor([by_slot[s]])).logits[0, -1], rtol=1e-4,
                                           atol=1e-4)


@pytest.mark.parametrize("ngram, repeats", [(1, 2), (2, 3), (3, 2)])
def test_device_loop_cuts_equal_the_loop_detector(ngram, repeats):
    """Token by token over random replies with few distinct tokens (loops come early)."""
    torch.manual_seed(4)
    replies = torch.randint(0, 3, (64, 24))
    for row in range(64):
        detector, expected = LoopDetector(ngram, repeats), []
        for t in range(24):
            cut = detector.push(int(replies[row, t]))
            expected.append(-1 if cut is None else cut)
        counts = torch.arange(1, 25)
        got = loop_cuts(replies[row].expand(24, 24), counts, ngram, repeats).tolist()
        assert got == expected
    assert any(c >= 0 for c in expected)


def test_sampled_picks_follow_the_softmax_and_their_seed():
    """20,000 draws from one row of logits at T = 0.7 land within 0.015 of softmax(logits / 0.7); a row with
    temperature 0 takes the argmax; the uniforms depend on (seed, step) alone."""
    logits = torch.tensor([[1.0, 0.5, -0.2, 2.0, 0.0]]).expand(20000, 5).contiguous()
    seeds, steps = torch.arange(20000), torch.zeros(20000, dtype=torch.long)
    temperature = torch.full((20000,), 0.7)
    drawn = pick(logits, temperature, seeds, steps, 1.0, True)
    frequencies = torch.bincount(drawn, minlength=5).float() / 20000
    torch.testing.assert_close(frequencies, (logits[0] / 0.7).softmax(-1), rtol=0, atol=0.015)
    temperature[::2] = 0
    assert (pick(logits, temperature, seeds, steps, 1.0, True)[::2] == 3).all()
    u = counter_uniform(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]))
    assert len(set(u.tolist())) == 3 and ((u > 0) & (u < 1)).all()
    assert torch.equal(counter_uniform(torch.tensor([6]), torch.tensor([0])), u[2:])
    top = pick(logits[:50], torch.full((50,), 1.0), seeds[:50], steps[:50], 0.01, True)
    assert (top == 3).all()  # top_p near 0 keeps the most likely token only


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_sampled_replies_depend_on_their_seed_alone(tiny_llama, attention):
    """The same jobs on 2 or 7 slots (other rows beside them, other slots) give the same sampled replies;
    the sampled replies differ from the greedy ones and from each other's seeds."""
    prompts = _prompts(5, (4, 9, 13, 6))[: 4 if attention == "padded" else 2]  # the kernel runs interpreted
    policy = DecodePolicy(stop_ids=(STOP,))
    budget = 24 if attention == "padded" else 10
    jobs = [ReplyJob(tuple(p), budget, t, seed) for p in prompts for t, seed in ((0.0, 0), (1.0, 11), (1.0, 12), (0.7, 13))]
    first = _static_replies(tiny_llama, jobs, policy, slots=3, attention=attention)
    second = _static_replies(tiny_llama, jobs, policy, slots=7, attention=attention)
    assert {i: r.tokens for i, r in first.items()} == {i: r.tokens for i, r in second.items()}
    for p in range(len(prompts)):
        greedy, hot, other, warm = (first[4 * p + k].tokens for k in range(4))
        assert hot != greedy and hot != other and warm != greedy


@pytest.mark.slow  # loads the embedded SmolLM2-135M
def test_smollm2_greedy_replies_equal_todays_decoder():
    """The real target in fp32: 6 ShareGPT-style prompts, 24 new tokens, on 4 slots (a refill) -> the replies
    today's slot decoder gives, token for token."""
    from pathlib import Path

    from dominospec.config import load_params
    from dominospec.data.chat import render_prompt
    from dominospec.regenerate.replies import decode_policy
    from dominospec.target import load_target

    params = load_params(Path(__file__).resolve().parents[2] / "params.yaml")
    target = load_target(params.target)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion briefly.",
                 "List three prime numbers.", "How do I reverse a list in Python?", "Who wrote Hamlet?"]
    prompts = [render_prompt(target.tokenizer, [{"role": "user", "content": q}], {}) for q in questions]
    policy = decode_policy(target, dataclasses.replace(params.regenerate, loop_ngram=4, loop_repeats=3))
    reference = _stream_replies(target.model, prompts, [24] * len(prompts), policy)
    got = _static_replies(target.model, [ReplyJob(tuple(p), 24) for p in prompts], policy, slots=4,
                          max_new_tokens=24)
    assert {i: r.tokens for i, r in got.items()} == {i: r.tokens for i, r in reference.items()}
    assert "Paris" in target.tokenizer.decode(got[0].tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_cuda_graph_replays_equal_eager_steps(tiny_llama, attention):
    """On a GPU (Triton kernels): replies with every decode step a replayed CUDA graph equal the eager steps',
    greedy and sampled, and every shape's capture succeeded."""
    import copy

    model = copy.deepcopy(tiny_llama).cuda()
    prompts = _prompts(6, (5, 31, 1, 12, 18, 7, 3, 40, 22, 9, 14, 2))
    jobs = [ReplyJob(tuple(p), 30, t, i) for i, p in enumerate(prompts) for t in (0.0, 1.0)]
    policy = DecodePolicy(stop_ids=(STOP,), loop_ngram=2, loop_repeats=3)
    out = {}
    for graphs in (False, True):
        forward = BatchForward(LeanDecoder(model, DecoderOps.triton()), 8, 128, attention)
        decoder = StaticDecoder(forward, policy, 30, graphs=graphs, prefill_tokens=64)
        replies = {}
        decoder.run(jobs, lambda i, r: replies.__setitem__(i, r.tokens))
        out[graphs] = replies
        assert not decoder.failures and (len(decoder.graphs) > 0) == graphs
    assert out[True] == out[False]
