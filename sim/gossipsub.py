"""A model of gossipsub v1.1 as the daemon configures it (``swarmd/gossip/pubsub.py``):
when does each node first receive a message, and what does it cost each node.

Parameters (the spec: libp2p/specs pubsub/gossipsub/gossipsub-v1.0.md "Parameters" and
v1.1; ours: ``make_pubsub``):

    D = 6              mesh degree                       spec 6,  ours 6
    D_LOW = 4          graft below it at a heartbeat     spec 4,  ours 4
    D_HIGH = 12        prune above it at a heartbeat     spec 12, ours 12
    D_LAZY = 6         peers sent IHAVE per heartbeat    spec 6,  ours (py-libp2p default) 6
    HEARTBEAT = 1.0    s                                 spec 1 s, ours 1 s
    HISTORY_GOSSIP = 3 heartbeats of ids in an IHAVE     spec 3,  ours 3
    HISTORY_LENGTH = 5 heartbeats kept for IWANT (mcache) spec 5, ours 5

The model:
- The mesh is an undirected graph (grafts are symmetric): each node has D random peers,
  at most D_HIGH. A node drops a mesh peer when its membership core says that peer is dead
  or left (or the peer's connection closes: it left); TCP keeps a crashed peer's
  connection, so a crashed peer stays in its neighbours' meshes until their cores declare
  it dead, and messages sent to it are lost. Below D_LOW a node grafts new peers at its
  next heartbeat.
- A published message spreads over the mesh: a node forwards it on first receipt to its
  mesh peers (except where it came from), so the first arrival at each node is the
  shortest path from the publisher over the mesh, each hop a one-way delay of the network
  model with that message's own jitter and loss (sim/network.py). Computed for all nodes
  at once (numpy relaxation over the padded neighbour array), at publish time.
- Lazy gossip fills holes (a node cut off from the mesh by crashed peers): every node
  sends IHAVE with the ids of the last HISTORY_GOSSIP heartbeats to D_LAZY random non-mesh
  peers per heartbeat; the receiver answers IWANT and gets the message one round trip
  later. Modelled for the nodes the mesh did not reach: each hears IHAVE from
  ``HISTORY_GOSSIP * D_LAZY`` random nodes, at their heartbeats after their own receipt.
- Costs (bytes, per message): a record ``record_bytes(rtts)``: the lab's measured size with
  the RTTs to its 4 other hosts, and RTT_ENTRY_BYTES more for each further member its record
  lists (at most rtts.MAX_RTTS, 16: a large swarm's records are 14 % larger than a lab's), a
  rumor RUMOR_BYTES, IHAVE MSG_ID_BYTES per id; every node that receives a message sends
  it to its mesh peers but the one it came from, and receives on average one copy per
  mesh peer but one (the first copy and the duplicates).
"""

from __future__ import annotations

import random

import numpy as np

from .network import MAX_RETRIES, RTO_FLOOR, Latency, Network

D = 6
D_LOW = 4
D_HIGH = 12
D_LAZY = 6
HEARTBEAT = 1.0
HISTORY_GOSSIP = 3
HISTORY_LENGTH = 5

# A signed record with its certificate and the RTTs to a 5-host lab's 4 other hosts: 1,000 B
# with RTT entries of a peer id and a float (lab: 790-890 B, swarmctl status's bytes_in /
# messages_in, framing besides), 160 B less with 10-byte entries (gossip/rtts.py; make_record)
RECORD_BYTES = 840
LAB_RTTS = 4
RTT_ENTRY_BYTES = 10  # one more entry in a record's RTTs: a member's 8-byte tag and uint16 tenths of a ms
RUMOR_BYTES = 300
MSG_ID_BYTES = 20
CONTROL_BYTES = 40  # framing of one RPC (IHAVE, IWANT, GRAFT) without its ids
PROBE_BYTES = 32  # a ping or its echo: libp2p's 32 bytes, as the daemon counts them (payload, no framing)


def record_bytes(rtts: int) -> int:
    """A record's size on the wire when it lists `rtts` RTTs (a node lists its nearest members'
    up to rtts.MAX_RTTS): 840 B in a 5-host lab, 960 B from 17 members on (1,600 B when an
    entry was a peer id and a float)."""
    return RECORD_BYTES + RTT_ENTRY_BYTES * (rtts - LAB_RTTS)


