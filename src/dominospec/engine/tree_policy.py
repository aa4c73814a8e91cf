"""Auto-budget for DominoTree: how many of the tree's best nodes a round verifies.

A round grows the tree's whole budget of N nodes (engine.domino_tree; its cost is one build,
whatever is verified) and verifies its best n of them, n = 0..N (0: no draft forward at all).
The best n nodes are a tree of their own, so one verified round tells what every smaller budget
would have accepted: the accepted path's nodes are ranks r_1 < r_2 < ... (their places in the
best-first order, parents first), and the best n nodes accept the path's first k nodes iff
r_k < n.

`TreeModel` keeps decayed counts (a window of W rounds, as auto-K's chain model) of
h[r][k] = rounds in which the node of rank r was the accepted path's node at depth k, over the
rounds whose verified tree held rank r. The survival of the tree of budget n at depth k is then
s_k(n) = P(the best n nodes accept >= k drafts) = sum_{r < n} h[r][k] / tried[r] (one path node a
depth). An unseen (or long unverified) rank is assumed as good as the rank before it (rank 0: a
first draft accepted half the time): the prior is optimistic, so budgets that have not been
tried lately get tried again; the counts then correct it. (The draft's own path probabilities
are no such estimate: they over-credit the conditional draft, and an adaptive budget built on
them saturates at its maximum.)

`choose_nodes` picks (n, K_l) with the most expected tokens per ms over the grid, a lookup of
K_l tokens verified beside the tree as if independent of it (engine.policy's rule):
E = 1 + sum_k s_k(n) + sum_{k <= K_l} (1 - s_k(n)) l_k, against `RoundCost.best_first_ms`.
"""

from __future__ import annotations

from dominospec.engine.policy import PRIOR, PRIOR_WEIGHT, RoundCost


class TreeModel:
    """Decayed counts of which rank's node the accepted path passed through at each depth (module docstring)."""

    def __init__(self, nodes: int, depth: int, window: int):
        self.nodes, self.depth, self.keep = nodes, depth, 1.0 - 1.0 / max(window, 1)
        self.tried = [0.0] * nodes  # tried[r]: rounds whose verified tree held the node of rank r
        self.hit = [[0.0] * depth for _ in range(nodes)]  # hit[r][k-1]: of those, rank r was the path's depth-k node

    @property
    def unseen(self) -> bool:
        """No round has verified a node yet (a fresh generation's model)."""
        return not any(self.tried)

    def update(self, verified: int, path: list[tuple[int, int]]) -> None:
        """One round that verified the best `verified` nodes and accepted the path [(rank, depth), ...]
        (empty: nothing accepted, or a round without the tree when `verified` is 0)."""
        for r in range(self.nodes):
            self.tried[r] *= self.keep
            self.hit[r] = [h * self.keep for h in self.hit[r]]
        for r in range(min(verified, self.nodes)):
            self.tried[r] += 1.0
        for rank, depth in path:
            if rank < min(verified, self.nodes) and 1 <= depth <= self.depth:
                self.hit[rank][depth - 1] += 1.0

    def rank_shares(self) -> list[list[float]]:
        """-> [N][depth]: the estimated share of rounds in which rank r was the path's depth-k node."""
        out, prior = [], [PRIOR] + [0.0] * (self.depth - 1)
        for tried, hit in zip(self.tried, self.hit):
            prior = [(h + PRIOR_WEIGHT * p) / (tried + PRIOR_WEIGHT) for h, p in zip(hit, prior)]
            out.append(prior)
        return out

    def survival(self) -> list[list[float]]:
        """-> s[n][k-1] = P(the best n nodes accept >= k drafts), n = 0..N, k = 1..depth: non-increasing
        in k, non-decreasing in n, at most 1."""
        rows, acc = [[0.0] * self.depth], [0.0] * self.depth
        for shares in self.rank_shares():
            acc = [a + s for a, s in zip(acc, shares)]
            row, cap = [], 1.0
            for a in acc:
                cap = min(cap, a)
                row.append(cap)
            rows.append(row)
        return rows


def choose_nodes(cost: RoundCost, survival: list[list[float]], lookup: list[float], nodes_max: int,
                 kl_max: int) -> tuple[int, int]:
    """Tree survivals s[n] (TreeModel.survival), the lookup's survival l_k -> the (n, K_l), n <= nodes_max,
    K_l <= kl_max, with the most expected tokens per ms; (0, 0) is a plain step."""
    best, best_rate = (0, 0), 1.0 / cost.best_first_ms(0, 0)
    for n in range(min(nodes_max, len(survival) - 1) + 1):
        tree = survival[n] + [0.0] * max(0, kl_max - len(survival[n]))
        expected = 1.0 + sum(tree)
        for kl in range(kl_max + 1):
            if kl:
                expected += (1.0 - tree[kl - 1]) * lookup[kl - 1]
            if n == kl == 0:
                continue
            rate = expected / cost.best_first_ms(n, kl)
            if rate > best_rate:
                best, best_rate = (n, kl), rate
    return best
