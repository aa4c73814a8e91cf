"""The batched KV-cache decoder of the regenerate stage against plain references, on tiny fp32 models.

Greedy replies must be exactly the target's: per prompt against HF `generate`, and for whole
multi-turn conversations against a loop that recomputes the full context for every token
(no cache, no batch, no padding). Loop cutting, sampling and the cache's row operations too.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from data_helpers import REPO, smollm2_tokenizer, tiny_target_dir  # noqa: F401
from transformers import LlamaConfig, LlamaForCausalLM

from dominospec.config import load_params
from dominospec.data.chat import render_text
from dominospec.regenerate.decoder import DecodePolicy, ReplyStream, next_tokens
from dominospec.regenerate import decoder, kv_batch, replies
from dominospec.regenerate.kv_batch import SlotKV, grouped_attention_on
from dominospec.regenerate.loops import LoopDetector
from dominospec.regenerate.replies import decode_policy, rewrite_conversations
from dominospec.target import load_target

STOP = 2


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    """A random fp32 Llama, vocab 300, GQA 4/2 heads; wide weights so greedy margins are large."""
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    """The tiny random Llama with SmolLM2's tokenizer, loaded as the stage loads a target (fp32)."""
    defaults = load_params(REPO / "params.yaml").target
    return load_target(dataclasses.replace(defaults, model=str(tiny_target_dir), gguf_file=None, device="cpu"))


def _greedy_reference(model, context: list[int], budget: int, stops, loops: LoopDetector | None = None):
    """Full recompute per token -> (kept reply tokens, stopped, cut)."""
    out: list[int] = []
    for _ in range(budget):
        with torch.no_grad():
            token = int(model(torch.tensor([context + out])).logits[0, -1].argmax())
        if token in stops:
            return out, True, False
        out.append(token)
        cut = loops.push(token) if loops else None
        if cut is not None:
            return out[:cut], False, True
    return out, False, False


def _run(stream: ReplyStream) -> dict:
    """Step until no reply is running -> {key: Reply}."""
    done = {}
    while stream.running:
        done.update(stream.step())
    return done


@pytest.mark.parametrize("group_slots, prefill_tokens", [(2, 1024), (16, 1024), (2, 20)])
def test_batched_greedy_replies_equal_hf_generate(tiny_llama, group_slots, prefill_tokens, monkeypatch):
    """First turns are prefilled packed (several per forward, <= PREFILL_TOKENS; the 31-token prompt
    alone in chunks when that is 20), then decoded in groups of slots."""
    monkeypatch.setattr(decoder, "PREFILL_TOKENS", prefill_tokens)
    packs = []
    pack_once = ReplyStream._prefill_pack
    monkeypatch.setattr(ReplyStream, "_prefill_pack", lambda self, pack: (packs.append([len(t) for _, t in pack]),
                                                                          pack_once(self, pack)))
    torch.manual_seed(1)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (5, 31, 1, 12, 18)]
    budgets = [12, 20, 7, 1, 30]
    kv = SlotKV(2, len(prompts), capacity=4, group_slots=group_slots)  # small: the buffers must grow while decoding
    with grouped_attention_on(tiny_llama, kv):
        stream = ReplyStream(tiny_llama, kv, DecodePolicy(stop_ids=(STOP,)))
        for key, (prompt, budget) in enumerate(zip(prompts, budgets)):
            stream.start(key, prompt, budget)
        replies = _run(stream)
    assert all(sum(p) <= prefill_tokens for p in packs) and max(map(len, packs)) >= 2
    assert sorted(n for p in packs for n in p) == sorted(n for n in (5, 31, 1, 12, 18) if n <= prefill_tokens)
    assert tiny_llama.config._attn_implementation == "sdpa"  # the switch is undone
    for key, (prompt, budget) in enumerate(zip(prompts, budgets)):
        with torch.no_grad():
            ref = tiny_llama.generate(torch.tensor([prompt]), max_new_tokens=budget, do_sample=False,
                                      eos_token_id=STOP, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
        reply = replies[key]
        assert reply.tokens + [STOP] * reply.stopped == ref
        assert reply.generated == len(ref) and reply.unfed == ([] if reply.stopped else ref[-1:])
        assert stream.context_length(key) == len(prompt) + len(ref) - 1  # every token but the last picked one


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_replies_on_the_models_device(tiny_llama, device):
    """The slots' buffers and the per-group decoding masks live on the model's device (CUDA runs it on a
    GPU machine; its default group is wider): replies equal HF `generate` there."""
    model = copy.deepcopy(tiny_llama).to(device)
    torch.manual_seed(3)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (7, 19, 2, 40, 11, 5)]
    kv = SlotKV(2, len(prompts), capacity=4, device=device)
    assert kv.group_slots == (kv_batch.GROUP_SLOTS_CUDA if device == "cuda" else kv_batch.GROUP_SLOTS)
    with grouped_attention_on(model, kv):
        stream = ReplyStream(model, kv, DecodePolicy(stop_ids=(STOP,)))
        for key, prompt in enumerate(prompts):
            stream.start(key, prompt, 16)
        stream.step()
        assert {m.device.type for *_, m in kv.layer_groups(0)} == {torch.device(device).type}
        replies = {key: reply for key, reply in stream.step()}
        replies.update(_run(stream))
    for key, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt], device=device), max_new_tokens=16, do_sample=False,
                                 eos_token_id=STOP, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
        assert replies[key].tokens + [STOP] * replies[key].stopped == ref