QUANTUM = 0.001  # arrivals are delivered in 1 ms steps: a message's nodes in one event per step

PARAMS = {"D": D, "D_low": D_LOW, "D_high": D_HIGH, "D_lazy": D_LAZY, "heartbeat_s": HEARTBEAT,
          "history_gossip": HISTORY_GOSSIP, "history_length": HISTORY_LENGTH}

INF = float("inf")


class Mesh:
    """The mesh as adjacency lists, mirrored into a padded numpy neighbour array (the pad
    is node ``n``, which never has the message)."""

    def __init__(self, net: Network, rng: random.Random) -> None:
        n = net.n
        self.net = net
        self.n = n
        self.rng = rng
        self.peers: list[list[int]] = [[] for _ in range(n)]
        self.nbr = np.full((n, D_HIGH), n, dtype=np.int32)
        self.base = np.full((n, D_HIGH), INF)  # one-way delay of each mesh link, no jitter or loss
        self.deg = np.zeros(n, dtype=np.int32)
        self.phase = np.asarray([rng.random() for _ in range(n)]) * HEARTBEAT  # each node's heartbeat offset
        self.dirty: dict[int, None] = {}  # rows to copy into the arrays (a dict: ordered, no hash order)
        self.short: dict[int, None] = {}  # nodes below D_LOW, to graft at the next heartbeat

    def form(self, nodes: list[int]) -> None:
        """The initial mesh among ``nodes``: each grafts D random peers (at most D_HIGH each)."""
        for v in nodes:
            self.graft(v, nodes)
        self.flush()

    def graft(self, v: int, candidates: list[int]) -> None:
        """Bring v up to D peers from ``candidates`` (running nodes), peers below D_HIGH."""
        peers = self.peers
        mine = peers[v]
        need = D - len(mine)
        tries = 0
        rng = self.rng
        while need > 0 and tries < 4 * D and len(candidates) > 1:
            tries += 1
            u = candidates[rng.randrange(len(candidates))]
            if u == v or u in mine or len(peers[u]) >= D_HIGH:
                continue
            mine.append(u)
            peers[u].append(v)
            self.dirty[u] = None
            need -= 1
        self.dirty[v] = None
        self.short.pop(v, None)

    def prune(self, v: int, u: int) -> None:
        """v drops u (and u drops v: a PRUNE is mutual)."""
        pv, pu = self.peers[v], self.peers[u]
        if u in pv:
            pv.remove(u)
            self.dirty[v] = None
            if len(pv) < D_LOW:
                self.short[v] = None
        if v in pu:
            pu.remove(v)
            self.dirty[u] = None
            if len(pu) < D_LOW:
                self.short[u] = None

    def drop(self, v: int) -> None:
        """v leaves every mesh (it left: its connections closed)."""
        for u in list(self.peers[v]):
            self.prune(v, u)
        self.short.pop(v, None)

    def flush(self) -> None:
        if not self.dirty:
            return
        lat = self.net.latency
        owd, sites = lat.owd_rows, lat.sites
        nbr, base, deg, n = self.nbr, self.base, self.deg, self.n
        for v in self.dirty:
            peers = self.peers[v]
            k = len(peers)
            row = owd[sites[v]]
            nbr[v, :k] = peers
            nbr[v, k:] = n
            base[v, :k] = [row[sites[u]] for u in peers]
            base[v, k:] = INF
            deg[v] = k
        self.dirty.clear()


def spread(mesh: Mesh, source: int, t0: float, gen: np.random.Generator, *,
           up: np.ndarray | None = None) -> np.ndarray:
    """First-arrival time at every node of a message ``source`` publishes at ``t0``
    (inf: never). ``up``: which nodes receive and forward (default: the network's)."""
    net = mesh.net
    mesh.flush()
    n = mesh.n
    if up is None:
        up = net.up
    nbr = mesh.nbr
    d = _link_delays(mesh, gen)
    a = np.full(n + 1, INF)
    a[source] = t0
    # relax from the frontier: only rows with a neighbour that improved can improve
    _relax(nbr, d, a, np.array([source]), up, n)
    missing = np.flatnonzero(up & ~np.isfinite(a[:n]))
    if missing.size:  # the publisher gossips too, even with no mesh peer yet
        _lazy(mesh, a, missing, d, gen)
    return a[:n]


