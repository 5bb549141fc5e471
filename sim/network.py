"""The simulated network: where nodes are, how long a message takes, what cannot arrive.

Model (what the daemon runs on: libp2p streams over TCP between providers on the internet):
- Each node sits at a *site*: a country (RTTs measured between countries, RIPE Atlas, in
  ``sim/data/country_rtt_stat.csv.gz``, read by ``sim/netlab/topology.country_table`` as
  the lab reads it), a row of a latency CSV, or one site for a uniform RTT. One-way delay =
  RTT(site a, site b) / 2. Two nodes in one country: the data's diagonal (the median
  provider pair there) when present, else ``SAME_SITE_MS``.
- Jitter: each message's one-way delay gets ``U(0, jitter)`` more.
- Loss is per link and per attempt, but TCP does not lose a message: a lost attempt costs
  a retransmission timeout, ``max(200 ms, RTT + 4 jitter)`` (RFC 6298's floor as Linux
  sets it), doubling with each further loss (geometric number of attempts).
- A crashed node neither sends nor answers: silence, no RST (``lab crash``). A node that
  left or stopped refuses connections (its host is up, its port closed).
- Partitions: a cut between two sets of nodes; nothing crosses it (a probe over it times
  out). Several cuts may hold at once.
- A congested node (Lifeguard's slow node): its outgoing and incoming messages each get
  ``delay`` more.

State is kept twice: Python lists for one message at a time (probes, syncs: no numpy
scalars in the hot path) and numpy arrays for the gossip model, which moves one message to
every node at once. Randomness: ``random.Random`` seeded per concern (``seed`` + "/net").
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

import numpy as np

SAME_SITE_MS = 5.0
RTO_FLOOR = 0.2  # Linux's TCP_RTO_MIN
MAX_RETRIES = 15  # tcp_retries2: beyond it the connection breaks; we stop doubling there

UP, CRASHED, STOPPED = 0, 1, 2  # a node's power state as the network sees it


class Latency:
    """Sites, each node's site, and the one-way delay (seconds) between sites."""

    def __init__(self, sites: Sequence[int], rtt_ms: Sequence[Sequence[float]], labels: Sequence[str]) -> None:
        self.n = len(sites)
        self.sites = list(sites)
        self.labels = list(labels)  # a site's name: a country code, "row 3", "all"
        owd = np.asarray(rtt_ms, dtype=np.float64) / 2000.0
        if owd.ndim != 2 or owd.shape[0] != owd.shape[1] or owd.shape[0] != len(labels):
            raise ValueError("the RTT matrix must be square, one row per site")
        if not np.all(np.isfinite(owd)) or np.any(owd < 0):
            raise ValueError("RTTs must be finite and not negative")
        self.owd = owd  # [site a, site b] one-way seconds
        self.owd_rows = owd.tolist()  # the same, for scalar lookups
        self.site_array = np.asarray(self.sites, dtype=np.int32)

    @classmethod
    def countries(cls, codes: Sequence[str], table: dict[frozenset[str], float] | None = None) -> Latency:
        """Node i in country ``codes[i]``; RTTs from the bundled data (or ``table``)."""
        if table is None:
            from sim.netlab.topology import country_table  # the lab's reader: one parser of the data
            table = country_table()
        labels = sorted(set(codes))
        index = {c: i for i, c in enumerate(labels)}
        rows = []
        for a in labels:
            row = []
            for b in labels:
                rtt = table.get(frozenset((a, b)))
                if rtt is None:
                    if a != b:
                        raise ValueError(f"no measured RTT between {a} and {b} in the country data")
                    rtt = SAME_SITE_MS
                row.append(rtt)
            rows.append(row)
        return cls([index[c] for c in codes], rows, labels)

    @classmethod
    def matrix(cls, rows: Sequence[Sequence[float]], n: int) -> Latency:
        """A square RTT matrix in ms (a latency CSV): node i on row ``i % len(rows)``. A zero
        on the diagonal (two nodes on one row) is taken as ``SAME_SITE_MS``."""
        size = len(rows)
        if size == 0 or any(len(r) != size for r in rows):
            raise ValueError(f"the RTT matrix must be square ({size} rows)")
        fixed = [[(SAME_SITE_MS if i == j and not x else float(x)) for j, x in enumerate(r)] for i, r in enumerate(rows)]
        return cls([i % size for i in range(n)], fixed, [f"row {i + 1}" for i in range(size)])

    @classmethod
    def uniform(cls, n: int, rtt_ms: float) -> Latency:
        return cls([0] * n, [[rtt_ms]], ["all"])

    def rtt(self, a: int, b: int) -> float:
        return 2 * self.owd_rows[self.sites[a]][self.sites[b]]

    def max_one_way(self) -> float:
        used = sorted(set(self.sites))
        return float(self.owd[np.ix_(used, used)].max())