def test_slots_continue_after_others_end(tiny_llama):
    """A key's next reply continues from its slot, also after another key ended and the slots were compacted."""
    torch.manual_seed(2)
    prompts = [torch.randint(3, 300, (n,)).tolist() for n in (3, 9, 6)]
    extra = {0: [11, 12], 2: [17]}
    kv = SlotKV(2, 3, group_slots=2)  # slots 0, 1 | 2: the compaction regroups across groups
    with grouped_attention_on(tiny_llama, kv):
        stream = ReplyStream(tiny_llama, kv, DecodePolicy(stop_ids=(STOP,)))
        for key, prompt in enumerate(prompts):
            stream.start(key, prompt, 5)
        first = _run(stream)
        stream.end(1)
        assert stream.kv.slots == 2  # compacted
        for key, tokens in extra.items():
            stream.start(key, first[key].unfed + tokens, 4)
        second = _run(stream)
    for key, tokens in extra.items():
        want, _, _ = _greedy_reference(tiny_llama, prompts[key] + first[key].tokens + tokens, 4, (STOP,))
        assert second[key].tokens == want


def _conversations() -> list[list[dict[str, str]]]:
    long = "Explain, step by step and with examples, how a hash map handles collisions. " * 3
    return [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Tell me a joke about cats."}, {"role": "assistant", "content": "..."},
         {"role": "user", "content": "Another one."}, {"role": "assistant", "content": "..."}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": long},
         {"role": "assistant", "content": "..."}],
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 3+3? " * 14}, {"role": "assistant", "content": "6"}],
        [{"role": "user", "content": "Name three rivers."}, {"role": "assistant", "content": "Nile"}],
    ]  # fmt: skip


def _reference_rewrite(target, conversation, cfg, max_length):
    """One conversation, turn by turn, recomputing its whole token context for every token."""
    tokenizer, policy = target.tokenizer, decode_policy(target, cfg)
    history, context, text, replies = [], [], "", []
    for k, message in enumerate(conversation):
        if message["role"] != "assistant":
            history.append(dict(message))
            continue
        prompt = render_text(tokenizer, history, True, {})
        assert prompt.startswith(text)
        context = context + tokenizer(prompt[len(text) :], add_special_tokens=False)["input_ids"]
        budget = min(cfg.max_new_tokens, max_length - len(context))
        if budget <= 0:
            break
        loops = LoopDetector(policy.loop_ngram, policy.loop_repeats)
        tokens, _, _ = _greedy_reference(target.model, context, budget, policy.stop_ids, loops)
        content = tokenizer.decode(tokens, skip_special_tokens=True)
        history.append({"role": "assistant", "content": content})
        replies.append(content)
        context, text = context + tokens, prompt + content
    return replies


