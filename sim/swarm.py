"""A swarm of unmodified membership cores on the simulated network and gossipsub model.

Theory of operation:
- Each node runs its own ``swarmd.gossip.membership.Membership`` (not subclassed, not
  patched), named ``n0``, ``n1``, ... (or the names given), with its own
  ``random.Random`` seeded from the scenario's seed, the node and its epoch. The swarm is
  only what the trio driver is in the daemon: it carries out the core's actions on the
  simulated network (sim/network.py) and the dissemination model (sim/gossipsub.py), and
  feeds the results back with the simulated time.
- Actions: ``PublishRecord``/``PublishRumor`` spread over the mesh (each node's first
  receipt is one ``receive_record``/``receive_rumor``, a rumor ``screen``ed first as the
  daemon's validator does); ``Probe``: a ping round trip, then ``probe_result(ok, rtt)``,
  or nothing if the target is silent (crashed, cut off: the core's own deadline fires);
  ``ProbeVia``: the helper pings the target with the given timeout, then ``via_result``;
  ``Sync``: a push-pull, ``merge_sync`` on both sides with the other's records and
  ``sync_claims()``; ``Changed``: reported to ``on_changed``, and a peer held dead or left
  leaves the node's mesh.
- A sync runs as the daemon's (gossip/sync.py): the responder's digest (``[peer, seq]`` of
  every record it holds), the requester's records the digest lacks or holds older and the
  peers it wants, then the wanted records. The swarm keeps, per node and peer, which of the
  peer's records the node's core holds (``_held``, an int16 matrix kept from the cores' own
  results; a later record has a higher index), so a sync costs numpy comparisons plus the
  records that differ, not a Python loop over the view.
- Start: the nodes given start as a formed swarm (each holds every other's first record,
  as after bootstrap); a node that joins later syncs with ``BOOTSTRAP`` random running
  nodes, as ``swarmd`` does with its bootstrap peers.
- Determinism: one event heap (sim/engine.py), randomness from ``random.Random`` or a
  numpy ``Generator`` seeded per concern, nodes are ints and every collection whose order
  reaches an event or a draw is a list or a dict (never a set of str).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from swarmd.gossip.membership import (Changed, Counters, Membership, PeerIndex, Probe, ProbeVia, PublishRecord,
                                      PublishRumor, State, Sync, Timing, record_ttl, refresh_period)
from swarmd.gossip.rtts import MAX_RTTS
from swarmd.gossip.protocols import KINDS  # what a node receives, by message kind: as the daemon counts it

from . import gossipsub
from .engine import Engine
from .gossipsub import CONTROL_BYTES, D_LAZY, HEARTBEAT, HISTORY_GOSSIP, MSG_ID_BYTES, PROBE_BYTES, QUANTUM, \
    RUMOR_BYTES, Mesh, record_bytes
from .network import CRASHED, STOPPED, UP, Latency, Network

INF = float("inf")
BOOTSTRAP = 3  # peers a joining node syncs with first
CLAIM_BYTES = 50
DIGEST_BYTES = 64  # a digest's [peer, seq], msgpack: a 52-character peer id and a 64-bit seq
MAX_RECORDS = 2**15 - 1  # records a node may publish in one run (_held's int16 indexes)
HELLO_BYTES = 210  # a sync's first frame each way: the sender's certificate (measured: 207 B)


class SimRecord:
    """What the core reads of a record (membership.Carried). Shared by every node that holds it."""

    __slots__ = ("peer", "seq", "ttl", "issued", "cert_expires", "watch", "data")

    def __init__(self, peer: str, seq: int, ttl: float = 120.0, issued: float = 0.0,
                 cert_expires: float = INF, data: object = None) -> None:
        self.peer = peer
        self.seq = seq
        self.ttl = ttl
        self.issued = issued
        self.cert_expires = cert_expires
        self.watch = False  # published after change(): its receipts go to on_received
        self.data = data  # anything a test wants a record to carry (e.g. addresses)

    def __repr__(self) -> str:
        return f"SimRecord({self.peer!r}, {self.seq})"


class SimRumor:
    """What the core reads of a rumor (membership.Rumored)."""

    __slots__ = ("kind", "sender", "about", "incarnation")

    def __init__(self, kind: str, sender: str, about: str, incarnation: int) -> None:
        self.kind = kind
        self.sender = sender
        self.about = about
        self.incarnation = incarnation




class Traffic:
    """Cumulative per node since t=0 (numpy float64 arrays, one entry per node); the bytes
    received also by kind (``recv_by_kind``, KINDS: they add up to ``bytes_recv``)."""

    def __init__(self, n: int) -> None:
        self.msgs_sent = np.zeros(n)
        self.msgs_recv = np.zeros(n)
        self.bytes_sent = np.zeros(n)
        self.bytes_recv = np.zeros(n)
        self.recv_by_kind = {kind: np.zeros(n) for kind in KINDS}

    def one(self, a: int, b: int, size: float, kind: str) -> None:
        """One message from a to b."""
        self.msgs_sent[a] += 1
        self.bytes_sent[a] += size
        self.received(b, 1, size, kind)

    def received(self, nodes, msgs, size, kind: str) -> None:
        """``msgs`` messages of ``size`` bytes in all, of ``kind``, at ``nodes`` (a node, or an
        array of distinct nodes with arrays of counts and sizes)."""
        self.msgs_recv[nodes] += msgs
        self.bytes_recv[nodes] += size
        self.recv_by_kind[kind][nodes] += size


ChangedFn = Callable[[float, int, int, "State | None", "State | None", str], None]
ReceivedFn = Callable[[float, int, int, int], None]


class Swarm:
    def __init__(self, latency: Latency, *, timing: Timing | None = None, loss: float = 0.0,
                 jitter_ms: float = 0.0, seed: int = 1, on_changed: ChangedFn | None = None,
                 on_received: ReceivedFn | None = None, started: Iterable[int] | None = None,
                 names: Sequence[str] | None = None) -> None:
        n = latency.n
        self.n = n
        self.timing = timing or Timing.wan()
        self.seed = seed
        self.names = list(names) if names is not None else [f"n{i}" for i in range(n)]
        if len(self.names) != n or len(set(self.names)) != n:
            raise ValueError("one distinct name per node")
        self.index = {name: i for i, name in enumerate(self.names)}
        self.peers = PeerIndex(self.names)  # every core's rows: node v is row v, in all of them
        self.record_bytes = record_bytes(min(n - 1, MAX_RTTS))  # each record lists its nearest members' RTTs
        self.on_changed = on_changed
        self.on_received = on_received
        self.engine = Engine()
        self.net = Network(latency, loss=loss, jitter_ms=jitter_ms, seed=seed)
        self.latency = latency
        self.mesh = Mesh(self.net, random.Random(f"{seed}/mesh"))
        self.gen = np.random.default_rng([seed, 1])  # the gossip model's draws
        self.rng = random.Random(f"{seed}/swarm")  # bootstrap peers
        self.traffic = Traffic(n)
        self.cores: list[Membership | None] = [None] * n
        self.epoch = [0] * n
        self._armed = [INF] * n
        # [node, peer]: index in _records[peer], -1: none. int16 (n^2 of them: 2 B a member, 0.8 GB at 20,000
        # nodes): a node publishes a record a refresh, a change or a refutation, not MAX_RECORDS in any run
        self._held = np.full((n, n), -1, dtype=np.int16)
        self._rows = [memoryview(row) for row in self._held]  # the same rows, for one item at a time (faster)
        self._records: list[list[SimRecord]] = [[] for _ in range(n)]
        self._watch: dict[int, None] = {}
        self._watched: set[int] = set()  # nodes changed once: all their later records are reported too
        self._retired = Counters()
        self._recent: deque[int] = deque([0] * HISTORY_GOSSIP, maxlen=HISTORY_GOSSIP)  # messages per heartbeat
        self._published = 0
        self._quiet = False  # the warm start's "joined" changes are not reported
        for v in range(n):
            self.net.set_power(v, STOPPED)
        self._warm_start(list(range(n)) if started is None else sorted(set(started)))
        self.engine.at(HEARTBEAT, self._heartbeat)

    # --- control --------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.engine.now

    @property
    def events(self) -> int:
        return self.engine.events

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.engine.at(t, lambda _: fn())

    def run_until(self, t: float, progress: Callable[[float], None] | None = None, every: float = 1.0) -> None:
        if progress is None:
            self.engine.run_until(t)
            return
        while self.engine.now < t:
            self.engine.run_until(min(t, self.engine.now + every))
            progress(self.engine.now)

    def run_for(self, seconds: float) -> None:
        self.run_until(self.engine.now + seconds)

    def crash(self, node: int) -> None:
        """Silence: the node neither sends nor answers; its peers learn only by probing."""
        if self.cores[node] is None:
            return
        self.net.set_power(node, CRASHED)
        self._retire(node)

    def kill(self, node: int) -> None:
        """The daemon dies, its host stays up (``lab kill``): its connections are reset, so its
        mesh peers drop it and probe it at once (``connection_lost``); new connections are refused."""
        if self.cores[node] is None:
            return
        peers = list(self.mesh.peers[node])
        self.net.set_power(node, STOPPED)
        self.mesh.drop(node)
        self._retire(node)
        eng = self.engine
        for u in peers:
            c = self.cores[u]
            if c is not None and not self.net.cut(node, u):
                eng.at(eng.now + self.net.delay(node, u), self._reset, (u, c, node))

    def _reset(self, arg: tuple) -> None:
        u, c, node = arg
        if self.cores[u] is c:
            c.connection_lost(self.engine.now, self.names[node])
            self._act(u, c, c.take_actions())

    def revive(self, node: int) -> None:
        """The node (re)starts: a new core at the next epoch, bootstrapping by sync."""
        if self.cores[node] is not None:
            return
        self._start(node, bootstrap=True)

    join = revive

    def leave(self, node: int) -> None:
        """Graceful: the core's left rumor goes out, then the node stops (connections close)."""
        c = self.cores[node]
        if c is None:
            return
        c.leave(self.engine.now)
        self._act(node, c, c.take_actions())
        self.net.set_power(node, STOPPED)
        self.mesh.drop(node)
        self._retire(node)

    def change(self, node: int) -> int | None:
        """A capacity change: the core re-advertises; that record's receipts are reported, and so are
        those of every later record of the node (they carry the change: a node across a cut gets
        only those). The record's seq, or None when the core holds it back (at most one record per
        publish_interval; it goes out later, still watched)."""
        c = self.cores[node]
        if c is None:
            return None
        self._watch[node] = None
        self._watched.add(node)
        c.local_change(self.engine.now)
        self._act(node, c, c.take_actions())
        return None if node in self._watch else self._records[node][-1].seq

    def congest(self, node: int, delay: float) -> None:
        self.net.congest(node, delay)

    def partition(self, a: Iterable[int], b: Iterable[int]) -> int:
        return self.net.partition(a, b)

    def partition_countries(self, a: Iterable[str], b: Iterable[str]) -> int:
        labels, sites = self.latency.labels, self.latency.sites
        sa, sb = set(a), set(b)
        return self.net.partition([v for v in range(self.n) if labels[sites[v]] in sa],
                                  [v for v in range(self.n) if labels[sites[v]] in sb])

    def heal(self, cut: int | None = None) -> None:
        self.net.heal(cut)

    def deliver(self, node: int, msg: object) -> str | None:
        """Hand one message (a record or a rumor: a test's own, a liar's) to one node's core now,
        as its gossip validator and reader would; the core's result (None: screened out or not running)."""
        c = self.cores[node]
        if c is None:
            return None
        now = self.engine.now
        if hasattr(msg, "about"):
            if c.screen(msg) is not None:  # type: ignore[arg-type]
                return None
            res = c.receive_rumor(now, msg)  # type: ignore[arg-type]
        else:
            res = c.receive_record(now, msg)
        self._act(node, c, c.take_actions())
        return res

    # --- ground truth and observations ----------------------------------------------------

    def running(self, node: int) -> bool:
        return self.cores[node] is not None

    def running_nodes(self) -> list[int]:
        return [v for v in range(self.n) if self.cores[v] is not None]

    def reachable(self, a: int, b: int) -> bool:
        return self.net.reachable(a, b)

    def state(self, observer: int, peer: int) -> State | None:
        c = self.cores[observer]
        if c is None:
            return None
        m = c.view().get(self.names[peer])
        return None if m is None else m.state

    def counters(self) -> dict[str, int]:
        total = {f.name: getattr(self._retired, f.name) for f in dataclasses.fields(Counters)}
        for c in self.cores:
            if c is not None:
                for name in total:
                    total[name] += getattr(c.counters, name)
        return total

    # --- nodes ----------------------------------------------------------------------------

    def _new_core(self, v: int, born: float | None = None, first_refresh: float | None = None) -> Membership:
        self.epoch[v] += 1
        rng = random.Random(f"{self.seed}/core/{v}/{self.epoch[v]}")
        c = Membership(self.names[v], self.epoch[v] << 32, self.timing, rng, self.engine.now if born is None else born,
                       peers=self.peers, first_refresh=first_refresh, compact=True)
        self.cores[v] = c
        self.net.set_power(v, UP)
        self._held[v] = -1
        return c

    def _warm_start(self, nodes: list[int]) -> None:
        recs = []
        period = refresh_period(self.timing, len(nodes))
        for v in nodes:
            # started at some time in the last refresh interval, and refreshes spread over the swarm's refresh
            # period (as in a swarm that has run a while), not all within the first 30 s and in step after
            c = self._new_core(v, born=-self.rng.uniform(0, self.timing.refresh_interval),
                               first_refresh=self.rng.uniform(0, period))
            for a in c.take_actions():
                if type(a) is PublishRecord:
                    recs.append(self._record(v, a.seq, record_ttl(self.timing, len(nodes))))
        now = self.engine.now
        self._quiet = True
        try:
            for v in nodes:
                c = self.cores[v]
                assert c is not None
                c.load(now, [r for r in recs if r.peer != c.me])  # receive_record for each, in about half the time
                self._held[v, nodes] = self._held[nodes, nodes]
                self._act(v, c, c.take_actions())
        finally:
            self._quiet = False
        self.mesh.form(nodes)

    def _start(self, v: int, bootstrap: bool) -> None:
        c = self._new_core(v)
        mesh = self.mesh
        mesh.drop(v)
        mesh.graft(v, self.running_nodes())
        self._act(v, c, c.take_actions())
        if bootstrap:
            others = [u for u in self.running_nodes() if u != v]
            for u in self.rng.sample(others, min(BOOTSTRAP, len(others))):
                self._sync_start(v, c, u)

    def _retire(self, v: int) -> None:
        c = self.cores[v]
        assert c is not None
        for f in dataclasses.fields(Counters):
            setattr(self._retired, f.name, getattr(self._retired, f.name) + getattr(c.counters, f.name))
        self.cores[v] = None
        self._armed[v] = INF

    def _record(self, v: int, seq: int, ttl: float | None = None) -> SimRecord:
        """``ttl``: the core's (stretched in large swarms) unless given (the warm start's, for the swarm it builds)."""
        c = self.cores[v]
        assert c is not None
        r = SimRecord(self.names[v], seq, c.record_ttl if ttl is None else ttl)
        history = self._records[v]
        if len(history) >= MAX_RECORDS:
            raise RuntimeError(f"node {v} published {MAX_RECORDS:,} records: more than the int16 _held indexes")
        self._held[v, v] = len(history)
        history.append(r)
        return r

    # --- the core's actions ---------------------------------------------------------------

    def _act(self, v: int, c: Membership, actions: list) -> None:
        for a in actions:
            t = type(a)
            if t is Changed:
                self._changed(v, a)
            elif t is Probe:
                self._probe(v, c, a)
            elif t is ProbeVia:
                self._probe_via(v, c, a)
            elif t is PublishRecord:
                r = self._record(v, a.seq)
                self._watch.pop(v, None)
                # every later record carries the change too: a node across a cut gets only those
                r.watch = v in self._watched
                self._spread(v, r, self.record_bytes, self._deliver_record, len(self._records[v]) - 1)
            elif t is PublishRumor:
                self._spread(v, SimRumor(a.kind, c.me, a.about, a.incarnation), RUMOR_BYTES, self._deliver_rumor, 0)
            elif t is Sync:
                self._sync_start(v, c, self.index[a.peer])
        self._arm(v, c)

    def _arm(self, v: int, c: Membership) -> None:
        self._arm_at(v, c.next_deadline())

    def _arm_at(self, v: int, d: float) -> None:
        if d < self._armed[v]:
            eng = self.engine
            if d < eng.now:
                d = eng.now
            self._armed[v] = d
            eng._seq += 1
            heapq.heappush(eng._heap, (d, eng._seq, self._timeout, v))

    def _timeout(self, v: int) -> None:
        c = self.cores[v]
        now = self.engine.now
        if c is None or self._armed[v] != now:
            return  # stopped, or a stale entry (re-armed earlier since)
        self._armed[v] = INF
        c.handle_timeout(now)
        self._act(v, c, c.take_actions())

    def _changed(self, v: int, a: Changed) -> None:
        p = self.index[a.peer]
        new = a.new
        if new is None:
            self._held[v, p] = -1
        if new is None or new is State.DEAD or new is State.LEFT:
            self.mesh.prune(v, p)
        if self.on_changed is not None and not self._quiet:
            self.on_changed(self.engine.now, v, p, a.old, new, a.reason)

    # --- probes ---------------------------------------------------------------------------

    def _probe(self, v: int, c: Membership, a: Probe) -> None:
        p = self.index[a.peer]
        net = self.net
        eng = self.engine
        tr = self.traffic
        if net.reachable(v, p):
            rtt = net.delay(v, p) + net.delay(p, v)
            tr.one(v, p, PROBE_BYTES, "probes")
            tr.one(p, v, PROBE_BYTES, "probes")
            eng.at(eng.now + rtt, self._probe_done, (v, c, a.id, True, rtt))
        elif net.refuses(v, p):
            tr.one(v, p, PROBE_BYTES, "probes")
            eng.at(eng.now + net.delay(v, p) + net.delay(p, v), self._probe_done, (v, c, a.id, False, None))
        elif net.power[v] == UP:
            tr.msgs_sent[v] += 1
            tr.bytes_sent[v] += PROBE_BYTES

    def _probe_done(self, arg: tuple) -> None:
        v, c, pid, ok, rtt = arg
        if self.cores[v] is not c:
            return
        c.probe_result(self.engine.now, pid, ok, rtt)
        self._act(v, c, c.take_actions())

    def _probe_via(self, v: int, c: Membership, a: ProbeVia) -> None:
        h = self.index[a.via]
        t = self.index[a.target]
        net = self.net
        tr = self.traffic
        tr.msgs_sent[v] += 1
        tr.bytes_sent[v] += PROBE_BYTES
        if not net.reachable(v, h):
            return
        tr.received(h, 1, PROBE_BYTES, "probes")
        there = net.delay(v, h)
        if net.reachable(h, t):
            rtt = net.delay(h, t) + net.delay(t, h)
            tr.one(h, t, PROBE_BYTES, "probes")
            tr.one(t, h, PROBE_BYTES, "probes")
            ok = rtt <= a.timeout
            wait = rtt if ok else a.timeout
        elif net.refuses(h, t):
            tr.one(h, t, PROBE_BYTES, "probes")
            ok, wait = False, net.delay(h, t) + net.delay(t, h)
        else:
            tr.msgs_sent[h] += 1
            tr.bytes_sent[h] += PROBE_BYTES
            ok, wait = False, a.timeout
        tr.one(h, v, PROBE_BYTES, "probes")
        eng = self.engine
        eng.at(eng.now + there + wait + net.delay(h, v), self._via_done, (v, c, a.id, a.via, ok))

    def _via_done(self, arg: tuple) -> None:
        v, c, pid, via, ok = arg
        if self.cores[v] is not c:
            return
        c.via_result(self.engine.now, pid, via, ok)
        self._act(v, c, c.take_actions())

    # --- gossip ---------------------------------------------------------------------------

    def _spread(self, v: int, msg: object, size: int, deliver: Callable, key: int) -> None:
        self._published += 1
        eng = self.engine
        arrivals = gossipsub.spread(self.mesh, v, eng.now, self.gen)
        reached = np.flatnonzero(arrivals < INF)
        reached = reached[reached != v]
        deg = self.mesh.deg
        tr = self.traffic
        tr.msgs_sent[v] += deg[v]
        tr.bytes_sent[v] += size * float(deg[v])
        if not reached.size:
            return
        copies = np.maximum(deg[reached] - 1, 0)  # to its mesh peers but the one it came from
        tr.msgs_sent[reached] += copies
        tr.bytes_sent[reached] += size * copies
        # a node gets a copy from each mesh peer but those it gave their first copy to (and the
        # publisher none): on average one fewer, but none fewer where the publisher reached
        # every node itself (a small swarm's full mesh: every receiver gets deg copies)
        fewer = max(reached.size - int(deg[v]), 0) / reached.size
        got = np.maximum(deg[reached] - fewer, 1.0)
        tr.received(reached, 1, size, "gossip")
        tr.received(reached, got - 1, size * (got - 1), "duplicates")
        ticks = np.ceil(arrivals[reached] / QUANTUM - 1e-6)
        order = np.argsort(ticks, kind="stable")
        ticks = ticks[order]
        nodes = reached[order].tolist()
        cuts = np.flatnonzero(np.diff(ticks)) + 1
        ends = cuts.tolist() + [len(nodes)]
        times = (ticks[np.r_[0, cuts]] * QUANTUM).tolist()
        job = [msg, v, nodes, ends, times, 0, key]
        eng.at(times[0], deliver, job)

    def _next_group(self, job: list, deliver: Callable) -> None:
        gi = job[5] + 1
        if gi < len(job[3]):
            job[5] = gi
            self.engine.at(job[4][gi], deliver, job)

    def _deliver_record(self, job: list) -> None:
        r, src, nodes, ends, _, gi, k = job
        now = self.engine.now
        cores = self.cores
        rows = self._rows
        watch = self.on_received if r.watch else None
        act = self._act
        receive, take = Membership.receive_record, Membership.take_actions  # no bound method per call
        for v in nodes[ends[gi - 1] if gi else 0:ends[gi]]:
            c = cores[v]
            if c is None:
                continue
            res = receive(c, now, r)
            if res == "updated" or res == "new":
                rows[v][src] = k
                if watch is not None:
                    watch(now, v, src, r.seq)
                actions = take(c)
                if actions:
                    act(v, c, actions)
            elif res != "duplicate" and res != "old":
                act(v, c, take(c))
        self._next_group(job, self._deliver_record)

    def _deliver_rumor(self, job: list) -> None:
        m, _, nodes, ends, _, gi, _ = job
        now = self.engine.now
        cores = self.cores
        act = self._act
        for v in nodes[ends[gi - 1] if gi else 0:ends[gi]]:
            c = cores[v]
            if c is None or c.screen(m) is not None:
                continue
            res = c.receive_rumor(now, m)
            actions = c.take_actions()
            if actions:
                act(v, c, actions)
            elif res == "confirmed":  # only this suspicion's deadline moved (earlier): no need to ask for all
                s = c.suspicion(m.about)
                if s is not None:
                    self._arm_at(v, s.deadline)
        self._next_group(job, self._deliver_rumor)

    def _heartbeat(self, _: object) -> None:
        """Mesh upkeep (graft nodes below D_LOW) and the IHAVE traffic of this heartbeat."""
        mesh = self.mesh
        if mesh.short:
            running = self.running_nodes()
            for v in list(mesh.short):
                if self.cores[v] is not None:
                    mesh.graft(v, running)
                else:
                    del mesh.short[v]
        self._recent.append(self._published)
        self._published = 0
        ids = sum(self._recent)
        if ids:
            up = self.net.up
            # to D_LAZY peers outside its mesh (none in a swarm its mesh covers), as gossipsub does
            peers = np.clip(int(np.count_nonzero(up)) - 1 - self.mesh.deg[up], 0, D_LAZY)
            size = peers * (CONTROL_BYTES + MSG_ID_BYTES * ids)
            tr = self.traffic
            tr.msgs_sent[up] += peers
            tr.bytes_sent[up] += size
            tr.received(up, peers, size, "ihave")
        self.engine.at(self.engine.now + HEARTBEAT, self._heartbeat)

    # --- sync -----------------------------------------------------------------------------

    def _sync_start(self, v: int, c: Membership, p: int) -> None:
        net = self.net
        if not net.reachable(v, p):
            return
        eng = self.engine
        self.traffic.one(v, p, HELLO_BYTES, "syncs")
        eng.at(eng.now + net.delay(v, p), self._sync_respond, (v, c, p))

    def _sync_respond(self, arg: tuple) -> None:
        """The responder's digest: ``[peer, seq]`` of every record it holds, and its claims."""
        v, c, p = arg
        cp = self.cores[p]
        if cp is None or not self.net.reachable(p, v):
            return
        held, claims = self._held[p].copy(), cp.sync_claims()
        self.traffic.one(p, v, HELLO_BYTES, "syncs")  # its certificate, then its digest
        self.traffic.one(p, v, DIGEST_BYTES * int(np.count_nonzero(held >= 0)) + CLAIM_BYTES * len(claims)
                         + CONTROL_BYTES, "syncs")
        eng = self.engine
        eng.at(eng.now + self.net.delay(p, v), self._sync_requester, (v, c, p, cp, held, claims))

    def _sync_requester(self, arg: tuple) -> None:
        """The requester's offer: the records the digest lacks or holds older, the peers it wants."""
        v, c, p, cp, theirs, claims = arg
        if self.cores[v] is not c or self.cores[p] is not cp or not self.net.reachable(v, p):
            return
        mine, my_claims = self._held[v].copy(), c.sync_claims()
        offer = np.where(mine > theirs, mine, -1)
        want = theirs > mine
        self.traffic.one(v, p, self.record_bytes * int(np.count_nonzero(offer >= 0))
                         + DIGEST_BYTES * int(np.count_nonzero(want)) + CLAIM_BYTES * len(my_claims) + CONTROL_BYTES,
                         "syncs")
        eng = self.engine
        eng.at(eng.now + self.net.delay(v, p), self._sync_responder, (p, cp, v, c, offer, want, my_claims, claims))

    def _sync_responder(self, arg: tuple) -> None:
        """The responder sends the wanted records it holds now, then merges the offer."""
        p, cp, v, c, offer, want, my_claims, claims = arg
        if self.cores[p] is not cp:
            return
        answer = np.where(want, self._held[p], -1)
        if self.cores[v] is c and self.net.reachable(p, v):
            self.traffic.one(p, v, self.record_bytes * int(np.count_nonzero(answer >= 0)) + CONTROL_BYTES, "syncs")
            eng = self.engine
            eng.at(eng.now + self.net.delay(p, v), self._sync_answered, (v, c, p, answer, claims))
        self._merge(p, cp, v, offer, my_claims)

    def _sync_answered(self, arg: tuple) -> None:
        v, c, p, answer, claims = arg
        if self.cores[v] is c:
            self._merge(v, c, p, answer, claims)

    def _merge(self, v: int, c: Membership, by: int, theirs: np.ndarray, claims: list) -> None:
        mine = self._held[v]
        peers = np.flatnonzero((theirs != mine) & (theirs >= 0))
        recs = self._records
        ks = theirs[peers].tolist()
        peers_l = peers.tolist()
        records = [recs[p][k] for p, k in zip(peers_l, ks)]
        now = self.engine.now
        merged = c.merge_sync(now, records, claims, self.names[by])
        watch = self.on_received
        for p, k, r, res in zip(peers_l, ks, records, merged.records):
            if res == "updated" or res == "new":
                mine[p] = k
                if r.watch and watch is not None:
                    watch(now, v, p, r.seq)
        self._act(v, c, c.take_actions())


