"""Choosing the hosts of a job (sans-IO, deterministic for a given view in any order).

1. Filter: in the job's hosts when it names them (always first: restarts too), alive, not
   excluded, every label matches, enough free GPUs, a free job slot,
   enough free cores and memory.
2. Too few fit: `NoFit` saying what was asked, which members fit, and each other member
   with its first reason ("need 3 nodes with ≥1 free GPU; 2 alive members fit: …; 1 other:
   Xq3e9999 (no free GPU, 1 needed)"), at most MAX_LISTED of each. `exclude` may map a
   host to why it refused a reservation, which is then its reason.
3. One node: the least-loaded member that fits, ties by peer id. A service's replica whose
   spec says where its requests enter (``serve.near``, demand points with weights): the
   member with the least demand-weighted RTT to them first, then the least loaded.
4. Several: the set whose worst pairwise RTT is smallest, then the lowest total load, then
   the smallest peer ids. An RTT that is unknown (None, NaN, negative) is worse than any
   known one: sets compare as if it were infinite, worst pair first, so by how many of
   their pairs are unknown, then by their worst known RTT. A set whose pairs are all
   unknown is still a valid choice.
   Exact search while there are at most EXACT_LIMIT sets. Beyond that a greedy: from a
   seed, add the member that keeps the set's worst RTT lowest (ties: the member nearest
   the set, then the least loaded, then the peer id) until the set is full; the best set
   grown from any seed wins. Each seed costs O(nodes × fitting members); every member is a
   seed while the total stays within GREEDY_WORK, else the members whose nodes-1 nearest
   neighbours are nearest. Placement runs on the daemon's event loop: the bound keeps it
   from starving the failure detector's timers.
5. Inside the set, the member with the smallest worst RTT to the others comes first (it
   hosts rank 0 and the rendezvous), then the rest by peer id.
6. Elastic sizes: a job of MIN:MAX nodes takes as many fitting members as there are, up to
   MAX; fewer than MIN is `NoFit`. A restart passes its surviving hosts as `require`: they
   are in every set considered (alive or merely suspect is all that is asked of them: a host
   lost in the same moment can make the failure detector suspect a healthy one; their records
   may still count the slot the job's last attempt used, and their reservation answers truly), and
   the rest is chosen as above, so a replacement is the member nearest the survivors. More
   required hosts than MAX is `NoFit` (a growth's record, a replica's bytes, cannot make a
   job hold more hosts than its spec allows).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ...p2p.signed import short
from ..spec import JobSpec, describe

EXACT_LIMIT = 20_000  # sets scored exactly: about 50 ms at 8 nodes
GREEDY_WORK = 2_000_000  # seeds × nodes × fitting members: about 0.6 s here with 1,000 fitting
MAX_LISTED = 8
UNKNOWN_MS = 1_000.0  # a demand point's RTT nobody measured, for a service replica's placement

Rtt = Callable[[str, str], float | None]
Matrix = list[list[float]]  # milliseconds between fitting members by index; inf: unknown


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    peer: str  # libp2p peer id
    state: str  # alive | suspect | dead | left
    gpus_free: int  # GPUs not given to a job
    gpu_model: str | None
    slots_free: int  # job slots left (a host refuses work beyond them)
    cpu_free: float
    memory_free_mb: int
    labels: Mapping[str, str]
    load: float = 0.0  # running ranks or similar; lower is better


@dataclass(frozen=True, slots=True)
class Placement:
    peers: tuple[str, ...]  # node_rank order: peers[0] hosts rank 0 (MASTER_ADDR)
    worst_rtt_ms: float | None  # largest pairwise RTT in the set; None: some pair unknown


@dataclass(frozen=True, slots=True)
class NoFit:
    reason: str


def place(spec: JobSpec, candidates: Sequence[Candidate], rtt_ms: Rtt, *,
          exclude: Collection[str] = (), require: Collection[str] = ()) -> Placement | NoFit:
    if len(set(require)) > spec.nodes:
        return NoFit(f"need {describe(spec)}; {len(set(require))} hosts were required, over its maximum")
    ordered = sorted(candidates, key=lambda c: c.peer)
    verdicts = [(c, _why_not(spec, c, exclude, required=c.peer in require)) for c in ordered]
    fit = [c for c, why in verdicts if why is None]
    missing = set(require) - {c.peer for c in fit}
    n = min(spec.nodes, len(fit))
    if n < spec.least_nodes or missing:
        others = [(c, why) for c, why in verdicts if why is not None]
        others += [(Candidate(peer=p, state="unknown", gpus_free=0, gpu_model=None, slots_free=0, cpu_free=0.0,
                              memory_free_mb=0, labels={}), "not a member now") for p in sorted(missing)
                   if p not in {c.peer for c in ordered}]
        return NoFit(_explain(spec, fit, others))
    if n == 1 and spec.serve is not None and spec.serve.near:
        return Placement((min(fit, key=lambda c: (demand_rtt(c.peer, spec.serve.near, rtt_ms), c.load,
                                                  c.peer)).peer,), 0.0)
    if n == 1:
        return Placement((min(fit, key=lambda c: (c.load, c.peer)).peer,), 0.0)
    d = _matrix([c.peer for c in fit], rtt_ms)
    load = [c.load for c in fit]
    kept = tuple(i for i, c in enumerate(fit) if c.peer in require)
    free = [i for i in range(len(fit)) if i not in kept]
    groups: Iterable[tuple[int, ...]]
    if math.comb(len(free), n - len(kept)) <= EXACT_LIMIT:
        groups = (tuple(sorted(kept + g)) for g in itertools.combinations(free, n - len(kept)))
    elif kept:
        groups = (_grow(kept, n, d, load),)
    else:
        groups = (_grow((seed,), n, d, load) for seed in _seeds(n, d))
    chosen = min(groups, key=lambda g: (_pairs(g, d), math.fsum(load[i] for i in g), g))
    first = min(chosen, key=lambda i: (_rank([d[i][j] for j in chosen if j != i]), i))
    order = (first, *(i for i in chosen if i != first))
    unknown, worst = _pairs(chosen, d)
    return Placement(tuple(fit[i].peer for i in order), None if unknown else worst)


def demand_rtt(peer: str, near: Sequence[tuple[str, float]], rtt_ms: Rtt) -> float:
    """The RTT from ``peer`` to where a service's requests enter, weighed by each entry point's
    requests (a sum: divide by the weights for a mean); a pair nobody measured counts as
    ``UNKNOWN_MS``."""
    total = 0.0
    for point, weight in near:
        value = 0.0 if point == peer else rtt_ms(peer, point)
        if value is None:
            value = rtt_ms(point, peer)
        total += weight * (value if value is not None and 0 <= value < math.inf else UNKNOWN_MS)
    return total


def _why_not(spec: JobSpec, c: Candidate, exclude: Collection[str], required: bool = False) -> str | None:
    if spec.hosts and c.peer not in spec.hosts:
        return "not in the job's hosts"  # the user's allow list binds restarts too, survivors included
    if required and c.state in ("alive", "suspect"):
        return None  # a survivor that just reported its ranks' exit; a suspicion is not a death
    if c.state != "alive":
        return c.state
    if c.peer in exclude:
        why = exclude[c.peer] if isinstance(exclude, Mapping) else None
        return f"refused: {why.removeprefix(short(c.peer) + ': ')}" if why else "refused the last reservation"
    for key, value in sorted(spec.labels.items()):
        have = c.labels.get(key)
        if have != value:
            return f"no label {key}" if have is None else f"label {key}={have} not {value}"
    if c.gpus_free < spec.gpus_per_node:
        free = "no free GPU" if c.gpus_free <= 0 else f"{c.gpus_free} free GPU{'s' if c.gpus_free != 1 else ''}"
        return f"{free}, {spec.gpus_per_node} needed"
    if c.slots_free < 1:
        return "no free job slot"
    if c.cpu_free < spec.cpus:
        return f"{c.cpu_free:g} free cores < {spec.cpus:g}"
    if c.memory_free_mb < spec.mem_mb:
        return f"{c.memory_free_mb} MB free < {spec.mem_mb}"
    return None


def _matrix(peers: Sequence[str], rtt_ms: Rtt) -> Matrix:
    d = [[0.0] * len(peers) for _ in peers]
    for i, j in itertools.combinations(range(len(peers)), 2):
        value = rtt_ms(peers[i], peers[j])
        if value is None:
            value = rtt_ms(peers[j], peers[i])
        d[i][j] = d[j][i] = value if value is not None and 0 <= value < math.inf else math.inf
    return d


def _rank(rtts: list[float]) -> tuple[int, float]:
    """How a set of RTTs compares: unknown ones (inf) first, then the worst known one."""
    known = [x for x in rtts if x != math.inf]
    return len(rtts) - len(known), max(known, default=0.0)


def _pairs(group: Sequence[int], d: Matrix) -> tuple[int, float]:
    return _rank([d[a][b] for a, b in itertools.combinations(group, 2)])


def _seeds(n: int, d: Matrix) -> Sequence[int]:
    count = max(1, GREEDY_WORK // (n * len(d)))
    if count >= len(d):
        return range(len(d))
    radius = [sorted(row)[n - 1] for row in d]  # row[i] is 0.0: the n-1 nearest others
    return sorted(range(len(d)), key=lambda i: (radius[i], i))[:count]


def _grow(seeds: tuple[int, ...], n: int, d: Matrix, load: Sequence[float]) -> tuple[int, ...]:
    unknown = [0] * len(d)  # per member: its pairs with the set whose RTT is unknown
    far = [0.0] * len(d)  # per member: its worst known RTT to the set
    group, rest = list(seeds), set(range(len(d))) - set(seeds)
    worst = _pairs(seeds, d)[1] if len(seeds) > 1 else 0.0
    for member in group[:-1]:
        for j, rtt in enumerate(d[member]):
            if rtt == math.inf:
                unknown[j] += 1
            elif rtt > far[j]:
                far[j] = rtt
    while True:
        for j, rtt in enumerate(d[group[-1]]):
            if rtt == math.inf:
                unknown[j] += 1
            elif rtt > far[j]:
                far[j] = rtt
        if len(group) == n:
            return tuple(sorted(group))
        nxt = min(rest, key=lambda j: (unknown[j], max(worst, far[j]), far[j], load[j], j))
        worst = max(worst, far[nxt])
        group.append(nxt)
        rest.remove(nxt)


def _listed(items: Sequence[str], sep: str) -> str:
    more = f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return sep.join(items[:MAX_LISTED]) + more


def _explain(spec: JobSpec, fit: Sequence[Candidate], others: Sequence[tuple[Candidate, str]]) -> str:
    text = f"need {describe(spec)}; "
    if fit:
        verb = "members fit" if len(fit) != 1 else "member fits"
        text += f"{len(fit)} alive {verb}: " + _listed([short(c.peer) for c in fit], ", ")
    else:
        text += "no member fits"
    if others:
        closest = sorted(others, key=lambda o: (o[0].state != "alive", o[0].peer))
        text += f"; {len(others)} other{'s' if len(others) != 1 else ''}: "
        text += _listed([f"{short(c.peer)} ({why})" for c, why in closest], "; ")
    return text
