"""DominoTree (docs/design.md §1.6): the draft's tree grown best-first over the cumulative draft
log-probability of its paths, log q(t_1) + ... + log q(t_d); a node's children are the `children` most
likely tokens of its own path's Domino distribution (slot j < P: softmax(u_j); slot j >= P: the head's
correction with the path's GRU state, over the block's candidate pool; sampling: the log of the warped
q the chain would draw from). The backbone ran once for the block (z [K, H], u [K, V]).

Scores only fall along a path, so the N best nodes are closed under parents and each is among the N
best of its depth: the tree grows depth by depth, each frontier the <= N best children of the last
(one batched GRU step and correction), then the N best of all K frontiers, a max-heap's tree up to
ties. Shapes depend on (K, N, children) alone: on CUDA the build is one graph (`TreeGrower`).

Invariants: nodes come best first (stable: the shallower on a tie), so a parent precedes its children
and the best n <= N nodes are the tree of budget n (auto-budget, engine.tree_policy). Verify rows
(`DraftTree.verify_rows`): row 0 is x_start (depth 0), node i is row i + 1 at depth d_i; each row sees
the context, its ancestors and itself, written as int64 bitmask words (`DraftTree.bits`,
engine.verify_shape's format) in the same graph: bits = self | bits[parent], K gathers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from dominospec.engine.draft_head import candidate_pool, pooled_head, prepare_head_kernels
from dominospec.engine.sampling import Sampling
from dominospec.engine.verify_shape import Tree, pack_bits, words_for


@dataclass(frozen=True)
class DraftTree:
    """N nodes, best first (node i is verify row i + 1; row 0 is x_start)."""

    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long: the verify row of node i's parent, parents[i] <= i
    depth: torch.Tensor  # [N] long in 1..max_depth
    scores: torch.Tensor  # [N] float32 (or wider): the cumulative draft log-probability (-inf: a dead node)
    bits: torch.Tensor  # [1 + N, words_for(1 + N)] int64: row r's visible rows (itself and its ancestors)
    max_depth: int  # K, on the host: bounds every path

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def verify_rows(self, n: int, lookup: int = 0) -> tuple[Tree, torch.Tensor]:
        """The verify of x_start, the best n nodes, then a lookup chain of `lookup` rows under x_start
        (engine.verify_shape) -> (its Tree: depth [T], bits [T, words_for(T)], T = 1 + n + lookup; parent rows
        [T], row 0 its own). Device ops only: no host -> device copy."""
        T = 1 + n + lookup
        tree_bits = self.bits[:1 + n, :words_for(T)]
        pad = words_for(T) - tree_bits.shape[1]
        depth, parents = [self.depth.new_zeros(1), self.depth[:n]], [self.parents.new_zeros(1), self.parents[:n]]
        bits = [F.pad(tree_bits, (0, pad)) if pad else tree_bits]
        if lookup:
            for part, rows in zip((depth, parents, bits), lookup_chain(n, lookup, self.tokens.device)):
                part.append(rows)
        return Tree(torch.cat(depth), None, torch.cat(bits)), torch.cat(parents)


@functools.lru_cache(maxsize=4096)
def lookup_chain(n: int, lookup: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A lookup chain of L tokens verified after x_start and n nodes -> its rows' depth [L] (1..L), parents
    [L] (row 0, then the row before), bits [L, words_for(1 + n + L)]. Cached by shape (read-only)."""
    rows = torch.arange(1, lookup + 1)  # lookup token k: row n + k, depth k
    parents = torch.where(rows > 1, rows + n - 1, 0)
    visible = torch.zeros(lookup, 1 + n + lookup, dtype=torch.bool)  # row 0, then the chain up to itself
    visible[:, 0] = True
    visible[:, n + 1:] = torch.ones(lookup, lookup, dtype=torch.bool).tril()
    return rows.to(device), parents.to(device), pack_bits(visible).to(device)


def ancestor_bits(parents: torch.Tensor, steps: int) -> torch.Tensor:
    """Parent row of each row [T] (row 0 its own, a parent before its child) -> [T, words_for(T)]
    int64 bitmasks: row i sees row j iff j is i or an ancestor of i. `steps` >= the deepest row's
    depth. Fixed shapes, device ops only (the grower's graph runs it)."""
    own = pack_bits(torch.eye(parents.shape[0], dtype=torch.bool, device=parents.device))
    bits = own
    for _ in range(steps):  # after d passes every row of depth <= d holds its whole path
        bits = own | bits[parents]
    return bits


