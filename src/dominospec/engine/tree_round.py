"""One round of the `dominotree` mode: plan, draft forward, grow the tree, verify it, accept, commit.

The round keeps the engine's invariants (engine.spec): at its start the target KV holds positions
0..start-1, x_start = the last committed token at `start`; after it the KV and the pending
features hold exactly x_start and the accepted drafts. Its shape:

  0. plan (`plan_tree`): the n best nodes of the tree to verify (the full budget N, or auto-K's
     choice, engine.tree_policy), and a prompt lookup: with ngram_assist a hit replaces the draft
     (sampling, or without ngram_fork), or (greedy, ngram_fork) is verified beside the tree as a
     chain under x_start; n = 0 drafts nothing (a lookup round, or a plain step);
  1. the draft forward over the block -> z [K, H], u [K, V] (K = the tree's depth);
  2. the tree (engine.domino_tree): N nodes, best first, grown on the device;
  3. one target forward over [x_start, the best n nodes, the lookup] with ancestors-only attention
     (DraftTree.verify_rows), then the acceptance's one read: greedy, the longest path the target's
     argmax follows (the tree's or the lookup's, the tree's on a tie); sampled, recursive rejection
     sampling over the tree (engine.tree_accept);
  4. commit: the path's rows moved into place in the target KV, the rest cropped, their features
     pending for the draft context; auto-K learns what every budget <= n would have accepted.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch

from dominospec.engine.sampling import Sampling, first_mismatch
from dominospec.engine.tree_accept import GreedyWalk, accept_sampled_tree
from dominospec.engine.tree_policy import choose_nodes
from dominospec.engine.verdict import Verdict

if TYPE_CHECKING:
    from dominospec.engine.domino_tree import DraftTree
    from dominospec.engine.spec import SpecEngine
    from dominospec.engine.stats import GenerationStats


def plan_tree(engine: "SpecEngine", state, room: int, greedy: bool) -> tuple[int, int, list[int]]:
    """-> (n, K, lookup): the best n nodes of a tree of depth K (n = K = 0: no draft forward) and the
    prompt-lookup tokens to verify beside them."""
    lookup, fork = engine._lookup(state, room, greedy)
    if lookup and not fork:
        return 0, 0, lookup
    K = min(engine.num_draft, room)
    if K == 0:
        return 0, 0, lookup
    if not engine.auto or engine.tree_model.unseen:  # a generation's first tree is verified whole: it teaches every budget
        return engine.tree_nodes, K, lookup
    lookups = engine.lookup_acceptance.survival() if lookup else []
    n, L = choose_nodes(engine.cost, engine.tree_model.survival_array(), lookups, engine.tree_nodes, len(lookup))
    return n, K if n else 0, lookup[:L]


def tree_round(engine: "SpecEngine", state, tokens: list[int], start: int, budget: int, sampling: Sampling,
               generator: Optional[torch.Generator], stats: "GenerationStats") -> tuple[int, Optional[str]]:
    """The round (module docstring) -> (tokens committed, finish reason)."""
    x_start = torch.tensor([tokens[-1]], device=engine.device)
    with state.clock.round(stats) as timer:
        n, K, lookup = plan_tree(engine, state, budget - len(tokens) - 1, sampling.greedy)
        timer.begin(device=K > 0)
        lookup_tokens = torch.tensor(lookup, dtype=torch.long, device=engine.device) if lookup else None
        with timer.phase("draft"):
            block = engine._draft_forward(state, x_start, start, K) if K else None
        with timer.phase("rollout"):
            tree = engine.grower.grow(*block, x_start, sampling) if block is not None else None
        with timer.phase("verify"):
            verdict = verify_tree(state, x_start, tree, n, lookup, lookup_tokens, sampling, generator, timer)
            m, reason = engine._commit(state, tokens, verdict.tokens, verdict.rows, verdict.features, start, budget)
        timer.drafted = verdict.branches + verdict.lookup > 0

    path = verdict.draft_rows  # the tree's verify rows on its accepted path (rows 1..n)
    stats.record_round(verdict.branches + verdict.lookup, m, chain=(K, verdict.n_draft) if K else None)
    stats.tree_rounds += verdict.branches > 1
    stats.tree_side_wins += bool(path) and path[0] != 1  # the path left the draft's best first token
    stats.lookup_rounds += verdict.lookup > 0 and not K
    stats.fork_rounds += verdict.lookup > 0 and K > 0
    stats.fork_lookup_wins += verdict.lookup > 0 and K > 0 and verdict.winner == 1
    if engine.auto:
        engine.tree_model.update(verdict.branches, [(r - 1, depth) for depth, r in enumerate(path, start=1)])
        engine.acceptance.update(K, verdict.n_draft)
        if engine.lookup_acceptance is not None:
            engine.lookup_acceptance.update(verdict.lookup, verdict.n_lookup)
    return m, reason


def verify_tree(state, x_start: torch.Tensor, tree: Optional["DraftTree"], n: int, lookup: list[int],
                lookup_tokens: Optional[torch.Tensor], sampling: Sampling, generator: Optional[torch.Generator],
                timer) -> Verdict:
    """One target forward over [x_start, the tree's best n nodes, the lookup] -> Verdict: the
    longest accepted path (greedy) or the rejection sampler's (sampled). Its `branches` are the n
    nodes verified, `n_draft` the accepted path's length in the tree, `winner` 1 when the lookup's
    path was kept (0: the tree's)."""
    n = min(n, tree.size) if tree is not None else 0
    L = len(lookup)
    ids = torch.cat([x_start] + ([tree.tokens[:n]] if n else []) + ([lookup_tokens] if L else []))
    if tree is not None:
        shape, parents = tree.verify_rows(n, L)
    else:  # a lookup alone (or a plain step): one chain
        shape, parents = None, chain_parents(1 + L, x_start.device)
    logits, features = state.kv.forward(ids[None], keep=1 + n + L, tree=shape)
    with timer.waiting():
        if sampling.greedy:
            walk = GreedyWalk(ids, parents, logits[0])
            tree_path, lookup_path = walk.path(range(1, n + 1)), walk.path(range(n + 1, n + L + 1))
            path = lookup_path if len(lookup_path) > len(tree_path) else tree_path
            rows, nxt = [0] + path, walk.choice[path[-1] if path else 0]
            accepted = [walk.proposed[r] for r in path]
            n_lookup = first_mismatch(lookup, [walk.choice[0]] + [walk.choice[n + k] for k in range(1, L + 1)])[0] if L else 0
        else:
            rows, accepted, nxt = accept_sampled_tree(ids, parents, sampling.probs(logits[0]), generator)
            tree_path = [r for r in rows[1:] if r <= n]
            n_lookup = len(rows) - 1 - len(tree_path)
    lookup_won = bool(rows[1:]) and rows[1] > n
    return Verdict(accepted + [nxt], rows, features, drafted=int(tree is not None), branches=n, lookup=L,
                   n_chain=len(tree_path), n_draft=len(tree_path), n_lookup=n_lookup, winner=int(lookup_won),
                   branched=n > 1 or (n > 0 and L > 0), draft_rows=tuple(tree_path))


def chain_parents(T: int, device: torch.device) -> torch.Tensor:
    """Parent rows of a chain of T rows: row i's parent is i - 1 (row 0 its own). Cached by shape."""
    return _chain_parents(T, torch.device(device))


@functools.lru_cache(maxsize=256)
def _chain_parents(T: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(T) - 1).clamp_min(0).to(device)
