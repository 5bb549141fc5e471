"""What a `swarm-sim run` measured, computed from what the simulation observed.

Inputs, all in simulated seconds and in time order (the runner feeds them as they happen):
- the scenario's event log: ``crash``, ``revive``, ``join``, ``leave``, ``partition``,
  ``change`` (a node published a new record, with its seq);
- the cores' ``Changed`` actions (``changed``: observer, peer, old, new) and record
  deliveries (``delivered``: a receiver took a peer's record of some seq);
- the network's per-node traffic counters, sampled once a simulated second (``traffic``);
- the cores' counters, summed, at the end (``finish``).

Definitions (each figure in the report means exactly this):
- **detection**: for each crash, each observer that was up at the crash and stayed up: the
  time from the crash to the observer's first DEAD for the victim. ``by_all``: per crash,
  when the last of those observers got there (what the lab's bench measures). An observer
  that never declared it dead by the run's end is ``missed``; a DEAD that comes after the
  victim's revive still counts as this crash's detection (late), not as a false one.
- **false dead**: a DEAD about a peer that was up and reachable from the observer. Not
  false (counted apart, under ``excused``): the peer was down (crashed or left), was
  revived less than ``grace`` ago (the observer's suspicion began while it was down), or a
  partition separated the two at some time in the last ``grace`` seconds. ``grace`` is the
  longest a suspicion can take plus a probe (the runner computes it from the timing).
- **convergence**: for each change, the nodes up at the change (not the changer) must each
  take a record of that seq or later; ``t50/t99/t100``: when 50/99/100 % of them had. A
  target that goes down before it got the record is no longer waited for. ``excess``: t100
  beyond the longest one-way delay from the changer (what the lab's bench calls
  ``change_excess``: the part the protocol, not the speed of light, is responsible for).
- **traffic**: per node and second, messages and bytes sent and received, over the
  seconds the node was up from start to end; ``mean``/``p99`` across nodes of each node's
  rate over the run after ``from_s`` (the first bootstrap syncs left out), and a series of
  the per-second mean and p99 across nodes. The bytes received are also split by message
  kind (``bytes_recv_by_kind_per_s``: probes, gossip, duplicates, ihave, syncs; the
  network's KINDS), each with its series (``recv_KIND_mean``/``_p99``).

Percentiles are the bench's (``statistics.quantiles(n=100, method="inclusive")``), so the
lab's figures and these compare like with like.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

Node = int  # the simulator numbers nodes 0..n-1
Country = str | None  # ISO code, None when the network is not by country

DEAD = "dead"
SUSPECT = "suspect"


def pct(samples: Sequence[float], q: int) -> float | None:
    """The q-th percentile as the bench computes it (None for no samples)."""
    if not samples:
        return None
    if len(samples) == 1:
        return float(samples[0])
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


def spread(samples: Sequence[float]) -> dict[str, float | int | None]:
    """n, p50, p99, max, mean of some samples (None where there are none)."""
    return {"n": len(samples), "p50": pct(samples, 50), "p99": pct(samples, 99),
            "max": max(samples) if samples else None,
            "mean": statistics.fmean(samples) if samples else None}


@dataclass(slots=True)
class CrashRecord:
    at: float
    victim: Node
    waiting: set[Node]  # observers that have not declared it dead yet
    observers: int
    samples: list[float] = field(default_factory=list)
    revived: float | None = None
    last: float | None = None  # when the last observer got there


@dataclass(slots=True)
class ChangeRecord:
    at: float
    node: Node
    seq: int
    waiting: set[Node]
    targets: int
    far: float  # the longest one-way delay from the changer to any node
    arrivals: list[float] = field(default_factory=list)  # seconds after ``at``, in order
    reached: dict[int, float | None] = field(default_factory=lambda: {50: None, 99: None, 100: None})

    def check(self, now: float) -> None:
        for q in (50, 99, 100):
            if self.reached[q] is None and len(self.arrivals) >= math.ceil(self.targets * q / 100):
                self.reached[q] = self.arrivals[-1] if self.arrivals else now - self.at


@dataclass(slots=True)
class Cut:
    start: float
    end: float
    a: frozenset[str]
    b: frozenset[str]

    def separates(self, x: Country, y: Country) -> bool:
        return (x in self.a and y in self.b) or (x in self.b and y in self.a)


TRAFFIC = ("msgs_sent", "bytes_sent", "msgs_recv", "bytes_recv")  # the network's per-node counters


class Metrics:
    def __init__(self, nodes: Mapping[Node, Country], *, seconds: float, grace: float,
                 from_s: float = 0.0, far: Callable[[Node], float] = lambda node: 0.0) -> None:
        """``nodes``: each starting node's name -> its country (None when the network is not
        by country); ``far(node)``: the longest one-way delay from ``node`` to any other."""
        self.far = far
        self.country: dict[Node, Country] = dict(nodes)
        self.up: dict[Node, None] = dict.fromkeys(nodes)  # ordered: the runner picks from it
        self.seconds = seconds
        self.grace = grace
        self.from_s = from_s
        self.crashes: list[CrashRecord] = []
        self._open: dict[Node, CrashRecord] = {}  # victim -> its latest crash
        self._revived: dict[Node, float] = {}
        self._left: set[Node] = set()
        self.cuts: list[Cut] = []
        self.changes: list[ChangeRecord] = []
        self._watch: dict[Node, list[ChangeRecord]] = {}  # changer -> its changes still spreading
        self.false_dead: list[tuple[float, Node, Node]] = []
        self.excused = {"down": 0, "revived": 0, "partition": 0}
        self.suspect_times: list[float] = []
        self.counts = {"crashes": 0, "revives": 0, "joins": 0, "leaves": 0, "changes": 0, "partitions": 0,
                       "congested": 0}
        self._last: tuple[list[np.ndarray], np.ndarray] | None = None  # counters, running at the last sample
        self._seconds: np.ndarray | None = None  # per node: seconds counted (after from_s)
        self._sums: dict[str, np.ndarray] = {}  # per node and counter (TRAFFIC, recv_KIND): its sum in them
        self._t_prev: float | None = None
        self.series: dict[str, list[float]] = {k: [] for k in (
            "t", "up", *(f"{name}_{q}" for name in TRAFFIC for q in ("mean", "p99")))}  # and recv_KIND_...
        self.core: dict[str, int] = {}
        self.end: float | None = None

    # --- the event log ----------------------------------------------------------------

    def crash(self, now: float, node: Node) -> None:
        self.counts["crashes"] += 1
        self._down(now, node)
        rec = CrashRecord(at=now, victim=node, waiting=set(self.up), observers=len(self.up))
        self.crashes.append(rec)
        self._open[node] = rec

    def revive(self, now: float, node: Node) -> None:
        self.counts["revives"] += 1
        self.up[node] = None
        self._revived[node] = now
        rec = self._open.get(node)
        if rec is not None and rec.revived is None:
            rec.revived = now

    def join(self, now: float, node: Node, country: Country = None) -> None:
        self.counts["joins"] += 1
        self.country[node] = country
        self.up[node] = None

    def leave(self, now: float, node: Node) -> None:
        self.counts["leaves"] += 1
        self._left.add(node)
        self._down(now, node)

    def partition(self, start: float, end: float, a: Iterable[str], b: Iterable[str]) -> None:
        self.counts["partitions"] += 1
        self.cuts.append(Cut(start, end, frozenset(a), frozenset(b)))

    def congest(self, now: float, node: Node) -> None:
        self.counts["congested"] += 1

    def change(self, now: float, node: Node, seq: int) -> None:
        self.counts["changes"] += 1
        targets = [n for n in self.up if n != node]
        rec = ChangeRecord(at=now, node=node, seq=seq, waiting=set(targets), targets=len(targets),
                           far=self.far(node))
        rec.check(now)
        self.changes.append(rec)
        if rec.waiting:
            self._watch.setdefault(node, []).append(rec)

    def watching(self, node: Node) -> bool:
        """Whether a delivery of ``node``'s record matters (the runner may skip the rest)."""
        return node in self._watch

    def _down(self, now: float, node: Node) -> None:
        self.up.pop(node, None)
        for rec in self._open.values():  # a down observer declares nothing: not missed
            rec.waiting.discard(node)
        for watched in self._watch.values():
            for rec in watched:
                if node in rec.waiting:
                    rec.waiting.discard(node)
                    rec.targets -= 1
                    rec.check(now)

    # --- what the cores said ----------------------------------------------------------

    def changed(self, now: float, observer: Node, peer: Node, old: Country, new: Country) -> None:
        if new == SUSPECT:
            self.suspect_times.append(now)
        if new != DEAD or old == DEAD:
            return
        rec = self._open.get(peer)
        if rec is not None and observer in rec.waiting:
            rec.waiting.discard(observer)
            rec.samples.append(now - rec.at)
            rec.last = now - rec.at
            return
        if peer not in self.up:
            self.excused["down"] += 1
        elif now - self._revived.get(peer, -math.inf) < self.grace:
            self.excused["revived"] += 1
        elif self._separated(now, observer, peer):
            self.excused["partition"] += 1
        else:
            self.false_dead.append((now, observer, peer))

    def _separated(self, now: float, x: Node, y: Node) -> bool:
        cx, cy = self.country.get(x), self.country.get(y)
        return any(c.start <= now < c.end + self.grace and c.separates(cx, cy) for c in self.cuts)

    def delivered(self, now: float, receiver: Node, peer: Node, seq: int) -> None:
        watched = self._watch.get(peer)
        if not watched:
            return
        for rec in watched:
            if seq >= rec.seq and receiver in rec.waiting:
                rec.waiting.discard(receiver)
                rec.arrivals.append(now - rec.at)
                rec.check(now)
        if all(not rec.waiting for rec in watched):
            del self._watch[peer]

    # --- traffic ----------------------------------------------------------------------

    def traffic(self, now: float, counters: Sequence[np.ndarray], running: np.ndarray,
                kinds: Mapping[str, np.ndarray] | None = None) -> None:
        """Once a simulated second: the network's cumulative per-node (msgs sent, bytes sent,
        msgs received, bytes received) arrays, the bytes received by message kind (``kinds``:
        kind -> array), and a bool array of the nodes running now. A node counts for a second
        only when it ran at both of its ends."""
        named = dict(zip(TRAFFIC, counters)) | {f"recv_{k}": v for k, v in (kinds or {}).items()}
        prev, self._t_prev = self._t_prev, now
        last, self._last = self._last, ({k: c.copy() for k, c in named.items()}, running.copy())
        if last is None or prev is None or now <= prev:
            return
        span = now - prev
        both = running & last[1][:len(running)] if len(last[1]) == len(running) else running
        counted = now > self.from_s
        if counted:
            self._seconds = self._seconds + np.where(both, span, 0.0) if self._seconds is not None \
                else np.where(both, span, 0.0)
        s = self.series
        s["t"].append(now)
        s["up"].append(int(running.sum()))
        for name, counter in named.items():
            delta = counter - last[0].get(name, 0.0)
            if counted:
                add = np.where(both, delta, 0.0)
                self._sums[name] = self._sums[name] + add if name in self._sums else add
            column = delta[both] / span
            s.setdefault(f"{name}_mean", []).append(float(column.mean()) if column.size else 0.0)
            s.setdefault(f"{name}_p99", []).append(float(np.percentile(column, 99)) if column.size else 0.0)

    # --- the end ----------------------------------------------------------------------

    def finish(self, now: float, core: Mapping[str, int]) -> None:
        self.end = now
        self.core = dict(core)

    def detection_samples(self) -> list[float]:
        return [s for rec in self.crashes for s in rec.samples]

    def report(self) -> dict:
        """The figures as plain data (report.py rounds and writes them)."""
        samples = self.detection_samples()
        missed = sum(len(rec.waiting) for rec in self.crashes)
        by_all = [rec.last for rec in self.crashes if not rec.waiting and rec.last is not None]
        changes = []
        for rec in self.changes:
            t100 = rec.reached[100]
            changes.append({"at": rec.at, "node": rec.node, "seq": rec.seq, "targets": rec.targets,
                            "reached": len(rec.arrivals), "t50": rec.reached[50], "t99": rec.reached[99],
                            "t100": t100, "far": rec.far, "excess": None if t100 is None else t100 - rec.far})
        conv = {f"t{q}": spread([c[f"t{q}"] for c in changes if c[f"t{q}"] is not None]) for q in (50, 99, 100)}
        conv["excess"] = spread([c["excess"] for c in changes if c["excess"] is not None])
        conv |= {"changes": len(changes), "incomplete": sum(c["t100"] is None for c in changes), "each": changes}
        secs = self._seconds if self._seconds is not None else np.zeros(0)
        counted = secs > 0
        traffic: dict = {"from_s": self.from_s, "nodes": int(counted.sum())}

        def per_s(name: str) -> dict:
            total = self._sums.get(name)
            per_node = total[counted] / secs[counted] if total is not None else np.zeros(0)
            return {"mean": float(per_node.mean()) if per_node.size else None,
                    "p99": float(np.percentile(per_node, 99)) if per_node.size else None,
                    "max": float(per_node.max()) if per_node.size else None}

        for name in TRAFFIC:
            traffic[f"{name}_per_s"] = per_s(name)
        # bytes received per node per second by message kind (they add up to bytes_recv_per_s's mean)
        traffic["bytes_recv_by_kind_per_s"] = {name[5:]: per_s(name) for name in self._sums if name.startswith("recv_")}
        traffic["series"] = self.series
        suspicions = {"declared": len(self.suspect_times), "refuted": self.core.get("refutations"),
                      "cleared": self.core.get("accusations_cleared")}
        return {
            "detection": {"crashes": len(self.crashes), "missed": missed, "per_observer_s": spread(samples),
                          "by_all_s": spread(by_all),
                          "each": [{"at": r.at, "victim": r.victim, "observers": r.observers,
                                    "detected": len(r.samples), "by_all_s": r.last if not r.waiting else None}
                                   for r in self.crashes]},
            "false_dead": {"count": len(self.false_dead),
                           "observers": len({o for _, o, _ in self.false_dead}),
                           "peers": len({p for _, _, p in self.false_dead}),
                           "excused": dict(self.excused), "grace_s": self.grace,
                           "first": [{"t": t, "observer": o, "peer": p} for t, o, p in self.false_dead[:20]]},
            "suspicions": suspicions,
            "convergence_s": conv,
            "traffic": traffic,
            "core": self.core,
            "events": dict(self.counts),
            "nodes": {"up_at_end": len(self.up), "countries": _count(self.country.values())},
        }


def _count(values: Iterable[Country]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        if v is not None:
            out[v] = out.get(v, 0) + 1
    return out
