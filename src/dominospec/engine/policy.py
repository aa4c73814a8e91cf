"""Auto-K: how many drafts to verify this round, from the measured acceptance and round cost.

A round verifying K drafts emits E(K) = 1 + a_1 + ... + a_K tokens on average (a_k = P(at least k drafts
accepted)) and costs C(K) ms (`RoundCost`; K = 0 is a plain step): the policy picks argmax_K E(K) / C(K)
over 0..K_max. Acceptance by position from counts decayed over a window of W rounds (x (1 - 1/W) a round),
fresh every generation: rho_k = (hit_k + w * prior_k) / (tried_k + w), prior_1 = PRIOR, prior_k =
rho_{k-1}, a_k = rho_1 ... rho_k; as failures fade, the prior returns and a probe round is tried again.
A forking round (greedy) verifies a chain of K_d and a lookup of K_l beside it, taken as independent:
E = 1 + sum_k 1 - (1 - a_k)(1 - l_k) (`choose_fork`). DominoTree's budget is engine.tree_policy's.
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
    tree_build: float = 0.0  # growing DominoTree's whole budget of nodes (engine.domino_tree; 0 without one)

    def round_ms(self, k: int) -> float:
        """Cost of a round verifying k drafts (k = 0: a plain target step, no draft forward)."""
        return self.fork_ms(k, 0)

    def lookup_ms(self, k: int) -> float:
        """Cost of a round verifying k prompt-lookup tokens: the verify alone (no draft forward, no chain)."""
        return self.fork_ms(0, k)

    def fork_ms(self, kd: int, kl: int) -> float:
        """Cost of a forking round (engine.proposers): a chain of kd drafts and a lookup of kl tokens in one
        verify (kl 0: a chain round; kd 0: a lookup round, no draft forward)."""
        drafting = self.draft + kd * self.rollout_step if kd else 0.0
        return drafting + self.verify[kd + kl]

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


def choose_fork(cost: RoundCost, chain: list[float], lookup: list[float], kd_max: int,
                kl_max: int) -> tuple[int, int]:
    """Survivals a_k of the draft's chain and l_k of the lookup -> the (K_d, K_l), K_d <= kd_max, K_l <= kl_max,
    with the most expected tokens per ms (module docstring); (0, 0) is a plain step."""
    best, best_rate = (0, 0), 1.0 / cost.round_ms(0)
    for kd in range(kd_max + 1):
        drafts = [chain[k] if k < kd else 0.0 for k in range(max(kd, kl_max))]
        expected = 1.0 + sum(drafts)  # 1 - (1 - a)(1 - l) = a + (1 - a) l: each lookup token adds (1 - a_k) l_k
        for kl in range(kl_max + 1):
            if kl:
                expected += (1.0 - drafts[kl - 1]) * lookup[kl - 1]
            if kd == kl == 0:
                continue
            rate = expected / cost.fork_ms(kd, kl)
            if rate > best_rate:
                best, best_rate = (kd, kl), rate
    return best
