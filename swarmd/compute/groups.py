"""A job's hosts in groups by latency (sans-IO): sync every step inside a group, rarely across.

A job placed on hosts continents apart trains fastest when its ranks all-reduce every step
only over cheap links and average across the slow ones every H steps (hierarchical local
SGD, as torch's ``HierarchicalModelAverager``; DiLoCo's outer step). ``form`` takes the
placed nodes and the swarm's RTTs between them and returns the groups:

- complete linkage: two groups merge only when *every* link between them is at most
  ``max_rtt_ms``, so no group ever spans a slower link (single linkage would chain 5 ms hops
  across an ocean); the closest pair of groups (their slowest link) merges first;
- an RTT nobody measured counts as slower than any threshold: a host is grouped only with
  hosts it is known to be near (a group of one syncs across groups, which is always correct);
- a pair measured both ways counts as the slower of the two readings (a member's report of
  its own RTTs is its claim: the slower reading cannot make a group span a slow link);
- deterministic: ties go to the groups holding the lowest node rank, and groups come out
  ordered by their lowest node rank, each sorted, so every rank computes the same answer.

At most ``MAX_NODES`` nodes: the cost is cubic in them (60 ms at 128 here), and a job is placed
on far fewer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

MAX_RTT_MS = 30.0  # default: a group spans no link slower than this (a region; 150 ms is an ocean)
MAX_NODES = 128


def form(nodes: Sequence[str], rtt_ms: Callable[[str, str], float | None],
         max_rtt_ms: float = MAX_RTT_MS) -> tuple[tuple[int, ...], ...]:
    """The groups of node ranks (indices into ``nodes``) by ``rtt_ms(a, b)`` (ms, or None when
    unknown), none spanning a link slower than ``max_rtt_ms``."""
    if not (isinstance(max_rtt_ms, (int, float)) and math.isfinite(max_rtt_ms) and max_rtt_ms >= 0):
        raise ValueError(f"max_rtt_ms must be a finite number >= 0, not {max_rtt_ms!r}")
    if len(nodes) > MAX_NODES:
        raise ValueError(f"at most {MAX_NODES} nodes are grouped, not {len(nodes)}")
    if len(set(nodes)) != len(nodes):
        raise ValueError("a node appears twice")
    n = len(nodes)
    members = {i: [i] for i in range(n)}  # group id (its lowest node rank) -> node ranks
    # the slowest link between two groups; merging a and b makes a's row the max of both
    # rows (complete linkage's Lance-Williams update), so each round costs one pass
    slowest = {i: {j: _pair(rtt_ms(nodes[i], nodes[j]), rtt_ms(nodes[j], nodes[i])) for j in range(n) if j != i}
               for i in range(n)}
    while True:
        best: tuple[float, int, int] | None = None
        for a in sorted(members):
            for b, d in slowest[a].items():
                if a < b and d <= max_rtt_ms and (best is None or (d, a, b) < best):
                    best = (d, a, b)
        if best is None:
            break
        _, a, b = best
        members[a] = sorted(members[a] + members.pop(b))
        del slowest[b]
        for c, row in slowest.items():
            if c != a:
                row[a] = slowest[a][c] = max(row[a], row.pop(b))
        slowest[a].pop(b, None)
    return tuple(tuple(members[g]) for g in sorted(members))


def check(value: object, n: int) -> tuple[tuple[int, ...], ...]:
    """Groups of ``n`` node ranks as ``form`` gives them, from a member's bytes (a successor takes a job
    over with the groups its ranks run with): each rank once, each group sorted, groups in order of
    their lowest rank. ValueError naming what is wrong."""
    if not (isinstance(value, list) and 0 < len(value) <= n <= MAX_NODES
            and all(isinstance(g, list) and g and all(type(i) is int for i in g) for g in value)):
        raise ValueError(f"groups must be lists of node ranks (at most {MAX_NODES} nodes)")
    if sorted(i for g in value for i in g) != list(range(n)):
        raise ValueError(f"groups must hold each node rank 0..{n - 1} once")
    if any(g != sorted(g) for g in value) or [g[0] for g in value] != sorted(g[0] for g in value):
        raise ValueError("groups must be sorted, and in order of their lowest node rank")
    return tuple(tuple(g) for g in value)


def known(r: object) -> bool:
    """An RTT reading ``form`` takes: a finite number of ms, at least 0."""
    return isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r >= 0


def _pair(there: float | None, back: float | None) -> float:
    readings = [r for r in (there, back) if known(r)]
    if not readings:
        return math.inf
    return max(readings)