def grow_tree(draft: Any, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, embed_tokens: Any,
              nodes: int, children: int, pool_size: int, sampling: Sampling = Sampling()) -> DraftTree:
    """z [K, H], u [K, V], x_start [1] -> the best-first DraftTree of min(nodes, reachable) nodes,
    depth <= K (module docstring). Tensor ops only, shapes fixed by (K, nodes, children): capturable."""
    K, V = base_logits.shape
    P = int(draft.config.pure_draft_prefix_len)
    cand = candidate_pool(base_logits, P, pool_size)  # [M] or None: the corrected slots score only these
    w2, scored_base = pooled_head(draft, base_logits, cand)  # [M, r], [K, M] (pool) or [V, r], [K, V]
    state = draft.gru_step(embed_tokens(x_start), z.new_zeros(1, draft.config.gru_hidden_dim))  # s_0 [1, G]
    score = torch.zeros(1, dtype=torch.promote_types(base_logits.dtype, torch.float32), device=z.device)  # frontier's log q [F]
    levels = []  # per depth d = 1..K: (tokens [F_d], scores [F_d], parent index in frontier d - 1 [F_d])
    for j in range(K):  # slot j offers the children of the depth-j frontier (depth j + 1)
        rows = score.shape[0]
        if j < P:  # path-independent: one row, whatever the frontier
            logits, ids = base_logits[j][None].expand(rows, -1), None
        else:
            mid = draft.correction_hidden(z[j][None].expand(rows, -1), state)  # [F, r]
            logits, ids = scored_base[j] + F.linear(mid.to(w2.dtype), w2), cand  # [F, M]
        logq = log_draft_probs(logits, sampling)  # [F, M or V] float32
        offered = min(children, logq.shape[1])
        top = logq.topk(offered, dim=-1)  # [F, c]
        total = (score[:, None] + top.values).flatten()  # [F * c]
        best = total.topk(min(nodes, total.shape[0]))  # sorted: the frontier of depth j + 1
        parent = best.indices // offered
        token = top.indices.flatten()[best.indices]
        token = token if ids is None else ids[token]
        levels.append((token, best.values, parent))
        if j + 1 < K:
            state = draft.gru_step(embed_tokens(token), state[parent])  # each path's own state
            score = best.values
    return select_best(levels, nodes, K)


def log_draft_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Scored logits [F, N] -> log q [F, N] in float32 or wider: the raw softmax (greedy), or the
    warped distribution the chain would draw from (float32; temperature, top-k, top-p: -inf where q = 0)."""
    if sampling.greedy:
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return sampling.probs(logits).log()


def select_best(levels: list, nodes: int, K: int) -> DraftTree:
    """Frontiers by depth, (tokens [F_d], scores [F_d], parent index in frontier d - 1 [F_d]) -> the
    best `nodes` of them (`best_nodes`)."""
    offsets, at = [], 0
    for token, _, _ in levels:
        offsets.append(at)
        at += token.shape[0]
    tokens = torch.cat([t for t, _, _ in levels])  # [S], depth-major
    scores = torch.cat([s for _, s, _ in levels])
    depth = torch.cat([torch.full_like(t, d + 1) for d, (t, _, _) in enumerate(levels)])
    # the parent's index in the concatenation (-1: x_start)
    parent = torch.cat([levels[0][2].new_full(levels[0][2].shape, -1)] +
                       [p + offsets[d - 1] for d, (_, _, p) in enumerate(levels) if d > 0])
    return best_nodes(tokens, scores, depth, parent, nodes, K)


def best_nodes(tokens: torch.Tensor, scores: torch.Tensor, depth: torch.Tensor, parent: torch.Tensor, nodes: int,
               K: int, ancestors: Callable = ancestor_bits) -> DraftTree:
    """Every frontier concatenated depth-major, [S] each (parent: the index of the node's parent in
    the concatenation, -1 for x_start) -> the best `nodes`, best first (stable: on a tie the
    shallower, so a parent precedes its children), their parents as verify rows. `ancestors`:
    `ancestor_bits` or the kernels' one-launch equivalent."""
    n = min(nodes, tokens.shape[0])
    order = torch.sort(scores, descending=True, stable=True).indices[:n]  # [n]
    row_of = torch.zeros(tokens.shape[0] + 1, dtype=torch.long, device=tokens.device)  # concatenation index + 1 -> row
    row_of[order + 1] = torch.arange(1, n + 1, device=tokens.device)
    parents = row_of[parent[order] + 1]  # [n]
    bits = ancestors(torch.cat([parents.new_zeros(1), parents]), K)  # rows 0..n
    return DraftTree(tokens=tokens[order], parents=parents, depth=depth[order], scores=scores[order], bits=bits,
                     max_depth=K)


