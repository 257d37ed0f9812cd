"""Choosing the draft length: fixed, or `auto` from the expected-speedup model.

With per-token acceptance rate a, a draft of g tokens yields on average
E(a, g) = (1 - a^(g+1)) / (1 - a) tokens per round (Leviathan et al. 2023, eq. 1). A round
costs g draft steps, one verification of g + 1 tokens, and one network round trip:
T(g) = g * t_draft + t_verify(g + 1) + t_rtt. `auto` picks the g in 1..max_gamma with the most
tokens per second E / T, from running estimates of a, t_draft, t_verify (linear in the tokens
verified) and t_rtt, so it adapts when the link or the acceptance rate changes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per round: accepted drafts plus the target's own token."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class CostModel:
    alpha: float
    draft_s: float
    """One draft step."""
    verify_base_s: float
    verify_per_token_s: float
    rtt_s: float

    def round_seconds(self, gamma: int) -> float:
        return (
            gamma * self.draft_s
            + self.verify_base_s
            + self.verify_per_token_s * (gamma + 1)
            + self.rtt_s
        )

    def tokens_per_second(self, gamma: int) -> float:
        return expected_tokens(self.alpha, gamma) / self.round_seconds(gamma)

    def best_gamma(self, max_gamma: int) -> int:
        return max(range(1, max_gamma + 1), key=self.tokens_per_second)


class GammaController:
    """Running estimates of the cost model, and the draft length to use next."""

    def __init__(self, *, fixed: int | None, max_gamma: int, window: int = 32) -> None:
        self.fixed = fixed
        self.max_gamma = max_gamma
        self._accepted: deque[int] = deque(maxlen=window)  # per round: tokens accepted
        self._trials: deque[int] = deque(maxlen=window)  # per round: acceptance tests made
        self._draft: deque[float] = deque(maxlen=window)  # seconds per draft step
        self._verify: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)
        self._rtt: deque[float] = deque(maxlen=window)

    def next_gamma(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if not self._verify:
            return min(4, self.max_gamma)
        return self.model().best_gamma(self.max_gamma)

    def update(
        self, *, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float
    ) -> None:
        self._accepted.append(accepted)
        self._trials.append(accepted + (1 if accepted < drafted else 0))
        if drafted:
            self._draft.append(draft_s / drafted)
        self._verify.append((drafted + 1, verify_s))
        self._rtt.append(max(0.0, round_s - draft_s - verify_s))

    def model(self) -> CostModel:
        trials = sum(self._trials)
        alpha = sum(self._accepted) / trials if trials else 0.5
        draft_s = float(np.median(self._draft)) if self._draft else 0.0
        tokens = np.array([n for n, _ in self._verify], dtype=float)
        seconds = np.array([s for _, s in self._verify], dtype=float)
        if len(set(tokens.tolist())) > 1:
            slope, base = np.polyfit(tokens, seconds, 1)
            slope, base = max(float(slope), 0.0), max(float(base), 0.0)
        else:
            slope, base = 0.0, float(seconds.mean()) if len(seconds) else 0.0
        rtt = float(np.median(self._rtt)) if self._rtt else 0.0
        return CostModel(
            alpha=min(alpha, 0.999),
            draft_s=draft_s,
            verify_base_s=base,
            verify_per_token_s=slope,
            rtt_s=rtt,
        )
