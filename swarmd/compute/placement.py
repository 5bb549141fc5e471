"""Choosing the hosts of a job (sans-IO, deterministic for a given view).

1. Filter: alive, not excluded, every label matches, enough free GPUs, a free job slot,
   enough free cores and memory.
2. Too few fit: `NoFit` saying what was asked, which members fit, and for each other member
   its first reason ("need 3 nodes; 2 alive members fit: …; others: … (no free job slot)");
   `exclude` may map a host to why it refused a reservation, which is then its reason.
3. Among those that fit, the set whose largest pairwise RTT is smallest, then the lowest
   total load, then the smallest peer ids. An unknown RTT counts as worse than any known.
   Exact search while the number of sets is at most EXACT_LIMIT; beyond it a greedy: from
   each member, grow the set by the member that keeps its worst RTT lowest; keep the best.
4. Inside the set, the member with the lowest worst RTT to the others comes first: it
   hosts rank 0 and the rendezvous.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from .spec import JobSpec, describe

EXACT_LIMIT = 20_000
UNKNOWN_RTT = 1e9  # ms: worse than any measured path, still comparable
MAX_LISTED = 8

Rtt = Callable[[str, str], float | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    peer: str
    state: str
    gpus_free: int
    gpu_model: str | None
    slots_free: int
    cpu_free: float
    memory_free_mb: int
    labels: Mapping[str, str] = field(default_factory=dict)
    load: float = 0.0


@dataclass(frozen=True, slots=True)
class Placement:
    peers: tuple[str, ...]
    worst_rtt_ms: float | None


@dataclass(frozen=True, slots=True)
class NoFit:
    reason: str


def short(peer: str) -> str:
    return f"{peer[:6]}…{peer[-4:]}" if len(peer) > 12 else peer


def why_not(spec: JobSpec, c: Candidate, exclude: Collection[str]) -> str | None:
    if c.state != "alive":
        return c.state
    if c.peer in exclude:
        why = exclude[c.peer] if isinstance(exclude, Mapping) else None
        return f"refused: {why.removeprefix(short(c.peer) + ': ')}" if why else "refused the last reservation"
    for key, value in sorted(spec.labels.items()):
        if c.labels.get(key) != value:
            have = c.labels.get(key)
            return f"label {key}={have} not {value}" if have is not None else f"no label {key}"
    if c.gpus_free < spec.gpus_per_node:
        return f"{c.gpus_free} free GPU{'s' if c.gpus_free != 1 else ''} of {spec.gpus_per_node} needed"
    if c.slots_free < 1:
        return "no free job slot"
    if c.cpu_free < spec.cpus:
        return f"{c.cpu_free:g} free cores < {spec.cpus:g}"
    if c.memory_free_mb < spec.mem_mb:
        return f"{c.memory_free_mb} MB free < {spec.mem_mb}"
    return None


def place(spec: JobSpec, candidates: Sequence[Candidate], rtt_ms: Rtt, *,
          exclude: Collection[str] = ()) -> Placement | NoFit:
    ordered = sorted(candidates, key=lambda c: c.peer)
    fit = [c for c in ordered if why_not(spec, c, exclude) is None]
    if len(fit) < spec.nodes:
        return NoFit(_explain(spec, ordered, fit, exclude))
    load = {c.peer: c.load for c in fit}
    if spec.nodes == 1:
        best = min(fit, key=lambda c: (c.load, c.peer))
        return Placement((best.peer,), 0.0)

    def rtt(a: str, b: str) -> float:
        value = rtt_ms(a, b)
        if value is None:
            value = rtt_ms(b, a)
        return UNKNOWN_RTT if value is None or not math.isfinite(value) else value

    def worst(group: Sequence[str]) -> float:
        return max((rtt(a, b) for a, b in itertools.combinations(group, 2)), default=0.0)

    def score(group: Sequence[str]) -> tuple[float, float, tuple[str, ...]]:
        return worst(group), sum(load[p] for p in group), tuple(sorted(group))

    peers = [c.peer for c in fit]
    if math.comb(len(peers), spec.nodes) <= EXACT_LIMIT:
        chosen = min(itertools.combinations(peers, spec.nodes), key=score)
    else:
        chosen = min((_grow(seed, peers, spec.nodes, rtt, load) for seed in peers), key=score)
    first = min(chosen, key=lambda p: (max(rtt(p, q) for q in chosen if q != p), p))
    order = (first, *sorted(p for p in chosen if p != first))
    w = worst(order)
    return Placement(order, None if w >= UNKNOWN_RTT else w)


def _grow(seed: str, peers: Sequence[str], n: int, rtt: Callable[[str, str], float],
          load: Mapping[str, float]) -> tuple[str, ...]:
    group = [seed]
    rest = [p for p in peers if p != seed]
    while len(group) < n:
        nxt = min(rest, key=lambda p: (max(rtt(p, q) for q in group), load[p], p))
        group.append(nxt)
        rest.remove(nxt)
    return tuple(group)


def _explain(spec: JobSpec, ordered: Sequence[Candidate], fit: Sequence[Candidate], exclude: Collection[str]) -> str:
    others = [(c, why_not(spec, c, exclude)) for c in ordered if c not in fit]
    text = f"need {describe(spec)}; "
    if fit:
        names = ", ".join(short(c.peer) for c in fit[:MAX_LISTED])
        text += f"{len(fit)} alive member{'s fit' if len(fit) != 1 else ' fits'}: {names}"
    else:
        text += "no member fits"
    if others:
        listed = "; ".join(f"{short(c.peer)} ({why})" for c, why in others[:MAX_LISTED])
        more = f" and {len(others) - MAX_LISTED} more" if len(others) > MAX_LISTED else ""
        text += f"; {len(others)} other{'s' if len(others) != 1 else ''}: {listed}{more}"
    return text
