"""Vivaldi coordinates at scale: unmodified ``swarmd.vivaldi.coordinates.Client`` cores, one per
node, fed by the probes membership takes, on the measured country matrix.

Model:
- ``nodes`` nodes placed in countries weighted by the RTT data's sample counts, among the
  countries between all of which the data has RTTs, as ``swarm-sim``'s scenarios with
  ``countries = "weighted"`` place them (sim/scenario.place).
- RTT of a probe from i to j: the country matrix (sim/network.Latency: two nodes in one
  country get the data's diagonal, the median provider pair there) + each end's access
  delay + jitter, ``U(0, jitter)`` on each of the two one-way legs (sim/network's jitter).
  Access delay: per node, drawn once, exponential with mean ``access_ms`` (0 by default:
  the data's RTTs are between real probes, so their access links are already in them).
- The truth a coordinate is judged against is the RTT's expected value: matrix + both
  access delays + ``jitter_ms`` (the mean of the two legs' jitter).
- Each node probes one peer every ``probe_interval`` (membership's, ``Timing.wan()``), at its
  own phase, the next one in its own shuffled round-robin (membership's probe order), and
  updates its coordinate with the RTT and the peer's *current* coordinate (serf's way: the
  ack carries it). With ``publish_every``, peers see instead the coordinate a node last put
  in its signed record, republished as membership refreshes: a cold start's first refresh one
  refresh interval after the first record, the step doubling up to ``record_refresh`` (250 s
  at 1,000 members; ``first_publish``), and a node's estimates use those too. No loss, no
  churn: this is the coordinates' accuracy, not membership's.
- Error: over ``pairs`` random distinct pairs (fixed for the run), the relative error
  ``|estimate - truth| / truth`` of i's estimate of j (i's coordinate to what i knows of
  j's, ``Coordinate.distance_to``), its median,
  p90 and mean at each checkpoint. The Vivaldi paper reports a median of 11 % on its
  King data; our target is below 10 % within 120 simulated seconds.

``python -m sim.coords [--nodes N] [--seconds S] ...`` prints a table and the JSON;
``bench/routing.py`` calls ``run``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from swarmd.gossip.membership import Timing, refresh_period
from swarmd.vivaldi.coordinates import DEFAULT, Client, Config, Coordinate

from . import scenario
from .network import Latency

TARGET_MEDIAN = 0.10  # issue 16: better than the Vivaldi paper's 11 %


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    nodes: int = 1000
    seconds: float = 120.0
    probe_interval: float = Timing.wan().probe_interval  # membership's: one probe per node per interval
    jitter_ms: float = 2.0  # per one-way leg, as the shipped scenarios' network
    access_ms: float = 0.0  # mean per-node access delay, exponential; 0 = none (see the header)
    pairs: int = 20_000
    checkpoints: tuple[float, ...] = (10.0, 30.0, 60.0, 120.0)
    seed: int = 1
    # None: a probe sees the peer's current coordinate (serf's way: the ack carries it). A
    # number: peers see the coordinate of the peer's last signed record, republished every that
    # many seconds (x0.75-1.25, as membership spreads its timers); see ``record_refresh``.
    publish_every: float | None = None
    # With publish_every: a record older than this is not used for an update; the peer's current
    # coordinate is, as swarmd/routing/exchange.py asks the peer for it after the probe (FRESH).
    # Estimates still use the records' coordinates, as the routing service's do.
    fresh_after: float | None = None
    # With publish_every: when a node's first refresh comes. A cold start, as the daemon's: each
    # node's first record (its coordinate at the origin) at 0, and its first refresh one
    # ``refresh_interval`` later (x0.75-1.25), because a node that just started counts only itself
    # in its swarm (membership's ``refresh_period``); then every ``publish_every``. None: the
    # first refresh anywhere in the first period, as in a swarm that has run a while.
    first_publish: float | None = Timing.wan().refresh_interval
    config: Config = field(default=DEFAULT)


def record_refresh(nodes: int, timing: Timing = Timing.wan()) -> float:
    """How often membership republishes a node's record in a swarm of ``nodes`` (``refresh_period``:
    30 s up to 120 members, then ``nodes / refresh_rate``: 250 s at 1,000)."""
    return refresh_period(timing, nodes)


def place(nodes: int, seed: int) -> list[str]:
    """Each node's country: weighted by the data's samples, as a ``countries = "weighted"``
    scenario places them (with the runner's seeding)."""
    weights = scenario.country_weights()
    codes = scenario.by_weight()[:scenario.complete_top()]
    return random.Random(f"{seed}:place").choices(codes, weights=[weights[c] for c in codes], k=nodes)


def run(setup: Setup = Setup(), *, keep: dict | None = None) -> dict:
    """Simulate and return the figures: per checkpoint the median/p90/mean relative error, plus
    the setup, the wall time and the cores' counters. ``keep`` (a dict) receives the end's
    coordinates: ``current`` (each node's own) and ``known`` (what peers see of it: the last
    published with ``publish_every``, else the current; sim/detours.py ranks relays with them)."""
    wall0 = time.perf_counter()
    n = setup.nodes
    if n < 2:
        raise ValueError("at least 2 nodes")
    placed = place(n, setup.seed)
    lat = Latency.countries(placed)
    rng = random.Random(f"{setup.seed}:coords")
    access = [rng.expovariate(1.0 / setup.access_ms) / 1000.0 if setup.access_ms > 0 else 0.0 for _ in range(n)]
    rtt_rows = (2.0 * lat.owd).tolist()  # [site][site] seconds
    sites = lat.sites
    jitter = setup.jitter_ms / 1000.0

    clients = [Client(setup.config, seed=f"{setup.seed}:{i}") for i in range(n)]
    names = [f"n{i}" for i in range(n)]
    phase = [rng.uniform(0.0, setup.probe_interval) for _ in range(n)]
    by_phase = sorted(range(n), key=phase.__getitem__)
    every = setup.publish_every
    published = [c.coordinate for c in clients]  # what peers see of each node
    published_at = [0.0] * n
    first = setup.first_publish
    published_n = [1] * n  # records each node issued: its first at 0
    next_publish = [(first * rng.uniform(0.75, 1.25) if first is not None else rng.uniform(0.0, every))
                    if every else 0.0 for _ in range(n)]
    fresh_after = setup.fresh_after if every and setup.fresh_after is not None else None
    orders: list[list[int]] = [[] for _ in range(n)]

    def next_target(i: int) -> int:
        order = orders[i]
        if not order:
            order.extend(j for j in range(n) if j != i)
            rng.shuffle(order)
        return order.pop()

    # The pairs judged: fixed for the run, i != j.
    a = np.fromiter((rng.randrange(n) for _ in range(setup.pairs)), dtype=np.int64, count=setup.pairs)
    b = np.fromiter((rng.randrange(n - 1) for _ in range(setup.pairs)), dtype=np.int64, count=setup.pairs)
    b = b + (b >= a)
    site = np.asarray(sites)
    acc = np.asarray(access)
    truth = 2.0 * lat.owd[site[a], site[b]] + acc[a] + acc[b] + jitter

    checkpoints = sorted({c for c in setup.checkpoints if c < setup.seconds} | {setup.seconds})
    out = []
    rounds = 0
    for stop in checkpoints:
        while (rounds + 1) * setup.probe_interval <= stop + 1e-9:
            now = rounds * setup.probe_interval
            for i in by_phase:
                if every and next_publish[i] <= now:
                    published[i], published_at[i] = clients[i].coordinate, now
                    step = every if first is None else min(every, first * 2 ** published_n[i])
                    published_n[i] += 1
                    next_publish[i] += step * rng.uniform(0.75, 1.25)
                j = next_target(i)
                rtt = rtt_rows[sites[i]][sites[j]] + access[i] + access[j] + jitter * (rng.random() + rng.random())
                fresh = not every or (fresh_after is not None and now - published_at[j] > fresh_after)
                clients[i].update(names[j], clients[j].coordinate if fresh else published[j], rtt)
            rounds += 1
        t = rounds * setup.probe_interval
        now_coords = [c.coordinate for c in clients]
        err = _errors(now_coords, published if every else None, a, b, truth)
        row = {"t_s": t, "median": float(np.median(err)), "p90": float(np.quantile(err, 0.9)),
               "mean": float(err.mean())}
        if every:  # the embedding itself, judged as if every node's current coordinate were known
            current = _errors(now_coords, None, a, b, truth)
            row |= {"current_median": float(np.median(current)), "current_p90": float(np.quantile(current, 0.9))}
        out.append(row)
    if keep is not None:
        keep["current"] = [c.coordinate for c in clients]
        keep["known"] = list(published) if every else keep["current"]
    return {"setup": {k: v for k, v in asdict(setup).items() if k != "config"} | {"countries": len(set(placed))},
            "checkpoints": out, "updates": sum(c.updates for c in clients),
            "rejected": sum(c.rejected for c in clients), "resets": sum(c.resets for c in clients),
            "target_median": TARGET_MEDIAN, "wall_s": time.perf_counter() - wall0}


def _errors(mine: list[Coordinate], theirs: list[Coordinate] | None, a: np.ndarray, b: np.ndarray,
            truth: np.ndarray) -> np.ndarray:
    """Relative errors of a[k]'s estimate of b[k] for every pair k: ``Coordinate.distance_to``
    vectorized (a check in tests/test_sim_coords.py), from a[k]'s own current coordinate to
    what it knows of b[k]'s (``theirs``: the published ones; None: the current ones)."""
    def arrays(coords: list[Coordinate]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.array([c.vec for c in coords]), np.array([c.height for c in coords]),
                np.array([c.adjustment for c in coords]))
    vec_a, height_a, adj_a = arrays(mine)
    vec_b, height_b, adj_b = arrays(mine if theirs is None else theirs)
    dist = np.sqrt(((vec_a[a] - vec_b[b]) ** 2).sum(axis=1)) + height_a[a] + height_b[b]
    adjusted = dist + adj_a[a] + adj_b[b]
    est = np.where(adjusted > 0.0, adjusted, dist)
    return np.abs(est - truth) / truth


def table(figures: dict) -> str:
    s = figures["setup"]
    lines = [f"Vivaldi on the country matrix: {s['nodes']} nodes in {s['countries']} countries, a probe every "
             f"{s['probe_interval']:g} s, jitter {s['jitter_ms']:g} ms/leg, access {s['access_ms']:g} ms, "
             f"{s['pairs']} pairs, peers' coordinates "
             + ("current" if not s["publish_every"] else f"republished every {s['publish_every']:g} s")
             + (f", current when the record is over {s['fresh_after']:g} s old" if s["fresh_after"] is not None
                and s["publish_every"] else ""),
             f"{'t (s)':>6} {'median':>8} {'p90':>8} {'mean':>8}"
             + (f" {'median (current coordinates)':>29} {'p90':>6}" if s["publish_every"] else "")]
    for c in figures["checkpoints"]:
        lines.append(f"{c['t_s']:>6g} {c['median']:>8.1%} {c['p90']:>8.1%} {c['mean']:>8.1%}"
                     + (f" {c['current_median']:>29.1%} {c['current_p90']:>6.1%}" if "current_median" in c else ""))
    lines.append(f"target: median < {figures['target_median']:.0%}; {figures['updates']} updates, "
                 f"{figures['resets']} resets, wall {figures['wall_s']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sim.coords", description=__doc__.split("\n\n")[0])
    d = Setup()
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--seconds", type=float, default=d.seconds)
    p.add_argument("--probe-interval", type=float, default=d.probe_interval)
    p.add_argument("--jitter-ms", type=float, default=d.jitter_ms)
    p.add_argument("--access-ms", type=float, default=d.access_ms)
    p.add_argument("--pairs", type=int, default=d.pairs)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--publish-every", type=float, default=None,
                   help="peers see a coordinate republished every S s (0: membership's record refresh at this "
                        "size); default: the peer's current one")
    p.add_argument("--warm", action="store_true",
                   help="with --publish-every: first refreshes spread over the first period (a swarm that has run "
                        "a while), not one refresh interval after a cold start")
    p.add_argument("--fresh-after", type=float, default=None,
                   help="with --publish-every: an update uses the peer's current coordinate when its record's "
                        "is older than S s (routing/exchange.py's FRESH)")
    args = p.parse_args(argv)
    every = record_refresh(args.nodes) if args.publish_every == 0 else args.publish_every
    figures = run(Setup(nodes=args.nodes, seconds=args.seconds, probe_interval=args.probe_interval,
                        jitter_ms=args.jitter_ms, access_ms=args.access_ms, pairs=args.pairs, seed=args.seed,
                        publish_every=every, fresh_after=args.fresh_after,
                        first_publish=None if args.warm else d.first_publish))
    print(table(figures))
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
