"""Auto-budget for DominoTree (docs/design.md §1.6): how many of the tree's best nodes a round verifies.

A round grows all N nodes (one build) and verifies its best n = 0..N (0: no draft forward). The best n
nodes are a tree, so one verified round tells what every smaller budget would have accepted: with the
accepted path's nodes at ranks r_1 < r_2 < ..., the best n accept its first k nodes iff r_k < n.

`TreeModel` keeps counts decayed over a window of W rounds: h[r][k], rounds whose accepted path's
depth-k node had rank r, over tried[r], rounds whose verified tree held rank r. The survival of budget
n is s_k(n) = P(the best n nodes accept >= k drafts) = sum_{r < n} h[r][k] / tried[r]. An unseen rank
is assumed as good as the one before (rank 0: PRIOR), an optimistic prior that retries budgets not
tried lately. (The draft's path probabilities over-credit it: a budget built on them saturates.)

`choose_nodes` picks (n, K_l) with the most expected tokens per ms, a lookup of K_l tokens beside the
tree taken as independent (engine.policy): E = 1 + sum_k s_k(n) + sum_{k <= K_l} (1 - s_k(n)) l_k,
against `RoundCost.best_first_ms`.
"""

from __future__ import annotations

import numpy as np

from dominospec.engine.policy import PRIOR, PRIOR_WEIGHT, RoundCost


class TreeModel:
    """Decayed counts of which rank's node the accepted path passed through at each depth (module docstring).

    Arrays, so that a round's plan costs tens of microseconds at N = 256 (the host, not the GPU, bounds
    a DominoTree round on a small target): tried [N], hit [N, depth]."""

    BLOCK = 32  # ranks per block of the shares' recurrence (`rank_shares`)

    def __init__(self, nodes: int, depth: int, window: int):
        self.nodes, self.depth, self.keep = nodes, depth, 1.0 - 1.0 / max(window, 1)
        self.tried = np.zeros(nodes)  # tried[r]: rounds whose verified tree held the node of rank r
        self.hit = np.zeros((nodes, depth))  # hit[r, k-1]: of those, rank r was the path's depth-k node

    @property
    def unseen(self) -> bool:
        """No round has verified a node yet (a fresh generation's model)."""
        return not self.tried.any()

    def update(self, verified: int, path: list[tuple[int, int]]) -> None:
        """One round that verified the best `verified` nodes and accepted the path [(rank, depth), ...]
        (empty: nothing accepted, or a round without the tree when `verified` is 0)."""
        self.tried *= self.keep
        self.hit *= self.keep
        seen = min(verified, self.nodes)
        self.tried[:seen] += 1.0
        for rank, depth in path:
            if rank < seen and 1 <= depth <= self.depth:
                self.hit[rank, depth - 1] += 1.0

    def rank_shares(self) -> np.ndarray:
        """-> [N, depth]: the estimated share of rounds in which rank r was the path's depth-k node,
        share[r] = (hit[r] + w share[r-1]) / (tried[r] + w), share[-1] = the prior. The recurrence
        share[r] = a[r] + b[r] share[r-1] is solved in blocks of BLOCK ranks (share = M a + P share_in,
        M[i, j] = b[j+1] ... b[i], P[i] = b[0] ... b[i], from log-cumsums of differences <= 0)."""
        B, N, D = self.BLOCK, self.nodes, self.depth
        den = self.tried + PRIOR_WEIGHT
        blocks, pad = -(-N // B), -N % B
        a = np.concatenate([self.hit / den[:, None], np.zeros((pad, D))]).reshape(blocks, B, D)
        log_b = np.concatenate([np.log(PRIOR_WEIGHT / den), np.zeros(pad)]).reshape(blocks, B)
        L = np.cumsum(log_b, axis=1)  # [blocks, B]: log of b[block start] ... b[i]
        M = np.tril(np.exp(np.minimum(L[:, :, None] - L[:, None, :], 0.0)))  # [blocks, B, B]
        inside, carried = M @ a, np.exp(L)[:, :, None]  # [blocks, B, D], [blocks, B, 1]
        share_in = np.zeros(D)
        share_in[0] = PRIOR
        for block in range(blocks):
            inside[block] += carried[block] * share_in
            share_in = inside[block, -1]
        return inside.reshape(blocks * B, D)[:N]

    def survival(self) -> list[list[float]]:
        """-> s[n][k-1] = P(the best n nodes accept >= k drafts), n = 0..N, k = 1..depth: non-increasing
        in k, non-decreasing in n, at most 1."""
        return self.survival_array().tolist()

    def survival_array(self) -> np.ndarray:
        """`survival` as an array [N + 1, depth] (float64): the prefix sums of the rank shares, capped at
        1 and made non-increasing along the depth (a round's policy reads it at every budget)."""
        acc = np.vstack([np.zeros((1, self.depth)), np.cumsum(self.rank_shares(), axis=0)])
        return np.minimum.accumulate(np.minimum(acc, 1.0), axis=1)


def choose_nodes(cost: RoundCost, survival, lookup: list[float], nodes_max: int, kl_max: int) -> tuple[int, int]:
    """Tree survivals s[n] (TreeModel.survival or survival_array), the lookup's survival l_k -> the
    (n, K_l), n <= nodes_max, K_l <= kl_max, with the most expected tokens per ms (the first in (n, K_l)
    order on a tie); (0, 0) is a plain step. All budgets at once, as arrays."""
    s = np.asarray(survival, dtype=np.float64)
    n_max = min(nodes_max, s.shape[0] - 1)
    s = s[:n_max + 1]
    width = max(s.shape[1], kl_max)
    tree = np.hstack([s, np.zeros((s.shape[0], width - s.shape[1]))])  # [n, k]
    l = np.asarray(lookup[:kl_max], dtype=np.float64)
    gain = np.cumsum((1.0 - tree[:, :kl_max]) * l, axis=1) if kl_max else np.zeros((s.shape[0], 0))
    expected = 1.0 + s.sum(axis=1, keepdims=True) + np.hstack([np.zeros((s.shape[0], 1)), gain])  # [n, kl]
    verify = np.asarray(cost.verify, dtype=np.float64)
    n, kl = np.arange(n_max + 1)[:, None], np.arange(kl_max + 1)[None, :]
    ms = np.where(n > 0, cost.draft + cost.tree_build, 0.0) + verify[n + kl]
    rate = expected / ms
    rate[0, 0] = -np.inf
    best = int(np.argmax(rate))
    if rate.flat[best] <= 1.0 / cost.best_first_ms(0, 0):
        return 0, 0
    return divmod(best, kl_max + 1)
