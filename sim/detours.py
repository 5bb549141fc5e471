"""Detours on the measured country matrix: how many node pairs path choice sends through a
relay, and what it saves.

Model:
- ``nodes`` nodes placed in countries weighted by the RTT data's sample counts, as a
  ``countries = "weighted"`` scenario places them (``sim.coords.place``: the same draw and seed).
- RTTs are the matrix's (``sim.network.Latency``: two nodes in one country get the data's
  diagonal), no jitter: every node offers relaying and every leg is known at its true value,
  so the figures are what the rule can reach, not what probes' noise and the hysteresis
  leave of it.
- The rule is ``swarmd.routing.paths.best_relay`` with the daemon's thresholds (a relay at
  least 10 % and 2 ms faster than direct), on every pair of countries, with every country
  that still has a node other than the pair's two as a relay.
- Rows: ``any faster relay`` (no thresholds: the issue's 39.5 % counts this, among the 60
  best-covered countries), ``the switch rule``, ``the switch rule, legs from records``
  (the relay-peer leg must be in the *peer's* record, which reports its ``MAX_RTTS``
  nearest members: the daemon's trust rule, so a relay's own claim does not count; the
  chooser, the lower of two random ids, measures its own leg), and ``the switch rule,
  at most MAX_RELAYED`` (each node chooses its 16 biggest gains and follows at most 16,
  the daemon's caps, with every member a path target). Beside them, the share of *pairs of
  countries* (each once, unweighted, as the issue's figure counts) with a faster relay.
- Figures per row: the share of node pairs detoured, and among them the median and p90
  gain, in ms and in % of the direct RTT. Countries are computed once per pair of
  countries, then counted per node pair.

``python -m sim.detours [--nodes N] [--seed S]`` prints a table and the JSON;
``bench/routing.py`` calls ``run``.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from swarmd.gossip.wire import MAX_RTTS
from swarmd.routing.paths import MAX_RELAYED, SWITCH_MIN_GAIN_MS, SWITCH_RATIO, best_relay

from .coords import place
from .network import Latency

ROWS = ("any faster relay", "the switch rule", "the switch rule, legs from records",
        f"the switch rule, at most {MAX_RELAYED} relayed paths")


def _country_gains(rtt: np.ndarray, counts: np.ndarray, labels: list[str], *, ratio: float, min_gain_ms: float,
                   near: list[set[int]] | None = None) -> np.ndarray:
    """gain[s, t] in ms for a chooser in country s and a peer in country t (0: direct).
    ``near[t]``: the countries a peer in t reports RTTs to (None: every leg is known)."""
    k = len(labels)
    gain = np.zeros((k, k))
    rows = rtt.tolist()
    for s in range(k):
        for t in range(k):
            if counts[s] == 0 or counts[t] == 0 or (s == t and counts[s] < 2):
                continue
            legs = {}
            for u in (range(k) if near is None else near[t]):
                spare = counts[u] - (u == s) - (u == t)
                if spare > 0:
                    legs[labels[u]] = (rows[s][u], rows[u][t])
            found = best_relay(rows[s][t], legs, ratio=ratio, min_gain_ms=min_gain_ms)
            if found is not None:
                gain[s, t] = rows[s][t] - found[1]
    return gain


def _nearest(rtt: np.ndarray, counts: np.ndarray, labels: list[str], size: int) -> list[set[int]]:
    """Per country t: the countries among a node's ``size`` nearest other nodes there (its own
    country first, then by RTT; the last country reached counts even if only partly)."""
    out = []
    for t in range(len(labels)):
        got, left = set(), size
        if counts[t] > 1:
            got.add(t)
            left -= counts[t] - 1
        for u in sorted((u for u in range(len(labels)) if u != t and counts[u]), key=lambda u: (rtt[t, u], labels[u])):
            if left <= 0:
                break
            got.add(u)
            left -= counts[u]
        out.append(got)
    return out


def _figures(detoured: np.ndarray, gain: np.ndarray, direct: np.ndarray) -> dict:
    pairs = detoured.size
    g, d = gain[detoured], direct[detoured]
    pct = 100.0 * g / d if g.size else g
    q = (lambda a, p: round(float(np.percentile(a, p)), 2) if a.size else None)
    return {"detoured_pairs": int(detoured.sum()), "pairs": int(pairs),
            "detoured_share": round(float(detoured.sum()) / pairs, 4) if pairs else 0.0,
            "median_gain_ms": q(g, 50), "p90_gain_ms": q(g, 90),
            "median_gain_pct": q(pct, 50), "p90_gain_pct": q(pct, 90)}


def _capped(gain: np.ndarray, order: np.ndarray, cap: int) -> np.ndarray:
    """Node pairs (i, j) on a relay when each node chooses (it has the lower id) its ``cap``
    biggest gains and follows at most ``cap`` announcements (lowest ids first)."""
    n = gain.shape[0]
    chooser = order[:, None] < order[None, :]
    want = np.where(chooser & (gain > 0), gain, 0.0)
    chosen = np.zeros((n, n), dtype=bool)
    for i in range(n):
        row = np.flatnonzero(want[i])
        if row.size:
            top = row[np.argsort(-want[i, row], kind="stable")[:cap]]
            chosen[i, top] = True
    used = np.zeros((n, n), dtype=bool)
    for j in range(n):
        by = np.flatnonzero(chosen[:, j])
        if by.size:
            used[by[np.argsort(order[by], kind="stable")[:cap]], j] = True
    return used | used.T


def run(nodes: int = 1000, seed: int = 1, *, ratio: float = SWITCH_RATIO, min_gain_ms: float = SWITCH_MIN_GAIN_MS,
        near_size: int = MAX_RTTS, cap: int = MAX_RELAYED) -> dict:
    """The figures (one dict per row of ``ROWS``) and the setup."""
    wall0 = time.perf_counter()
    if nodes < 3:
        raise ValueError("at least 3 nodes (a pair and a relay)")
    placed = place(nodes, seed)
    lat = Latency.countries(placed)
    labels = lat.labels
    rtt = lat.owd * 2000.0
    site = np.asarray(lat.sites)
    counts = np.bincount(site, minlength=len(labels))
    near = _nearest(rtt, counts, labels, near_size)
    gains = [_country_gains(rtt, counts, labels, ratio=1.0, min_gain_ms=1e-9),
             _country_gains(rtt, counts, labels, ratio=ratio, min_gain_ms=min_gain_ms),
             _country_gains(rtt, counts, labels, ratio=ratio, min_gain_ms=min_gain_ms, near=near)]
    order = np.asarray(random.Random(f"{seed}:ids").sample(range(nodes), nodes))  # the peer ids' order
    i, j = np.triu_indices(nodes, k=1)
    a = np.where(order[i] < order[j], i, j)  # the chooser of each pair
    b = np.where(order[i] < order[j], j, i)
    direct = rtt[site[a], site[b]]
    rows = {}
    for name, g in zip(ROWS, gains):
        pair_gain = g[site[a], site[b]]
        rows[name] = _figures(pair_gain > 0, pair_gain, direct)
    full = gains[1][site[:, None], site[None, :]]  # node x node, as the chooser sees it
    used = _capped(full, order, cap)
    pair_gain = gains[1][site[a], site[b]]
    rows[ROWS[3]] = _figures(used[a, b], pair_gain, direct)
    present = np.flatnonzero(counts)
    cs, ct = np.triu_indices(len(present), k=1)
    by_country = {name: round(float((g[present[cs], present[ct]] > 0).mean()), 4) if cs.size else 0.0
                  for name, g in zip(ROWS[:2], gains)}
    return {"nodes": nodes, "seed": seed, "countries": int((counts > 0).sum()),
            "country_pairs_detoured": by_country,
            "thresholds": {"switch_ratio": ratio, "switch_min_gain_ms": min_gain_ms, "records_report": near_size,
                           "max_relayed": cap},
            "rows": rows, "wall_s": round(time.perf_counter() - wall0, 2)}


def table(result: dict) -> str:
    head = f"{'':<42} {'detoured':>9} {'gain median':>16} {'gain p90':>16}"
    lines = [f"detours on the country matrix: {result['nodes']} nodes in {result['countries']} countries, "
             f"seed {result['seed']}", head]
    for name, r in result["rows"].items():
        def g(ms, pct):
            return "-" if ms is None else f"{ms:.1f} ms {pct:.0f} %"
        lines.append(f"{name:<42} {100 * r['detoured_share']:>8.1f}% {g(r['median_gain_ms'], r['median_gain_pct']):>16}"
                     f" {g(r['p90_gain_ms'], r['p90_gain_pct']):>16}")
    lines.append("pairs of countries (each once, not weighted by nodes): "
                 + ", ".join(f"{name} {100 * v:.1f} %" for name, v in result["country_pairs_detoured"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.detours", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    result = run(args.nodes, args.seed)
    print(table(result))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