class Network:
    """Who can reach whom, and how long one message takes (with loss and jitter drawn)."""

    def __init__(self, latency: Latency, *, loss: float = 0.0, jitter_ms: float = 0.0, seed: int = 0) -> None:
        if not 0 <= loss < 1:
            raise ValueError(f"loss must be 0..1, got {loss}")
        if jitter_ms < 0:
            raise ValueError(f"jitter must not be negative, got {jitter_ms}")
        n = latency.n
        self.latency = latency
        self.n = n
        self.loss = loss
        self.jitter = jitter_ms / 1000.0
        self.rng = random.Random(f"{seed}/net")
        self.power = [UP] * n  # UP, CRASHED, STOPPED
        self.up = np.ones(n, dtype=bool)  # the same: UP or not
        self.congestion = [0.0] * n
        self.congestion_array = np.zeros(n)
        self.congested = False
        self.cuts: dict[int, bytearray] = {}  # cut id -> side per node (0: neither, 1: a, 2: b)
        self._cut_ids = 0
        self._log_loss = math.log(loss) if loss > 0 else 0.0

    # --- state ---------------------------------------------------------------------------

    def set_power(self, node: int, state: int) -> None:
        self.power[node] = state
        self.up[node] = state == UP

    def congest(self, node: int, delay: float) -> None:
        self.congestion[node] = delay
        self.congestion_array[node] = delay
        self.congested = bool(self.congestion_array.any())

    def partition(self, a: Iterable[int], b: Iterable[int]) -> int:
        side = bytearray(self.n)
        for x in a:
            side[x] = 1
        for x in b:
            if side[x] == 1:
                raise ValueError(f"node {x} is on both sides of the partition")
            side[x] = 2
        self._cut_ids += 1
        self.cuts[self._cut_ids] = side
        return self._cut_ids

    def heal(self, cut: int | None = None) -> None:
        if cut is None:
            self.cuts.clear()
        else:
            self.cuts.pop(cut, None)

    def cut(self, a: int, b: int) -> bool:
        for side in self.cuts.values():
            if side[a] * side[b] == 2:
                return True
        return False

    def reachable(self, a: int, b: int) -> bool:
        """A message from a can reach b now: both powered and running, no cut between."""
        return self.power[a] == UP and self.power[b] == UP and (not self.cuts or not self.cut(a, b))

    def refuses(self, a: int, b: int) -> bool:
        """b's host is up but nothing listens (it left or stopped): a's connection is refused."""
        return self.power[b] == STOPPED and self.power[a] == UP and (not self.cuts or not self.cut(a, b))

    # --- delays --------------------------------------------------------------------------

    def delay(self, a: int, b: int) -> float:
        """One message's one-way delay from a to b, loss and jitter drawn (reachable or not)."""
        lat = self.latency
        base = lat.owd_rows[lat.sites[a]][lat.sites[b]]
        d = base
        rng = self.rng
        if self.jitter:
            d += rng.random() * self.jitter
        if self.loss and rng.random() < self.loss:
            d += self.retransmits(2 * base, rng.random())
        if self.congested:
            d += self.congestion[a] + self.congestion[b]
        return d

    def retransmits(self, rtt: float, u: float) -> float:
        """Time lost to retransmissions when the first attempt was lost; ``u`` uniform in [0, 1)
        draws how many more attempts are lost (geometric)."""
        more = int(math.log(u) / self._log_loss) if u > 0 else MAX_RETRIES
        attempts = 1 + min(more, MAX_RETRIES - 1)
        rto = max(RTO_FLOOR, rtt + 4 * self.jitter)
        return rto * ((1 << attempts) - 1)
