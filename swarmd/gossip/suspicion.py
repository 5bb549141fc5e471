"""Lifeguard's suspicion timeout and local health (Dadgar et al., "Lifeguard: Local Health
Awareness for More Accurate Failure Detection", 2018, sections IV.A-B).

A suspicion starts with a long timeout that shrinks, logarithmically, as other members
independently confirm it: one confused node cannot kill a healthy peer quickly, and a
truly dead peer is declared dead fast once several agree. Local health ("awareness")
counts recent signs that *this* node is the slow one (missed nacks, having to refute
suspicions of itself); probe intervals and timeouts are stretched by it, so an overloaded
node stops accusing others. Pure functions and small value objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def suspicion_bounds(members: int, probe_interval: float, mult: float, max_mult: float,
                     log_cap: float = math.inf) -> tuple[float, float]:
    """(min, max) timeout: memberlist's ``suspicionTimeout`` scaled by log10 of the swarm size,
    that factor at most ``log_cap`` (``Timing.suspicion_log_cap``)."""
    low = mult * max(1.0, min(log_cap, math.log10(max(1, members)))) * probe_interval
    return low, low * max_mult


def expected_confirmations(members: int, mult: float) -> int:
    """K: how many independent suspicions bring the timeout down to its minimum."""
    k = int(mult) - 2
    return k if members - 2 >= k else 0


def suspicion_timeout(confirmations: int, k: int, low: float, high: float) -> float:
    """Lifeguard eq. (1): max - (max - min) * log(C + 1) / log(K + 1), floored at min."""
    if k < 1:
        return low
    frac = math.log(confirmations + 1) / math.log(k + 1)
    return max(low, high - (high - low) * frac)


@dataclass(slots=True)
class Suspicion:
    """One suspected member: who suspects it, since when, and when it will be declared dead."""

    started: float
    k: int
    low: float
    high: float
    confirmers: set[str] = field(default_factory=set)

    def confirm(self, by: str) -> bool:
        """True when ``by`` is a new, independent confirmation (the first suspector is not one)."""
        if by in self.confirmers:
            return False
        self.confirmers.add(by)
        return True

    @property
    def deadline(self) -> float:
        confirmations = max(0, len(self.confirmers) - 1)
        return self.started + suspicion_timeout(confirmations, self.k, self.low, self.high)


@dataclass(slots=True)
class Awareness:
    """Lifeguard's local health multiplier: 0 is healthy; timeouts scale by (score + 1)."""

    limit: int
    score: int = 0

    def apply(self, delta: int) -> None:
        self.score = min(self.limit - 1, max(0, self.score + delta))

    def scale(self, duration: float) -> float:
        return duration * (self.score + 1)
