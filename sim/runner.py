"""Plays a scenario on a simulated swarm and collects its metrics.

Theory of operation: the scenario's nodes are placed (seeded), a :class:`~sim.swarm.Swarm`
is built over the latency they imply, every event of the timeline is scheduled on the
swarm's clock, and the swarm runs to the scenario's end; a callback once a simulated
second samples traffic (and moves the caller's progress bar). The swarm's observations
(Changed actions, record deliveries) go straight into :class:`~sim.metrics.Metrics`.

Randomness: one ``random.Random`` per concern, each seeded from the scenario's seed and
the concern's name (a str seed is hashed with SHA-512, not Python's hash(): the same in
every process). Who crashes, leaves, changes or is congested: ``picks``; where nodes are:
``place``; the swarm takes the seed for its own concerns.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from swarmd.gossip.membership import Timing
from swarmd.gossip.suspicion import suspicion_bounds

from . import scenario as sc
from .metrics import Metrics

Progress = Callable[[float], None]


@dataclass(slots=True)
class Outcome:
    scenario: sc.Scenario
    figures: dict  # metrics' figures (membership) or the dissemination's (disseminate)
    metrics: Metrics | None  # membership mode: for the plots
    arrivals: np.ndarray | None  # disseminate mode: each node's first-arrival time
    max_one_way_s: float
    wall_s: float  # for the printed summary only: never in report.json
    sim_events: int


# Each core holds every member: n^2 entries of about this many bytes, all told (a compact core's 39 B
# with a shared PeerIndex, the swarm's int16 matrix of records held, the tables beside them):
# tracemalloc counts 44.6 B an entry at 2,000 nodes, and swarm-20k peaked at 17.34 GB, 46.2 B an
# entry over a small run's 0.11 GB. (Float64 times, a heard column and RTT columns were 90 B an
# entry: 20,000 nodes needed 34 GB; rows of slots were 220 B.)
BYTES_PER_ENTRY = 46
# A run starts only if that leaves this share of the memory available (with rows of slots, 10,000
# nodes' 20.5 GB estimate fit 90 % of a 24 GB machine's 22.8 GB free, and its warm start alone
# passed 19.4 GB)
HEADROOM = 0.8


def memory_needed_gb(nodes: int) -> float:
    """About what a membership run of ``nodes`` nodes (joins included) holds at its peak."""
    return nodes * nodes * BYTES_PER_ENTRY / 2**30


def fits(nodes: int) -> tuple[bool, float, float]:
    """Whether a membership run of ``nodes`` nodes may start here (refused now rather than
    swapped or killed for memory an hour in), and the GB it needs and the GB available."""
    need, have = memory_needed_gb(nodes), memory_available_gb()
    return need <= HEADROOM * have, need, have


def memory_available_gb() -> float:
    """MemAvailable (Linux); infinity where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        return math.inf


def rng(seed: int, concern: str) -> random.Random:
    return random.Random(f"{seed}:{concern}")


def timing(name: str, overrides: tuple[tuple[str, float | int], ...] = ()) -> Timing:
    preset = Timing.lan() if name == "lan" else Timing.wan()
    return replace(preset, **dict(overrides))


def grace(t: Timing, nodes: int) -> float:
    """The longest a DEAD can lag the moment the peer stopped being reachable: a probe's
    interval and timeouts, then the longest suspicion (Lifeguard's maximum)."""
    _, high = suspicion_bounds(nodes, t.probe_interval, t.suspicion_mult, t.suspicion_max_mult, t.suspicion_log_cap)
    return t.probe_interval + t.probe_timeout + t.indirect_timeout + high


def place(s: sc.Scenario, total: int | None = None) -> list[str] | None:
    """Each node's country (the scenario's placement, seeded); raises ScenarioError for what
    only the placement can tell (a partition naming a country no node was placed in)."""
    return sc.place(s, rng(s.seed, "place"), s.nodes + s.joins if total is None else total)


def latency(s: sc.Scenario, total: int):
    """The swarm's latency model for ``total`` nodes and each node's country (or Nones)."""
    from .network import Latency

    placed = place(s, total)
    net = s.network
    if placed is not None:
        return Latency.countries(placed), placed
    if net.latency:
        return Latency.matrix(net.latency, total), [None] * total
    return Latency.uniform(total, net.rtt_ms if net.rtt_ms is not None else 20.0), [None] * total


def run(s: sc.Scenario, progress: Progress | None = None) -> Outcome:
    wall0 = time.monotonic()
    if s.mode == "disseminate":
        return _disseminate(s, progress, wall0)
    return _membership(s, progress, wall0)


def _disseminate(s: sc.Scenario, progress: Progress | None, wall0: float) -> Outcome:
    from .gossipsub import disseminate

    lat, placed = latency(s, s.nodes)
    source = rng(s.seed, "picks").randrange(s.nodes)
    arrivals = np.asarray(disseminate(lat, source=source, loss=s.network.loss, jitter_ms=s.network.jitter_ms,
                                      seed=s.seed), dtype=np.float64)
    reached = np.isfinite(arrivals)
    times = np.sort(arrivals[reached])
    others = s.nodes - 1  # the source has it at 0

    def when(q: int) -> float | None:
        k = math.ceil(others * q / 100)  # the k-th other node to get it; times[0] is the source
        return float(times[k]) if k < len(times) else None

    figures = {"dissemination_s": {"source": source, "nodes": s.nodes, "reached": int(reached.sum()),
                                   "t50": when(50), "t90": when(90), "t99": when(99), "t100": when(100),
                                   "max_one_way_s": lat.max_one_way()},
               "nodes": {"countries": _count(placed)}}
    return Outcome(scenario=s, figures=figures, metrics=None, arrivals=arrivals,
                   max_one_way_s=lat.max_one_way(), wall_s=time.monotonic() - wall0, sim_events=0)