# the kernels' build holds a row's pool scores in registers: larger pools grow with torch ops
MAX_KERNEL_POOL = 16384


class TreeGrower:
    """The engine's build: `grow(z [K, H], u [K, V], x_start [1], sampling) -> DraftTree`. On the holder
    `graphs` (engine.graphs.DraftGraphs; static caches) it runs on the holder's inputs, one CUDA graph per
    (K, sampling) when enabled, and the tree is the graph's output, valid until the next `grow`; else
    eagerly on the caller's tensors. With `kernels` (engine.decoding) greedy trees grow on
    `dominospec.kernels.tree_grow` where the GRU's input table fits and the pool is at most
    MAX_KERNEL_POOL; the rest runs `grow_tree`'s torch ops. `score_cols`: the kernels' pool columns."""

    def __init__(self, draft: Any, embed_tokens: Any, nodes: int, children: int, pool_size: int, kernels: bool,
                 graphs: Optional[Any] = None, score_cols: Optional[int] = None):
        self.draft, self.embed_tokens = draft, embed_tokens
        self.nodes, self.children, self.pool_size, self.score_cols = nodes, children, pool_size, score_cols
        self.kernels, self.pool = kernel_build(draft, embed_tokens, pool_size) if kernels else (None, None)
        self.graphs = graphs
        if graphs is not None:
            graphs.add("tree build", self._grow)

    def grow(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor,
             sampling: Sampling = Sampling()) -> DraftTree:
        if self.graphs is None:
            return self._grow(z, base_logits, x_start, sampling)
        return self.graphs.run("tree build", z, base_logits, x_start, sampling)

    def _grow(self, z: torch.Tensor, base_logits: torch.Tensor, x_start: torch.Tensor, sampling: Sampling) -> DraftTree:
        if self.kernels is not None and sampling.greedy:
            from dominospec.kernels.pool_select import pool_select
            from dominospec.kernels.tree_grow import ancestor_bits as ancestors, tree_levels

            cand = pool_select(base_logits, self.kernels.head.pure_draft_prefix_len, self.pool_size, self.pool)
            levels = tree_levels(self.kernels, z, base_logits, x_start, cand, self.nodes, self.children,
                                 self.score_cols)
            return best_nodes(levels.tokens, levels.scores, levels.depth, levels.parent, self.nodes, z.shape[0],
                              ancestors)
        return grow_tree(self.draft, z, base_logits, x_start, self.embed_tokens, self.nodes, self.children,
                         self.pool_size, sampling)


def kernel_build(draft: Any, embed_tokens: Any, pool_size: int) -> tuple[Any, Any]:
    """The draft (its head's vocabulary V, dtype and device) -> (the head prepared for the build,
    kernels.tree_grow.TreeWeights; the pool selection's workspace or None), or (None, None) where the
    tree grows with torch ops all the same (TreeGrower)."""
    w2 = draft.embed_proj[2].weight  # [V, r]
    vocab, dtype, device = w2.shape[0], w2.dtype, w2.device
    pooled = 0 < pool_size < vocab
    if (pool_size if pooled else vocab) > MAX_KERNEL_POOL:
        return None, None
    from dominospec.kernels.pool_select import KEY_BITS, pool_workspace
    from dominospec.kernels.tree_grow import tree_weights

    if pooled and dtype not in KEY_BITS:  # checked before the head (and its GRU table) is prepared
        return None, None
    head = prepare_head_kernels(draft, embed_tokens)
    if head.gru.table is None:
        return None, None
    return tree_weights(head), pool_workspace(vocab, pool_size, dtype, device) if pooled else None
