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
  the daemon's caps, with every member a path target), and ``the switch rule, legs from
  records and asked for``: the chooser A also asks B for its legs to ``ASK_LEGS`` more relays
  (swarmd/routing/paths.py), those not in B's record that rank best by A's own leg (its
  measured RTT where it has one, else the coordinate estimate) + the coordinate estimate
  R-B; B answers for those it has measured, and A measures its own leg to an answered relay
  it has not measured only when the shortlist would ask for it (``estimate(A, R) + leg(R, B)
  <= 0.9 x direct``, paths.py's ``_measure``). ``ask_seconds``: the chooser asks
  ``ASK_PER_ROUND`` peers per evaluation (one a second), so after t seconds a chooser pair was
  asked with probability ``min(1, t x ASK_PER_ROUND / the chooser's pairs)``; None: every pair
  asked (the steady state). Coordinates:
  sim/coords.py run as the daemon runs it (records plus the 10 s exchange) for
  ``coord_seconds`` (A's own, the records' for the others, as ``PathView.estimate``).
  ``measured``: the share of other members each node has an RTT to (1.0: every one, the
  steady state; membership's probes reach one member per 0.5 s, round robin, so about
  ``t / 0.5 / (nodes - 1)`` after t seconds, ``measured_after``: 0.24 at 120 s on 1,000
  nodes), drawn at random per pair. Beside them, the share of *pairs of countries* (each once, unweighted, as the
  issue's figure counts) with a faster relay.
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

from swarmd.gossip.membership import Timing
from swarmd.gossip.rtts import MAX_RTTS
from swarmd.routing.paths import ASK_LEGS, ASK_PER_ROUND, MAX_RELAYED, SWITCH_MIN_GAIN_MS, SWITCH_RATIO, best_relay

from . import coords
from .coords import place
from .network import Latency

ROWS = ("any faster relay", "the switch rule", "the switch rule, legs from records",
        f"the switch rule, at most {MAX_RELAYED} relayed paths", "the switch rule, legs from records and asked for")
EXCHANGE_FRESH = 10.0  # swarmd/routing/exchange.py FRESH (not imported: it brings trio and libp2p)


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


def measured_after(seconds: float, nodes: int) -> float:
    """The share of other members a node has an RTT to after ``seconds``: membership probes one
    per ``probe_interval``, each member once per round (its shuffled round robin)."""
    return min(1.0, seconds / Timing.wan().probe_interval / max(1, nodes - 1))


def _estimates(mine: list, known: list) -> np.ndarray:
    """est[i, j] in ms: ``mine[i].distance_to(known[j])`` for every i, j (vectorized; a check in
    tests/test_sim_detours.py)."""
    def arrays(cs: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.array([c.vec for c in cs]), np.array([c.height for c in cs]), np.array([c.adjustment for c in cs]))
    va, ha, aa = arrays(mine)
    vb, hb, ab = arrays(known)
    sq = (va ** 2).sum(1)[:, None] + (vb ** 2).sum(1)[None, :] - 2.0 * va @ vb.T
    dist = np.sqrt(np.maximum(sq, 0.0)) + ha[:, None] + hb[None, :]
    adjusted = dist + aa[:, None] + ab[None, :]
    return np.where(adjusted > 0.0, adjusted, dist) * 1000.0


def _asked_gains(rtt: np.ndarray, site: np.ndarray, near: list[set[int]], order: np.ndarray, est_mine: np.ndarray,
                 est_known: np.ndarray, measured: np.ndarray, *, ask: int, ratio: float,
                 min_gain_ms: float, ask_seconds: float | None = None, seed: int = 0) -> np.ndarray:
    """gain[a, b] in ms for each chooser a of a pair (a, b) (0 elsewhere) when the R-B leg is
    known for R in B's record (``near``) and, if the pair was asked (``ask_seconds``), for the
    ``ask`` relays outside it that rank best by A's leg (``rtt`` where ``measured[a, r]``, else
    ``est_mine``) + ``est_known[r, b]``, if B has measured R (``measured[b, r]``) and A's leg to
    R is known: measured, or asked for by the shortlist (``est_mine[a, r]`` + the leg <= ratio x
    direct)."""
    rng = np.random.default_rng([seed, 17])
    n = site.size
    k = len(near)
    near_mask = np.zeros((k, k), dtype=bool)
    for t, us in enumerate(near):
        near_mask[t, list(us)] = True
    own = np.where(measured, rtt[site[:, None], site[None, :]], est_mine)
    gain = np.zeros((n, n))
    for a in range(n):
        bs = np.flatnonzero(order[a] < order)
        if not bs.size:
            continue
        rows = np.arange(bs.size)
        total = rtt[site[a], site][None, :] + rtt[site[bs]][:, site]  # [b, R], true legs
        direct = rtt[site[a], site[bs]]
        other = np.ones(total.shape, dtype=bool)
        other[:, a] = False
        other[rows, bs] = False
        reported = near_mask[site[bs]][:, site] & other
        best = np.where(reported, total, np.inf).min(axis=1)
        if ask > 0:
            score = np.where(reported | ~other, np.inf, own[a][None, :] + est_known[:, bs].T)
            kth = min(ask, n - 1)
            top = np.argpartition(score, kth - 1, axis=1)[:, :kth]
            leg2 = rtt[site[top], site[bs][:, None]]  # B's answer: its measured RTT to R
            mine = measured[a, top] | (est_mine[a, top] + leg2 <= direct[:, None] * ratio)  # A's leg known
            asked = np.ones(bs.size, dtype=bool) if ask_seconds is None else \
                rng.random(bs.size) < min(1.0, ask_seconds * ASK_PER_ROUND / bs.size)
            usable = (np.isfinite(np.take_along_axis(score, top, 1)) & measured[bs[:, None], top] & mine
                      & asked[:, None])
            best = np.minimum(best, np.where(usable, np.take_along_axis(total, top, 1), np.inf).min(axis=1))
        win = (best <= direct * ratio) & (direct - best >= min_gain_ms)
        gain[a, bs[win]] = (direct - best)[win]
    return gain


def run(nodes: int = 1000, seed: int = 1, *, ratio: float = SWITCH_RATIO, min_gain_ms: float = SWITCH_MIN_GAIN_MS,
        near_size: int = MAX_RTTS, cap: int = MAX_RELAYED, ask: int = ASK_LEGS, measured: float = 1.0,
        coord_seconds: float = 120.0, ask_seconds: float | None = None) -> dict:
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
    kept: dict = {}
    coords.run(coords.Setup(nodes=nodes, seed=seed, seconds=coord_seconds, checkpoints=(),
                            publish_every=coords.record_refresh(nodes), fresh_after=EXCHANGE_FRESH), keep=kept)
    known = np.random.default_rng([seed, 16]).random((nodes, nodes)) < measured
    asked = _asked_gains(rtt, site, near, order, _estimates(kept["current"], kept["known"]),
                         _estimates(kept["known"], kept["known"]), known, ask=ask, ratio=ratio, min_gain_ms=min_gain_ms,
                         ask_seconds=ask_seconds, seed=seed)
    pair_gain = asked[a, b]
    rows[ROWS[4]] = _figures(pair_gain > 0, pair_gain, direct)
    present = np.flatnonzero(counts)
    cs, ct = np.triu_indices(len(present), k=1)
    by_country = {name: round(float((g[present[cs], present[ct]] > 0).mean()), 4) if cs.size else 0.0
                  for name, g in zip(ROWS[:2], gains)}
    return {"nodes": nodes, "seed": seed, "countries": int((counts > 0).sum()),
            "country_pairs_detoured": by_country,
            "thresholds": {"switch_ratio": ratio, "switch_min_gain_ms": min_gain_ms, "records_report": near_size,
                           "max_relayed": cap, "legs_asked": ask, "measured": measured, "coord_seconds": coord_seconds,
                           "ask_seconds": ask_seconds},
            "rows": rows, "wall_s": round(time.perf_counter() - wall0, 2)}


def table(result: dict) -> str:
    head = f"{'':<50} {'detoured':>9} {'gain median':>16} {'gain p90':>16}"
    lines = [f"detours on the country matrix: {result['nodes']} nodes in {result['countries']} countries, "
             f"seed {result['seed']}", head]
    for name, r in result["rows"].items():
        def g(ms, pct):
            return "-" if ms is None else f"{ms:.1f} ms {pct:.0f} %"
        lines.append(f"{name:<50} {100 * r['detoured_share']:>8.1f}% {g(r['median_gain_ms'], r['median_gain_pct']):>16}"
                     f" {g(r['p90_gain_ms'], r['p90_gain_pct']):>16}")
    lines.append("pairs of countries (each once, not weighted by nodes): "
                 + ", ".join(f"{name} {100 * v:.1f} %" for name, v in result["country_pairs_detoured"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.detours", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ask", type=int, default=ASK_LEGS, help="relays asked for per peer")
    p.add_argument("--measured", type=float, default=1.0,
                   help="share of members each node has measured (1.0: steady state; 0.24: 1,000 nodes at 120 s)")
    p.add_argument("--coord-seconds", type=float, default=120.0, help="seconds of Vivaldi before the ranking")
    p.add_argument("--ask-seconds", type=float, default=None,
                   help="seconds of asking (2 chooser pairs a second); default: every pair asked")
    args = p.parse_args(argv)
    result = run(args.nodes, args.seed, ask=args.ask, measured=args.measured, coord_seconds=args.coord_seconds,
                 ask_seconds=args.ask_seconds)
    print(table(result))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
