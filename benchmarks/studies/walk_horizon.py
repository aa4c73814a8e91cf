"""Why a val walk can read higher than evaluate: the walk by answer horizon, on val and test prompts alike.

The train stage's val walk (train.walk) runs over the target's own val replies as regenerate wrote
them, up to `regenerate.max_new_tokens`; evaluate's engine decodes `evaluate.max_new_tokens` tokens
of each test prompt. This script answers the first N first-turn prompts of the prepared val split
and of the ShareGPT test split with the target itself (greedy, the regenerate stage's batched
decoder, no loop cut, up to --new-tokens), scores the draft once at every anchor of every answer
(train.walk.accepted_drafts, teacher-forced: exact for greedy drafting), then walks each answer cut
to each horizon:

    τ(h) = walk over each answer's first h tokens      (h = evaluate's max_new_tokens: what evaluate sees)
    tail = walk over the tokens past --split alone      (what a longer val reply adds)

It also counts the tokens that repeat an n-gram the answer already holds (loops), by window, and
whether re-tokenising the decoded answer (as regenerate stores it: text) gives back its tokens
(answers alike; the share of answer tokens outside the blocks the two sequences share).

    python benchmarks/studies/walk_horizon.py [--params params.yaml] [--prompts 48] [--new-tokens 256] [--horizons 64,128,160,256]

Prints one markdown table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import time
from difflib import SequenceMatcher

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its `common` package

from common.cli import load_draft, load_target, parser, setup  # noqa: E402


def first_turns(prepared: str, split: str, limit: int, tokenizer, chat_template_kwargs,
                max_prompt_tokens: int) -> list[list[int]]:
    """A prepared split -> the rendered first user turn of its first conversations, at most `limit`
    (as evaluate's `sharegpt` suite renders the test split's)."""
    from dominospec.data.chat import render_prompt as render
    from dominospec.eval.prompts import sharegpt_conversations

    prompts = []
    for messages in sharegpt_conversations(prepared, split):
        ids = render(tokenizer, messages, chat_template_kwargs)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == limit:
            break
    return prompts


def answer_all(target, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Prompts -> the target's greedy answers (stop token excluded), decoded together in one batch."""
    from dominospec.regenerate.decoder import DecodePolicy, ReplyStream
    from dominospec.regenerate.kv_batch import SlotKV, grouped_attention_on
    from dominospec.stops import stop_token_ids

    stops = stop_token_ids(target.tokenizer, target.model)
    kv = SlotKV(target.num_layers, len(prompts), capacity=64, limit=max(map(len, prompts)) + new_tokens + 1,
                device=target.device)
    stream = ReplyStream(target.model, kv, DecodePolicy(stop_ids=tuple(stops), pad_id=stops[0]))
    answers: dict[int, list[int]] = {}
    with grouped_attention_on(target.model, kv), torch.no_grad():
        for i, prompt in enumerate(prompts):
            stream.start(i, prompt, new_tokens)
        while stream.running:
            for i, reply in stream.step():
                answers[i] = reply.tokens
                stream.end(i)
    return [answers[i] for i in range(len(prompts))]


def repeated(answer: list[int], n: int) -> list[bool]:
    """answer -> [T]: token t closes an n-gram the answer already held (it continues a loop)."""
    seen, out = set(), []
    for t in range(len(answer)):
        gram = tuple(answer[t - n + 1 : t + 1]) if t >= n - 1 else None
        out.append(gram is not None and gram in seen)
        if gram is not None:
            seen.add(gram)
    return out


def main() -> None:
    from dominospec.cache.features import target_hidden
    from dominospec.train.walk import WalkStats, accepted_drafts, walk_reply

    p = parser(__doc__, threads=2, prompts=48, new_tokens=256)  # --prompts: first-turn prompts per split
    p.add_argument("--horizons", default="64,128,160,256")
    p.add_argument("--split", type=int, default=128, help="the tail walk starts this many tokens into each answer")
    p.add_argument("--ngram", type=int, default=8, help="n of the repeated-n-gram count")
    args = p.parse_args()
    params = setup(args)
    target = load_target(params)
    draft = load_draft(params, target)
    K, layer_ids = int(draft.config.block_size) - 1, list(draft.config.target_layer_ids)
    heads = [True, False] if draft.config.use_domino_head else [False]
    horizons = [int(h) for h in args.horizons.split(",")]
    tok = target.tokenizer
    rows = []
    for name in ("val", "test"):
        prompts = first_turns(params.paths.prepared, name, args.prompts, tok, params.target.chat_template_kwargs,
                              params.evaluate.max_prompt_tokens)
        tick = time.perf_counter()
        answers = answer_all(target, prompts, args.new_tokens)
        seconds = time.perf_counter() - tick
        walks = {(h, head): WalkStats() for h in horizons + ["tail"] for head in heads}
        flags = []  # per answer [T]: token continues a loop
        retokenised_same = resplit = 0  # answers given back alike; answer tokens outside the matching blocks
        for prompt, answer in zip(prompts, answers):
            again = tok(tok.decode(answer), add_special_tokens=False)["input_ids"]
            retokenised_same += again == answer
            resplit += len(answer) - sum(b.size for b in SequenceMatcher(None, answer, again, autojunk=False).get_matching_blocks())
            flags.append(repeated(answer, args.ngram))
            if len(answer) < 2:
                continue
            ids = torch.tensor(prompt + answer)
            s, e = len(prompt), ids.numel()
            feats = target_hidden(target.model, ids[None], torch.ones_like(ids)[None], layer_ids)[0]
            for head in heads:
                accepted = accepted_drafts(draft, target.embed_tokens, target.lm_head, ids, [(s, e)], feats, K, head)
                for h in horizons:
                    walks[h, head].merge(walk_reply(accepted, s, min(e, s + h), K))
                if e - (s + args.split) >= 2:
                    walks["tail", head].merge(walk_reply(accepted, s + args.split, e, K))
        lengths = [len(a) for a in answers]
        capped = sum(n >= args.new_tokens for n in lengths)
        for h in horizons + ["tail"]:
            head_stats = walks[h, heads[0]]
            cells = [f"{walks[h, head].acceptance_length:.3f} ± {walks[h, head].standard_error():.3f}" for head in heads]
            window = [f[args.split:] if h == "tail" else f[:h] for f in flags]
            looped = sum(map(sum, window)) / max(1, sum(map(len, window)))
            rows.append(f"| {name} | {h if h != 'tail' else f'tokens {args.split}+ alone'} | {' | '.join(cells)} | "
                        f"{len(head_stats.per_reply)} | {capped}/{len(answers)} | {looped:.3f} | "
                        f"{retokenised_same}/{len(answers)} | {resplit / max(1, sum(lengths)):.4f} | {sum(lengths) / seconds:.0f} |")
    cols = " | ".join(["walk τ Domino", "walk τ head off"][: len(heads)] if heads[0] else ["walk τ head off"])
    print(f"K = {K}; {args.prompts} first-turn prompts per split; answers of up to {args.new_tokens} tokens, greedy\n")
    print(f"| split | horizon | {cols} | answers | at the cap | tokens in a repeated {args.ngram}-gram "
          f"| re-tokenised alike | answer tokens re-split | answer tokens/s |")
    print("|" + "---|" * (9 + len(heads) - 1))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
