"""`dominospec generate`: one chat prompt through the engine; prints the answer, then τ and tokens/s."""

from __future__ import annotations

import dataclasses

import torch

from dominospec.config import EvaluateParams, Params
from dominospec.data.chat import render_prompt as render
from dominospec.draft import draft_dir, load_draft
from dominospec.engine import Generation, Sampling, SpecEngine
from dominospec.errors import UserError
from dominospec.runtime.prepare import prepare_target


def generate(params: Params, prompt: str, mode: str) -> Generation:
    """Params + user message + mode (ar | ngram | dflash | domino | dominotree) -> Generation (answer and stats printed).

    Sampling, max_new_tokens, num_draft, stop strings, seed and threads come from `params.evaluate`,
    the engine's speed knobs from `params.engine`.
    """
    from dominospec.target import load_target

    cfg = params.evaluate
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    sampling = sampling_from(cfg)
    target = load_target(params.target)
    draft = None if mode in ("ar", "ngram") else load_draft(draft_dir(params.paths), target)
    linear = prepare_target(target, params.engine)
    num_draft = None if mode == "ar" or (mode == "ngram" and cfg.num_draft != "auto") else cfg.num_draft
    engine = SpecEngine(target, draft, mode, num_draft, dataclasses.replace(params.engine, linear=linear))
    ids = render(target.tokenizer, [{"role": "user", "content": prompt}], params.target.chat_template_kwargs)
    out = engine.generate(ids, cfg.max_new_tokens, sampling, cfg.stop_strings, seed=cfg.seed)
    s = out.stats
    print(out.text)
    tau = "" if mode == "ar" else f"τ {s.acceptance_length:.2f} over {s.rounds} verify rounds, "
    setup = mode if mode == "ar" else f"{mode}, B={engine.block_size}, K={engine.num_draft}"
    print(f"\n[{setup}, T={cfg.temperature}] {s.new_tokens} tokens in {s.total_s:.2f} s: "
          f"{tau}{s.tokens_per_s:.1f} tokens/s ({out.finish_reason})")
    return out


def sampling_from(cfg: EvaluateParams) -> Sampling:
    """evaluate params -> Sampling; a bad value raises UserError naming the key."""
    try:
        return Sampling(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    except ValueError as err:
        raise UserError(f"evaluate: {err}") from None
