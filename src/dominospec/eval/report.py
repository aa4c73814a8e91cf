"""Per-suite metrics from the generations of every prompt in every mode.

All rates are pooled over the suite (docs/design.md §6): τ = Σ round tokens ÷ Σ verify rounds (bonus
included, the prefill's first token excluded), tokens/s = Σ new tokens ÷ Σ generation wall time
(prefill included), speedup = mode tokens/s ÷ AR tokens/s; `speedup_decode` leaves the prefill
(and its token) out of both. τ's standard error is over prompts, for the pooled (ratio)
estimator: SE = sqrt(Σ_i (t_i − τ r_i)² / (n (n − 1))) ÷ mean(r_i), with t_i, r_i the round
tokens and rounds of prompt i (the delta method of `relative_standard_error`; None with fewer
than two prompts).
Every speed-up has a standard error over prompts too, paired: the modes ran the same prompts
interleaved, so machine drift moves both sides of a ratio together. For R = (ΣN_m / ΣS_m) ÷
(ΣN_b / ΣS_b), mode m against baseline b (N new tokens, S seconds, per prompt), the delta method
gives SE = R·sqrt(var(z_i) / n), z_i = n_mi/N̄_m − s_mi/S̄_m − n_bi/N̄_b + s_bi/S̄_b.
`speedup_over_ngram` (± SE) is the draft's mode against prompt lookup on the same prompts.
Exact match (greedy only) is the share of prompts whose token ids equal AR's; each divergence
is recorded with the target's top-2 logit margin at that point, so it can be checked against a
near-tie.

Modes: `ar`, `ngram` (prompt lookup), `dflash` (head off, metric suffix `_no_head`) and `domino`
(engine.tree.shape's: DominoTree by default); with the head and a tree also `domino_chain` (Domino
with engine.tree.shape chain: the head against head off on one shape), in `modes` only.
`sampled_report` is the second pass at the suite's sampling setting: τ and speed of AR, head off,
Domino (and its chain) under sampling.
The flat keys describe the draft's mode (`spec_*`, `acceptance_length`, `speedup`, ...), `_no_head`
the head-off mode and `_ngram` prompt lookup; `modes` holds every mode's metrics under one schema.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from dominospec.engine import Generation, SpecEngine

# The two draft modes: head off (metric suffix `_no_head`) and Domino; prompt lookup: `_ngram`.
NO_HEAD, HEAD, NGRAM = "dflash", "domino", "ngram"
# With the head, for comparison in `modes`: Domino's chain, when the configured Domino is DominoTree
CHAIN = "domino_chain"


def relative_standard_error(columns: list[list[float]], signs: tuple[int, ...]) -> Optional[float]:
    """Per-prompt columns x_j [n] and signs e_j -> the delta method's SE over prompts of log R, R = Π mean(x_j)^e_j
    (multiply by R for the SE of R); None with fewer than two prompts or a column of mean <= 0."""
    n = len(columns[0])
    means = [sum(c) / n for c in columns]
    if n < 2 or min(means) <= 0:
        return None
    z = [sum(sign * c[i] / m for sign, c, m in zip(signs, columns, means)) for i in range(n)]
    z_mean = sum(z) / n
    return math.sqrt(sum((zi - z_mean) ** 2 for zi in z) / (n - 1) / n)


def tau_standard_error(generations: list[Generation]) -> Optional[float]:
    """Generations of one mode (one per prompt) -> standard error of the pooled τ over prompts."""
    t = [g.stats.round_tokens for g in generations]
    r = [g.stats.rounds for g in generations]
    relative = relative_standard_error([t, r], (1, -1))  # τ = mean(t) / mean(r)
    return None if relative is None else relative * sum(t) / sum(r)


def speedup_standard_error(mode: list[Generation], baseline: list[Generation]) -> Optional[float]:
    """Generations of two modes on the same prompts (paired by index) -> SE over prompts of the
    pooled speed-up (Σ tokens ÷ Σ seconds of `mode` over the same of `baseline`); None below two prompts."""
    if len(baseline) != len(mode):
        return None
    columns = [[g.stats.new_tokens for g in mode], [g.stats.total_s for g in mode],
               [g.stats.new_tokens for g in baseline], [g.stats.total_s for g in baseline]]
    relative = relative_standard_error(columns, (1, -1, -1, 1))  # R = N̄_m / S̄_m / N̄_b * S̄_b
    if relative is None:
        return None
    return relative * (sum(columns[0]) / sum(columns[1])) / (sum(columns[2]) / sum(columns[3]))


def pooled(generations: list[Generation]) -> dict[str, Any]:
    """Generations of one mode -> pooled τ (and its SE), tokens/s, new tokens, mean per-round costs (ms)."""
    stats = [g.stats for g in generations]
    rounds = sum(s.rounds for s in stats)
    seconds = sum(s.total_s for s in stats)
    new_tokens = sum(s.new_tokens for s in stats)
    decode_s = seconds - sum(s.prefill_s for s in stats)  # the prefill emits one token per prompt
    draft_rounds = sum(s.draft_rounds for s in stats)

    def per_round(attr: str) -> Optional[float]:
        return 1000 * sum(getattr(s, attr) for s in stats) / rounds if rounds else None

    return {
        "new_tokens": new_tokens,
        "rounds": rounds,
        "acceptance_length": sum(s.round_tokens for s in stats) / rounds if rounds else None,
        "acceptance_length_se": tau_standard_error(generations),
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "decode_tokens_per_s": (new_tokens - len(stats)) / decode_s if decode_s > 0 else None,
        "prefill_ms": 1000 * sum(s.prefill_s for s in stats) / len(stats),
        "draft_ms_per_round": per_round("draft_s"),
        "rollout_ms_per_round": per_round("rollout_s"),
        "verify_ms_per_round": per_round("verify_s"),
        "mean_drafts_per_round": sum(s.proposed for s in stats) / rounds if rounds else None,
        "draft_round_share": draft_rounds / rounds if rounds else None,  # rounds that verified >= 1 draft
        "lookup_round_share": sum(s.lookup_rounds for s in stats) / rounds if rounds else None,  # ngram_assist hits
        "fork_round_share": sum(s.fork_rounds for s in stats) / rounds if rounds else None,  # ngram_fork: chain + lookup
        "fork_lookup_win_share": (sum(s.fork_lookup_wins for s in stats) / forks  # of those, the lookup's branch won
                                  if (forks := sum(s.fork_rounds for s in stats)) else None),
        "tree_round_share": sum(s.tree_rounds for s in stats) / rounds if rounds else None,  # DominoTree: > 1 node
        "tree_side_win_share": (sum(s.tree_side_wins for s in stats) / trees  # of those, the path left the best first token
                                if (trees := sum(s.tree_rounds for s in stats)) else None),
        "draft_round_ms": 1000 * sum(s.draft_round_s for s in stats) / draft_rounds if draft_rounds else None,
        "host_ms_per_round": {phase: 1000 * sum(s.host_s.get(phase, 0.0) for s in stats) / rounds
                              for phase in ("plan", "launch", "wait", "commit")} if rounds else None,
        "wall_ms_per_round": 1000 * (decode_s / rounds) if rounds else None,  # prefill left out
    }


def acceptance_by_position(generations: list[Generation]) -> list[Optional[float]]:
    """-> share of rounds accepting >= k drafts, k = 1..K, among rounds that proposed a k-th draft."""
    stats = [g.stats for g in generations]
    K = stats[0].num_draft
    accepted = [sum(s.position_accepted[k] for s in stats) for k in range(K)]
    proposed = [sum(s.position_proposed[k] for s in stats) for k in range(K)]
    return [a / p if p else None for a, p in zip(accepted, proposed)]


def first_divergence(reference: list[int], other: list[int]) -> Optional[int]:
    """Index of the first differing token (or where the shorter one ends), None when equal."""
    if reference == other:
        return None
    return next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))


@torch.inference_mode()
def top2_margin(engine: SpecEngine, context: list[int]) -> float:
    """Target's logit gap between its two best next tokens after `context` (one full forward)."""
    ids = torch.tensor([context], device=engine.device)
    logits = engine.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def suite_report(
    runs: list[dict[str, Generation]],
    prompts: list[list[int]],
    spec_mode: str,
    greedy: bool,
    ar_engine: SpecEngine,
    skipped_too_long: int,
) -> dict[str, Any]:
    """Per-prompt generations {mode: Generation} -> the suite's entry of eval.json."""
    by_mode = {mode: [r[mode] for r in runs] for mode in runs[0]}
    ar, spec, no_head = pooled(by_mode["ar"]), pooled(by_mode[spec_mode]), pooled(by_mode[NO_HEAD])
    divergences = []
    if greedy:
        for i, (prompt, run) in enumerate(zip(prompts, runs)):
            reference = run["ar"].token_ids
            for mode in (m for m in run if m != "ar"):
                at = first_divergence(reference, run[mode].token_ids)
                if at is not None:
                    divergences.append({
                        "prompt": i, "mode": mode, "position": at,
                        "ar_token": reference[at] if at < len(reference) else None,
                        "spec_token": run[mode].token_ids[at] if at < len(run[mode].token_ids) else None,
                        "top2_margin": top2_margin(ar_engine, prompt + reference[:at]),
                    })

    def exact(mode: str) -> Optional[float]:
        if not greedy:
            return None  # sampled outputs differ by design; losslessness is distributional
        return sum(r[mode].token_ids == r["ar"].token_ids for r in runs) / len(runs)

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a is not None and b else None

    modes = {}
    for mode, generations in by_mode.items():
        p = pooled(generations)
        modes[mode] = {**p, "speedup": ratio(p["tokens_per_s"], ar["tokens_per_s"]),
                       "speedup_se": speedup_standard_error(generations, by_mode["ar"]) if mode != "ar" else None,
                       "speedup_decode": ratio(p["decode_tokens_per_s"], ar["decode_tokens_per_s"]),
                       "exact_match": exact(mode) if mode != "ar" else None,
                       "acceptance_by_position": acceptance_by_position(generations) if mode != "ar" else None}
    ngram = modes.get(NGRAM, {})
    ar_step = ar["verify_ms_per_round"]
    return {
        "n_prompts": len(runs),
        "skipped_too_long": skipped_too_long,
        "new_tokens": spec["new_tokens"],
        "ar_new_tokens": ar["new_tokens"],
        "acceptance_length": spec["acceptance_length"],
        "acceptance_length_se": spec["acceptance_length_se"],
        "acceptance_length_no_head": no_head["acceptance_length"],
        "acceptance_length_no_head_se": no_head["acceptance_length_se"],
        "acceptance_length_ngram": ngram.get("acceptance_length"),
        "acceptance_length_ngram_se": ngram.get("acceptance_length_se"),
        "verify_rounds": spec["rounds"],
        "ar_tokens_per_s": ar["tokens_per_s"],
        "spec_tokens_per_s": spec["tokens_per_s"],
        "no_head_tokens_per_s": no_head["tokens_per_s"],
        "ngram_tokens_per_s": ngram.get("tokens_per_s"),
        "speedup": ratio(spec["tokens_per_s"], ar["tokens_per_s"]),
        "speedup_no_head": ratio(no_head["tokens_per_s"], ar["tokens_per_s"]),
        "speedup_ngram": ngram.get("speedup"),
        "speedup_se": modes[spec_mode]["speedup_se"],
        "speedup_no_head_se": modes[NO_HEAD]["speedup_se"],
        "speedup_ngram_se": ngram.get("speedup_se"),
        # the draft's mode against prompt lookup, paired by prompt: > 1 when training the draft paid
        "speedup_over_ngram": ratio(spec["tokens_per_s"], ngram.get("tokens_per_s")),
        "speedup_over_ngram_se": speedup_standard_error(by_mode[spec_mode], by_mode[NGRAM]) if ngram else None,
        "speedup_decode": ratio(spec["decode_tokens_per_s"], ar["decode_tokens_per_s"]),  # prefill excluded
        "exact_match": exact(spec_mode),
        "exact_match_no_head": exact(NO_HEAD),
        "exact_match_ngram": ngram.get("exact_match"),
        "divergences": divergences,
        "max_divergence_margin": max((d["top2_margin"] for d in divergences), default=None),
        "acceptance_by_position": acceptance_by_position(by_mode[spec_mode]),
        "acceptance_by_position_no_head": acceptance_by_position(by_mode[NO_HEAD]),
        "cost_ms": {
            "ar_step": ar_step,
            "draft": spec["draft_ms_per_round"],
            "rollout": spec["rollout_ms_per_round"],
            "verify": spec["verify_ms_per_round"],
            "rollout_no_head": no_head["rollout_ms_per_round"],
            "prefill": ar["prefill_ms"],
            "draft_round": spec["draft_round_ms"],  # a round that verified drafts (auto-K's plain steps left out)
        },
        # (draft + rollout + verify) ÷ AR step: per round as run, and per round that drafted
        "round_over_ar_step": ratio(sum(spec[k] for k in ("draft_ms_per_round", "rollout_ms_per_round",
                                                          "verify_ms_per_round")), ar_step),
        "draft_round_over_ar_step": ratio(spec["draft_round_ms"], ar_step),
        "modes": modes,
    }


def sampled_report(runs: list[dict[str, Generation]], sampling: Any) -> dict[str, Any]:
    """Per-prompt generations {mode: Generation} of a sampled pass -> {temperature, top_p, top_k, modes:
    {mode: pooled τ ± SE, tokens/s, speed-up over AR ± SE (paired by prompt), acceptance by position}}."""
    by_mode = {mode: [r[mode] for r in runs] for mode in runs[0]}
    ar = pooled(by_mode["ar"])
    modes = {}
    for mode, generations in by_mode.items():
        p = pooled(generations)
        modes[mode] = {key: p[key] for key in ("acceptance_length", "acceptance_length_se", "tokens_per_s", "rounds",
                                               "new_tokens", "mean_drafts_per_round", "tree_round_share",
                                               "tree_side_win_share")}
        modes[mode]["speedup"] = p["tokens_per_s"] / ar["tokens_per_s"] if ar["tokens_per_s"] else None
        modes[mode]["speedup_se"] = speedup_standard_error(generations, by_mode["ar"]) if mode != "ar" else None
        modes[mode]["acceptance_by_position"] = acceptance_by_position(generations) if mode != "ar" else None
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "n_prompts": len(runs), "modes": modes}