class Small:
    """A handful of named nodes for the core's tests (it replaced tests/cluster.py): uniform
    one-way ``latency``, ``loss`` per link (TCP: a lost attempt costs a retransmission, never
    the message), ``kill`` = the daemon dies (connections reset, then refused), ``crash`` = silence,
    ``start`` = a (re)start that bootstraps by sync."""

    def __init__(self, names: Sequence[str], *, timing: Timing | None = None, latency: float = 0.02,
                 loss: float = 0.0, seed: int = 1, jitter_ms: float = 0.0) -> None:
        self.names = list(names)
        self.changes: list[tuple[float, str, Changed]] = []
        self.swarm = Swarm(Latency.uniform(len(names), 2000 * latency), timing=timing or Timing.wan(), loss=loss,
                           jitter_ms=jitter_ms, seed=seed, names=names, on_changed=self._changed)

    def _changed(self, t: float, observer: int, peer: int, old: State | None, new: State | None, reason: str) -> None:
        self.changes.append((t, self.names[observer], Changed(self.names[peer], old, new, reason)))

    def _i(self, name: str) -> int:
        return self.swarm.index[name]

    @property
    def now(self) -> float:
        return self.swarm.now

    @property
    def nodes(self) -> dict[str, Membership]:
        """The running cores by name (tests read them; the simulator never does)."""
        return {n: c for n, c in zip(self.names, self.swarm.cores) if c is not None}

    @property
    def down(self) -> list[str]:
        return [n for n, c in zip(self.names, self.swarm.cores) if c is None]

    def kill(self, name: str) -> None:
        self.swarm.kill(self._i(name))

    def crash(self, name: str) -> None:
        self.swarm.crash(self._i(name))

    def start(self, name: str) -> None:
        self.swarm.revive(self._i(name))

    def leave(self, name: str) -> None:
        self.swarm.leave(self._i(name))

    def deliver(self, to: str, msg: object) -> str | None:
        return self.swarm.deliver(self._i(to), msg)

    def partition(self, side: Iterable[str]) -> None:
        a = [self._i(x) for x in side]
        self.swarm.partition(a, [i for i in range(len(self.names)) if i not in a])

    def heal(self) -> None:
        self.swarm.heal()

    def reachable(self, a: str, b: str) -> bool:
        return self.swarm.reachable(self._i(a), self._i(b))

    def state(self, observer: str, peer: str) -> State | None:
        return self.swarm.state(self._i(observer), self._i(peer))

    def run_until(self, t: float) -> None:
        self.swarm.run_until(t)

    def run_for(self, seconds: float) -> None:
        self.swarm.run_for(seconds)

    def wait_for(self, predicate: Callable[[], bool], limit: float, step: float = 0.01) -> float:
        """Simulated seconds until ``predicate`` holds; fails after ``limit``."""
        start = self.now
        while not predicate():
            if self.now - start > limit:
                raise AssertionError(f"not within {limit} simulated s")
            self.run_for(step)
        return self.now - start


def twin_received_by_kind(hosts: int, rtt_ms: float, loss: float, warm_s: float, seconds: float) -> dict[str, float]:
    """A lab's simulated twin (``hosts`` daemons, every pair ``rtt_ms`` apart, ``loss`` on every link,
    the daemon's timing): the bytes a node receives per second by kind (KINDS), over ``seconds``
    after ``warm_s``, as the daemon's ``status`` counts them (``gossip.received_by_kind``)."""
    s = Swarm(Latency.uniform(hosts, rtt_ms), timing=Timing.wan(), loss=loss, seed=1)
    s.run_for(warm_s)
    before = {kind: got.copy() for kind, got in s.traffic.recv_by_kind.items()}
    s.run_for(seconds)
    return {kind: float((s.traffic.recv_by_kind[kind] - before[kind]).mean() / seconds) for kind in before}