@pytest.mark.parametrize("loop_ngram", [None, 2])
@pytest.mark.parametrize("batch_size, group_slots", [(1, 16), (4, 16), (4, 2)])
def test_multi_turn_greedy_equals_full_recompute(tiny_target, batch_size, group_slots, loop_ngram, monkeypatch):
    monkeypatch.setattr(kv_batch, "GROUP_SLOTS", group_slots)
    cfg = dataclasses.replace(load_params(REPO / "params.yaml").regenerate, max_new_tokens=24, temperature=0.0,
                              dtype="float32", loop_ngram=loop_ngram, loop_repeats=2)  # fmt: skip
    conversations, max_length = _conversations(), 160
    got = []
    for start in range(0, len(conversations), batch_size):
        got += rewrite_conversations(tiny_target, conversations[start : start + batch_size], cfg, max_length, {})
    for conversation, rewritten in zip(conversations, got):
        want = _reference_rewrite(tiny_target, conversation, cfg, max_length)
        assert [m["content"] for m in rewritten.messages if m["role"] == "assistant"] == want
        assert rewritten.assistant_turns == len(want) >= 1
    assert sum(r.assistant_turns for r in got) > len(conversations)  # later turns were exercised
    assert sum(r.replies_at_max_length for r in got) >= 1  # conversation 2 runs into max_length
    if loop_ngram:
        assert sum(r.replies_loop_cut for r in got) >= 1  # the random model loops; cuts must match the reference


def test_a_template_that_rewrites_history_restarts_the_conversation_in_its_batch(tiny_target, monkeypatch):
    """Qwen3's template, say, drops earlier replies' reasoning: the next prompt is then no extension of
    what the slot holds, and the conversation starts afresh from its full rendering, while the others
    of its batch keep their slots (and the slot it gave up is there to take again)."""
    cfg = dataclasses.replace(load_params(REPO / "params.yaml").regenerate, max_new_tokens=8, temperature=0.0,
                              dtype="float32")  # fmt: skip
    turn_marked = lambda tok, msgs, add_generation_prompt, kwargs: (  # noqa: E731
        f"[{sum(m['role'] == 'assistant' for m in msgs)}]" + render_text(tok, msgs, add_generation_prompt, kwargs))
    monkeypatch.setattr(replies, "render_text", turn_marked)
    conversations, max_length = _conversations(), 160
    got = rewrite_conversations(tiny_target, conversations, cfg, max_length, {})
    tokenizer, stops = tiny_target.tokenizer, decode_policy(tiny_target, cfg).stop_ids
    for conversation, rewritten in zip(conversations, got):
        history = []
        for message in rewritten.messages:
            if message["role"] == "assistant":  # each reply: greedy from its own full rendering
                ids = tokenizer(turn_marked(tokenizer, history, True, {}), add_special_tokens=False)["input_ids"]
                want, _, _ = _greedy_reference(tiny_target.model, ids, min(8, max_length - len(ids)), stops)
                assert message["content"] == tokenizer.decode(want, skip_special_tokens=True)
            history.append(message)
    assert sum(r.assistant_turns for r in got) > len(conversations)  # later turns, hence restarts, ran


def test_every_prompt_is_rendered_with_the_targets_chat_template_kwargs(tiny_target, monkeypatch):
    """The replies are the target's answers to the prompts users send (params target.chat_template_kwargs)."""
    cfg = dataclasses.replace(load_params(REPO / "params.yaml").regenerate, max_new_tokens=4, temperature=0.0,
                              dtype="float32")  # fmt: skip
    seen = []

    def recording(tok, msgs, add_generation_prompt, kwargs):
        seen.append((add_generation_prompt, dict(kwargs)))
        return render_text(tok, msgs, add_generation_prompt, kwargs)

    monkeypatch.setattr(replies, "render_text", recording)
    got = rewrite_conversations(tiny_target, _conversations(), cfg, 160, {"enable_thinking": False})
    assert sum(r.assistant_turns for r in got) > len(got)  # later turns rendered too
    assert seen and all(call == (True, {"enable_thinking": False}) for call in seen)


