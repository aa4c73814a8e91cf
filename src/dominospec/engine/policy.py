"""Auto-K: how many drafts to verify this round, from measured acceptance and measured round cost.

A round that verifies K drafts emits E(K) = 1 + a_1 + ... + a_K tokens on average, where a_k is
the probability that at least k drafts are accepted, and costs C(K) ms (`RoundCost`, measured on
this machine). K = 0 is a plain target step: no draft forward, 1 token, C(0) = one AR step. The
policy picks K = argmax_K E(K) / C(K) over 0..K_max, so it verifies fewer drafts (or none) when
the recent rounds accepted little, and it stops paying for the draft forward at all when even
K = 1 would not beat a plain step: prompt lookup's fallback, for a draft.

Acceptance is estimated by position from decayed counts over the generation's recent rounds
(the engine starts every generation from the prior, so that K, and with it a seeded sampled
answer, does not depend on earlier requests; a window of W
rounds: every round multiplies the counts by 1 - 1/W, so plain steps let old evidence fade):
rho_k = P(d_k accepted | d_1..d_{k-1} accepted) = (hit_k + w * prior_k) / (tried_k + w), with
prior_1 = PRIOR and prior_k = rho_{k-1} (an unseen position is assumed as good as the one before
it), and a_k = rho_1 * ... * rho_k. A run of failures drives K to 0; as the counts fade, the
prior comes back and a probe round is tried again.

A branching round (engine.proposers) verifies a tree: the draft's W best first tokens, each drafted on
to K_d tokens (engine.draft_head), and beside them a prompt lookup of K_l tokens. The W draft branches
start with distinct tokens, so at most one of them gets past its first token: the draft tree accepts
>= k with probability t_k = a_k * (1 + (r_2 + ... + r_W) / a_1), where r_w = P(the target's token is
the draft's w-th guess) (`RankModel`, decayed counts like the chain's) and a branch that got its
first token right is assumed to go on as the chain does (a_k / a_1). The lookup is estimated as if
independent of the draft: E = 1 + sum_k 1 - (1 - t_k)(1 - a_k^l). `choose_tree` picks (W, K_d, K_l)
over the whole grid, so it drafts beside a lookup, or widens the tree, only when the expected gain
pays for the draft forward and the wider verify, and falls back to a chain, to either branch alone,
or to a plain step otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PRIOR, PRIOR_WEIGHT = 0.5, 1.0  # exploration: an unknown position is a coin flip worth one round


@dataclass(frozen=True)
class RoundCost:
    """Measured milliseconds of the phases of a round on this machine (see engine.cost)."""

    verify: list[float]  # verify[r-1]: target forward over r rows (features included), r = 1..K_max+1
    draft: float  # draft forward over the block + base logits (0 in `ngram`)
    rollout_step: float  # one chain step (0 in `ngram`)
    branch_step: float = 0.0  # one step of the draft's widest tree (engine.draft_head; 0 without one)
    tree_build: float = 0.0  # growing DominoTree's whole budget of nodes (engine.domino_tree; 0 without one)

    def round_ms(self, k: int) -> float:
        """Cost of a round verifying k drafts (k = 0: a plain target step, no draft forward)."""
        if k == 0:
            return self.verify[0]
        return self.draft + k * self.rollout_step + self.verify[k]

    def lookup_ms(self, k: int) -> float:
        """Cost of a round verifying k prompt-lookup tokens: the verify alone (no draft forward, no chain)."""
        return self.verify[k]

    def tree_ms(self, width: int, kd: int, kl: int) -> float:
        """Cost of a branching round (engine.proposers): `width` draft branches of kd drafts and a lookup of kl
        tokens in one verify (width 1, kl 0: a chain round)."""
        step = self.rollout_step if width == 1 else self.branch_step
        drafting = self.draft + kd * step if kd else 0.0
        return drafting + self.verify[width * kd + kl]

    def best_first_ms(self, nodes: int, kl: int) -> float:
        """Cost of a DominoTree round verifying its best `nodes` nodes and a lookup of kl tokens (nodes 0:
        no draft forward, a lookup round or, with kl 0 too, a plain step)."""
        drafting = self.draft + self.tree_build if nodes else 0.0
        return drafting + self.verify[nodes + kl]

    def as_dict(self) -> dict:
        return asdict(self)


class AcceptanceModel:
    """Decayed per-position acceptance counts of the recent rounds (module docstring)."""

    def __init__(self, k_max: int, window: int):
        self.k_max, self.keep = k_max, 1.0 - 1.0 / max(window, 1)
        self.tried = [0.0] * k_max  # tried[k-1]: rounds that verified d_k with d_1..d_{k-1} accepted
        self.hit = [0.0] * k_max  # hit[k-1]: of those, rounds that accepted d_k

    def update(self, proposed: int, accepted: int) -> None:
        """One round that verified `proposed` drafts and accepted the first `accepted` (0 and 0: a plain step)."""
        for k in range(self.k_max):
            self.tried[k] *= self.keep
            self.hit[k] *= self.keep
        for k in range(min(proposed, accepted + 1)):  # d_1..d_{n+1} were tried, d_1..d_n hit
            self.tried[k] += 1.0
            self.hit[k] += k < accepted

    def survival(self) -> list[float]:
        """-> a_k = P(at least k drafts accepted), k = 1..k_max."""
        out, rho, a = [], PRIOR, 1.0
        for tried, hit in zip(self.tried, self.hit):
            rho = (hit + PRIOR_WEIGHT * rho) / (tried + PRIOR_WEIGHT)
            a *= rho
            out.append(a)
        return out


class RankModel:
    """Decayed counts of how often the target's token was the draft's w-th guess, w = 2..W (the
    first guess is the chain's a_1): each round that verified w_round branches tried ranks 2..w_round."""

    def __init__(self, width: int, window: int):
        self.keep = 1.0 - 1.0 / max(window, 1)
        self.tried = [0.0] * max(width - 1, 0)  # tried[w-2]: rounds that verified the w-th guess
        self.hit = [0.0] * max(width - 1, 0)  # hit[w-2]: of those, rounds it was the target's token

    def update(self, width: int, winner_rank: int) -> None:
        """One round that verified `width` first guesses, of which guess `winner_rank` (1-based; 0: none,
        or a round without a draft) was accepted."""
        for w in range(len(self.tried)):
            self.tried[w] *= self.keep
            self.hit[w] *= self.keep
        for w in range(min(width - 1, len(self.tried))):
            self.tried[w] += 1.0
            self.hit[w] += winner_rank == w + 2

    def shares(self, first: float) -> list[float]:
        """P(the chain's first draft accepted) a_1 -> [r_2 .. r_W], each unseen rank assumed half the one before."""
        out, prior = [], first
        for tried, hit in zip(self.tried, self.hit):
            prior = (hit + PRIOR_WEIGHT * prior / 2) / (tried + PRIOR_WEIGHT)
            out.append(prior)
        return out


def expected_rates(cost: RoundCost, survival: list[float], k_max: int, lookup: bool = False) -> list[float]:
    """-> tokens per ms for K = 0..k_max: E(K) / C(K); C of a draft round, or of a lookup round (`lookup`)."""
    round_ms = cost.lookup_ms if lookup else cost.round_ms
    rates, expected = [1.0 / round_ms(0)], 1.0
    for k in range(1, k_max + 1):
        expected += survival[k - 1]
        rates.append(expected / round_ms(k))
    return rates


def choose_k(cost: RoundCost, survival: list[float], k_max: int, lookup: bool = False) -> int:
    """-> the K in 0..k_max with the most expected tokens per ms (of a lookup round when `lookup`)."""
    rates = expected_rates(cost, survival, k_max, lookup)
    return max(range(len(rates)), key=rates.__getitem__)


def choose_tree(cost: RoundCost, chain: list[float], lookup: list[float], kd_max: int, kl_max: int,
                ranks: list[float] = (), width_max: int = 1) -> tuple[int, int, int]:
    """Survivals a_k of the draft's chain and of the lookup, rank shares [r_2 .. r_W] -> the (W, K_d, K_l),
    W <= width_max, K_d <= kd_max, K_l <= kl_max, with the most expected tokens per ms (module docstring);
    (1, 0, 0) is a plain step."""
    best, best_rate = (1, 0, 0), 1.0 / cost.round_ms(0)
    for width in range(1, min(width_max, len(ranks) + 1) + 1):
        widen = 1.0 + sum(ranks[:width - 1]) / chain[0] if chain and chain[0] > 0 else 1.0
        for kd in range(kd_max + 1) if width == 1 else range(1, kd_max + 1):
            tree = [min(1.0, chain[k] * widen) if k < kd else 0.0 for k in range(max(kd, kl_max))]
            expected = 1.0 + sum(tree)  # 1 - (1 - t)(1 - l) = t + (1 - t) l: each lookup token adds (1 - t_k) l_k
            for kl in range(kl_max + 1):
                if kl:
                    expected += (1.0 - tree[kl - 1]) * lookup[kl - 1]
                if kd == kl == 0:
                    continue
                rate = expected / cost.tree_ms(width, kd, kl)
                if rate > best_rate:
                    best, best_rate = (width, kd, kl), rate
    return best