def _membership(s: sc.Scenario, progress: Progress | None, wall0: float) -> Outcome:
    from .swarm import Swarm

    total = s.nodes + s.joins
    lat, placed = latency(s, total)
    t = timing(s.timing, s.overrides)
    used = sorted(set(lat.sites))
    farthest = lat.owd[:, used].max(axis=1)  # per site: its longest one-way delay to any used site
    metrics = Metrics({i: placed[i] for i in range(s.nodes)}, seconds=s.seconds, grace=grace(t, s.nodes),
                      from_s=min(30.0, s.seconds / 4), far=lambda node: float(farthest[lat.sites[node]]))

    def on_changed(now, observer, peer, old, new, reason):
        metrics.changed(now, observer, peer, old.value if old is not None else None,
                        new.value if new is not None else None)

    def on_received(now, observer, peer, seq):
        metrics.delivered(now, observer, peer, seq)

    swarm = Swarm(lat, timing=t, loss=s.network.loss, jitter_ms=s.network.jitter_ms, seed=s.seed,
                  on_changed=on_changed, on_received=on_received, started=range(s.nodes))
    play = _Player(s, swarm, metrics, placed, rng(s.seed, "picks"))
    for ev in s.events:
        swarm.at(ev.at, play.handler(ev))

    running = np.zeros(total, dtype=bool)

    def sample(now: float) -> None:
        running[:] = False
        running[swarm.running_nodes()] = True
        tr = swarm.traffic
        metrics.traffic(now, (tr.msgs_sent, tr.bytes_sent, tr.msgs_recv, tr.bytes_recv), running, tr.recv_by_kind)
        if progress is not None:
            progress(now)

    sample(swarm.now)
    swarm.run_until(s.seconds, progress=sample, every=1.0)
    if not metrics.series["t"] or metrics.series["t"][-1] < s.seconds:
        sample(swarm.now)
    metrics.finish(swarm.now, swarm.counters())
    figures = metrics.report()
    return Outcome(scenario=s, figures=figures, metrics=metrics, arrivals=None, max_one_way_s=lat.max_one_way(),
                   wall_s=time.monotonic() - wall0, sim_events=swarm.events)


class _Player:
    """The scenario's events, carried out on the swarm and logged in the metrics."""

    def __init__(self, s: sc.Scenario, swarm, metrics: Metrics, placed: list, picks: random.Random) -> None:
        self.s, self.swarm, self.metrics, self.placed, self.picks = s, swarm, metrics, placed, picks
        self.spare = list(range(s.nodes, len(placed)))  # never started: churn's joins take these first
        self.left: list[int] = []

    def handler(self, ev: sc.Event) -> Callable[[], None]:
        kind = type(ev).__name__.lower()
        return lambda: getattr(self, kind)(ev)

    def _pick(self, count: int) -> list[int]:
        up = self.swarm.running_nodes()
        return self.picks.sample(up, min(count, len(up)))

    def crash(self, ev: sc.Crash) -> None:
        for node in self._pick(ev.count):
            (self.swarm.kill if ev.kill else self.swarm.crash)(node)
            self.metrics.crash(self.swarm.now, node)
            if ev.revive_after is not None:
                self.swarm.at(self.swarm.now + ev.revive_after, lambda node=node: self._revive(node))

    def _revive(self, node: int) -> None:
        if not self.swarm.running(node) and node not in self.left:
            self.swarm.revive(node)
            self.metrics.revive(self.swarm.now, node)

    def leave(self, ev: sc.Leave) -> None:
        for node in self._pick(ev.count):
            self._leave(node)

    def _leave(self, node: int) -> None:
        self.swarm.leave(node)
        self.left.append(node)
        self.metrics.leave(self.swarm.now, node)

    def change(self, ev: sc.Change) -> None:
        for node in self._pick(ev.count):
            seq = self.swarm.change(node)
            self.metrics.change(self.swarm.now, node, seq if isinstance(seq, int) else 0)

    def partition(self, ev: sc.Partition) -> None:
        cut = self.swarm.partition_countries(ev.a, ev.b)
        self.metrics.partition(ev.at, ev.until, ev.a, ev.b)
        self.swarm.at(ev.until, lambda: self.swarm.heal(cut))

    def congest(self, ev: sc.Congest) -> None:
        for node in self._pick(ev.count):
            self.swarm.congest(node, ev.delay_ms / 1000)
            self.metrics.congest(self.swarm.now, node)
            self.swarm.at(ev.until, lambda node=node: self.swarm.congest(node, 0.0))

    def churn(self, ev: sc.Churn) -> None:
        """Joins and leaves alternate, evenly spaced: R per minute, half each, join first."""
        step = 60.0 / ev.per_min
        k = 0
        while ev.at + k * step < ev.until:
            self.swarm.at(ev.at + k * step, self._join if k % 2 == 0 else self._churn_leave)
            k += 1

    def _join(self) -> None:
        if self.spare:
            node = self.spare.pop(0)
        elif self.left:
            node = self.left.pop(0)
        else:
            return
        self.swarm.join(node)
        self.metrics.join(self.swarm.now, node, self.placed[node])

    def _churn_leave(self) -> None:
        (node,) = self._pick(1) or (None,)
        if node is not None:
            self._leave(node)


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        if v is not None:
            out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))
