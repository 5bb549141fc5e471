"""A cluster of membership cores on a fake network with a fake clock (no I/O, seeded).

The network delivers the cores' actions the way the trio driver would: records and rumors
reach every reachable node after ``latency``; a probe of a live, reachable node is acked
after a round trip; a killed node refuses at once (its port is closed); a partitioned one
never answers. ``loss`` drops that fraction of probe answers and gossip deliveries.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from swarmd.gossip.membership import (Changed, Membership, Probe, ProbeVia, PublishRecord, PublishRumor,
                                      State, Sync, Timing)
from swarmd.gossip.wire import Record, Rumor


INFINITE_CERT = SimpleNamespace(expires=float("inf"))


def record(peer: str, seq: int, addrs: tuple[str, ...] = ("/ip4/10.0.0.1/tcp/4001",)) -> Record:
    return Record(swarm="s", peer=peer, seq=seq, issued=0.0, ttl=120.0, addrs=addrs, resources=None,  # type: ignore[arg-type]
                  labels={}, wg=None, cert=INFINITE_CERT, blob=b"")  # type: ignore[arg-type]


@dataclass
class Cluster:
    names: list[str]
    timing: Timing = field(default_factory=Timing.wan)
    latency: float = 0.02
    loss: float = 0.0
    seed: int = 1
    now: float = 0.0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.nodes: dict[str, Membership] = {}
        self.down: set[str] = set()
        self.cut: set[frozenset[str]] = set()
        self.addrs: dict[str, tuple[str, ...]] = {}
        self.changes: list[tuple[float, str, Changed]] = []
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.epochs: dict[str, int] = {}
        for name in self.names:
            self.start(name)

    # --- control ------------------------------------------------------------------------

    def start(self, name: str, addrs: tuple[str, ...] = ("/ip4/10.0.0.1/tcp/4001",)) -> None:
        self.epochs[name] = self.epochs.get(name, 0) + 1
        self.addrs[name] = addrs
        self.down.discard(name)
        self.nodes[name] = Membership(name, self.epochs[name] << 32, self.timing,
                                      random.Random(self.rng.random()), self.now)
        self._drain(name)
        for other in self.names:  # bootstrap: a push-pull with every started peer
            if other != name and other in self.nodes:
                self._sync(name, other)

    def kill(self, name: str) -> None:
        self.down.add(name)

    def partition(self, side: set[str]) -> None:
        self.cut = {frozenset((a, b)) for a in side for b in self.names if b not in side}

    def heal(self) -> None:
        self.cut = set()

    def reachable(self, a: str, b: str) -> bool:
        return a not in self.down and b not in self.down and frozenset((a, b)) not in self.cut

    def state(self, observer: str, peer: str) -> State | None:
        m = self.nodes[observer].members.get(peer)
        return None if m is None else m.state

    def run_until(self, t: float) -> None:
        while True:
            candidates = [self._queue[0][0]] if self._queue else []
            candidates += [n.next_deadline() for name, n in self.nodes.items() if name not in self.down]
            nxt = min(candidates, default=t)
            if nxt > t:
                break
            self.now = max(self.now, nxt)
            while self._queue and self._queue[0][0] <= self.now:
                _, _, fn = heapq.heappop(self._queue)
                fn()
            for name, node in self.nodes.items():
                if name not in self.down and node.next_deadline() <= self.now:
                    node.handle_timeout(self.now)
                    self._drain(name)
        self.now = t

    def run_for(self, seconds: float) -> None:
        self.run_until(self.now + seconds)

    def wait_for(self, predicate: Callable[[], bool], limit: float, step: float = 0.01) -> float:
        """Simulated seconds until ``predicate`` holds; fails after ``limit``."""
        start = self.now
        while not predicate():
            if self.now - start > limit:
                raise AssertionError(f"not within {limit} simulated s")
            self.run_for(step)
        return self.now - start

    # --- the fake network ---------------------------------------------------------------

    def _at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), fn))

    def _lost(self) -> bool:
        return self.loss > 0 and self.rng.random() < self.loss

    def _deliver(self, to: str, msg: Record | Rumor, src: str) -> None:
        def arrive() -> None:  # a message already sent arrives even if its sender died since
            if to not in self.down and frozenset((src, to)) not in self.cut:
                node = self.nodes[to]
                if isinstance(msg, Record):
                    node.receive_record(self.now, msg)
                elif node.screen(msg) is None:  # the daemon's gossip validator
                    node.receive_rumor(self.now, msg)
                self._drain(to)
        if src not in self.down and not self._lost():
            self._at(self.now + self.latency, arrive)

    def _broadcast(self, src: str, msg: Record | Rumor) -> None:
        for name in self.names:
            if name != src:
                self._deliver(name, msg, src)

    def _sync(self, a: str, b: str) -> None:
        if not self.reachable(a, b):
            return
        for x, y in ((a, b), (b, a)):
            nx, ny = self.nodes[x], self.nodes[y]
            own = record(x, nx.seq, self.addrs[x])
            ny.merge_sync(self.now, [m.record for m in nx.members.values()] + [own], nx.sync_claims(), by=x)
            self._drain(y)

    def _drain(self, name: str) -> None:
        node = self.nodes[name]
        for action in node.take_actions():
            match action:
                case PublishRecord(seq):
                    self._broadcast(name, record(name, seq, self.addrs[name]))
                case PublishRumor(kind, about, inc):
                    self._broadcast(name, Rumor(kind=kind, swarm="s", sender=name, about=about, incarnation=inc,
                                                issued=0.0, blob=b""))
                case Probe(pid, peer, timeout):
                    self._probe(name, pid, peer)
                case ProbeVia(pid, via, target, timeout):
                    self._probe_via(name, pid, via, target, timeout)
                case Sync(peer):
                    self._at(self.now + self.latency, lambda a=name, b=peer: self._sync(a, b))
                case Changed():
                    self.changes.append((self.now, name, action))

    def _probe(self, src: str, pid: int, peer: str) -> None:
        node = self.nodes[src]
        if self.reachable(src, peer) and not self._lost():
            rtt = 2 * self.latency
            self._at(self.now + rtt, lambda: (node.probe_result(self.now, pid, True, rtt), self._drain(src)))
        elif peer in self.down and frozenset((src, peer)) not in self.cut:
            self._at(self.now + self.latency, lambda: (node.probe_result(self.now, pid, False), self._drain(src)))

    def _probe_via(self, src: str, pid: int, via: str, target: str, timeout: float) -> None:
        node = self.nodes[src]
        if not self.reachable(src, via) or self._lost():
            return
        if self.reachable(via, target):
            self._at(self.now + 4 * self.latency,
                     lambda: (node.via_result(self.now, pid, via, True), self._drain(src)))
        else:
            wait = 3 * self.latency if target in self.down else 2 * self.latency + timeout
            self._at(self.now + wait, lambda: (node.via_result(self.now, pid, via, False), self._drain(src)))