def test_loop_detector_keeps_one_copy_of_the_loop():
    detector = LoopDetector(ngram=3, repeats=3)
    reply = [7, 8, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 9]  # period 4 after a 2-token lead-in
    cuts = [detector.push(t) for t in reply]
    first = next(i for i, c in enumerate(cuts) if c is not None)
    assert first == 12  # the third [1, 2, 3] ends at index 12
    assert reply[: cuts[first]] == [7, 8, 1, 2, 3, 4]  # cut where the second copy starts
    never = LoopDetector(ngram=None, repeats=3)
    assert all(never.push(t) is None for t in reply)
    distinct = LoopDetector(ngram=2, repeats=2)
    assert all(distinct.push(t) is None for t in range(50))


def test_top_p_near_zero_is_greedy_and_sampling_follows_the_generator():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    nucleus = DecodePolicy(stop_ids=(STOP,), temperature=0.7, top_p=1e-6)
    assert torch.equal(next_tokens(logits, nucleus, torch.Generator().manual_seed(1)), logits.argmax(-1))
    sampled = DecodePolicy(stop_ids=(STOP,), temperature=1.5, top_p=0.9)
    draws = [next_tokens(logits, sampled, torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_regenerate_dtype_is_checked_by_the_typed_config(tmp_path):
    from data_helpers import write_params

    from dominospec.config import ParamsError

    with pytest.raises(ParamsError, match="regenerate.dtype"):
        load_params(write_params(tmp_path / "p.yaml", tmp_path, regenerate={"dtype": "float8"}))


def _prefilled(lengths: list[int], group_slots: int) -> SlotKV:
    """A 1-layer SlotKV whose slot s holds lengths[s] columns of value s + column / 1000."""
    kv = SlotKV(1, len(lengths), capacity=4, group_slots=group_slots)
    for s, n in enumerate(lengths):
        kv.prefill_slot(s, n, torch.float32)
        states = (s + torch.arange(n) / 1000).reshape(1, 1, n, 1).expand(1, 2, n, 3).contiguous()  # [1, kv=2, n, d=3]
        kv.update(states, -states, 0)
        kv.advance(torch.tensor([s]), n)
    kv._slot = None
    return kv


def test_each_group_is_as_wide_as_its_own_longest_slot():
    kv = _prefilled([3, 5, 100, 120, 7], group_slots=2)  # groups: slots 0-1 | 2-3 | 4
    kv.decode_all(torch.float32)
    assert kv.capacities == [64, 128, 64] and kv.capacity == 128
    assert [tuple(k.shape) for k in kv.keys[0]] == [(2, 2, 64, 3), (2, 2, 128, 3), (1, 2, 64, 3)]


def test_keep_regroups_the_slots_it_keeps_with_their_tokens():
    lengths = [3, 5, 100, 120, 7]
    kv = _prefilled(lengths, group_slots=2)
    kv.keep([4, 0, 2])  # new slots 0, 1 | 2 = old 4, 0 | 2
    assert kv.lengths.tolist() == [7, 3, 100] and kv.capacities == [64, 128]
    for new, old in enumerate([4, 0, 2]):
        g, row = divmod(new, 2)
        n = lengths[old]
        want = (old + torch.arange(n) / 1000)[None, :].expand(2, n)  # [kv, n]
        assert torch.equal(kv.keys[0][g][row, :, :n, 0], want) and torch.equal(kv.values[0][g][row, :, :n, 2], -want)


def test_decoding_outside_grouped_attention_is_refused(tiny_llama):
    kv = SlotKV(2, 2, group_slots=2)
    stream = ReplyStream(tiny_llama, kv, DecodePolicy(stop_ids=(STOP,)))
    with grouped_attention_on(tiny_llama, kv):
        stream.start(0, [5, 6, 7], 4)
    with pytest.raises(RuntimeError, match="grouped_attention_on"):
        stream.step()