def _relax(nbr: np.ndarray, d: np.ndarray, a: np.ndarray, frontier: np.ndarray, up: np.ndarray, n: int) -> None:
    """Shortest paths over the mesh from the nodes in ``frontier`` (their times set in ``a``):
    only rows with a neighbour that improved can improve. A node that is not up neither
    receives nor forwards."""
    mark = np.zeros(n + 1, dtype=bool)
    while frontier.size:
        mark[nbr[frontier].ravel()] = True
        mark[n] = False
        rows = np.flatnonzero(mark)
        mark[rows] = False
        cand = (a[nbr[rows]] + d[rows]).min(axis=1)
        keep = (cand < a[rows]) & up[rows]
        if not keep.any():
            break
        rows = rows[keep]
        a[rows] = cand[keep]
        frontier = rows


def _link_delays(mesh: Mesh, gen: np.random.Generator) -> np.ndarray:
    """This message's delay over each mesh link (row v, column j: from nbr[v, j] to v)."""
    net = mesh.net
    d = mesh.base.copy()
    nbr = mesh.nbr
    if net.jitter:
        d += gen.random(d.shape) * net.jitter
    if net.loss:
        u = gen.random(d.shape)
        lost = np.flatnonzero(u.ravel() < net.loss)
        if lost.size:
            flat = d.ravel()
            base = mesh.base.ravel()[lost]
            more = np.floor(np.log(gen.random(lost.size) + 1e-300) / np.log(net.loss))
            attempts = 1 + np.minimum(more, MAX_RETRIES - 1)
            rto = np.maximum(RTO_FLOOR, 2 * base + 4 * net.jitter)
            flat[lost] += rto * (np.exp2(attempts) - 1)  # as Network.retransmits
    if net.congested:
        c = np.append(net.congestion_array, 0.0)
        d += c[:-1, None] + c[nbr]
    if net.cuts:
        for side in net.cuts.values():
            s = np.frombuffer(bytes(side) + b"\0", dtype=np.uint8).astype(np.int8)
            d[(s[:-1, None] * s[nbr]) == 2] = INF
    return d


def _lazy(mesh: Mesh, a: np.ndarray, missing: np.ndarray, d: np.ndarray, gen: np.random.Generator) -> None:
    """IHAVE/IWANT for the nodes the mesh did not reach, then the mesh again from them."""
    net = mesh.net
    n = mesh.n
    lat = net.latency
    sites = lat.site_array
    for _ in range(2):  # gossip, spread, gossip again for what is still missing
        if not missing.size:
            return
        k = HISTORY_GOSSIP * D_LAZY
        senders = gen.integers(0, n, size=(missing.size, k))
        rounds = gen.integers(0, HISTORY_GOSSIP, size=(missing.size, k))
        have = a[senders]
        phase = mesh.phase[senders]
        beat = phase + np.ceil((have - phase) / HEARTBEAT) * HEARTBEAT + rounds * HEARTBEAT
        owd = lat.owd[sites[senders], sites[missing][:, None]]
        cand = beat + 3 * owd  # IHAVE there, IWANT back, the message there
        ok = np.isfinite(have) & net.up[senders]
        if net.cuts:
            for side in net.cuts.values():
                s = np.frombuffer(bytes(side), dtype=np.uint8).astype(np.int8)
                ok &= (s[senders] * s[missing][:, None]) != 2
        cand[~ok] = INF
        best = cand.min(axis=1)
        got = np.isfinite(best)
        if not got.any():
            return
        a[missing[got]] = best[got]
        # the mesh from the newly reached nodes
        _relax(mesh.nbr, d, a, missing[got], net.up, n)
        missing = np.flatnonzero(net.up & ~np.isfinite(a[:n]))


def disseminate(latency: Latency, *, source: int = 0, loss: float = 0.0, jitter_ms: float = 0.0,
                seed: int = 1) -> np.ndarray:
    """First-arrival times (s) at every node of one record published by ``source`` at t=0
    over a freshly formed mesh: the dissemination-only figure, no membership cores."""
    net = Network(latency, loss=loss, jitter_ms=jitter_ms, seed=seed)
    mesh = Mesh(net, random.Random(f"{seed}/mesh"))
    mesh.form(list(range(latency.n)))
    gen = np.random.default_rng([seed, 7])
    return spread(mesh, source, 0.0, gen)
