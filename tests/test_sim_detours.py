"""The detour figures (sim/detours.py) on a small swarm: the country-level shortcut gives what
the daemon's rule gives node by node, the rows are ordered as their rules are, the caps hold."""

import itertools
import json

import numpy as np
import pytest

from sim import coords, detours
from sim.coords import place
from sim.network import Latency
from swarmd.routing.paths import best_relay


def test_country_shortcut_matches_the_rule_node_by_node():
    placed = place(60, 3)
    lat = Latency.countries(placed)
    rtt = lat.owd * 2000.0
    site = np.asarray(lat.sites)
    gain = detours._country_gains(rtt, np.bincount(site, minlength=len(lat.labels)), lat.labels,
                                  ratio=0.9, min_gain_ms=2.0)
    n = len(placed)

    def ms(x, y):
        return lat.rtt(x, y) * 1000.0  # Latency speaks seconds

    detoured = 0
    for a, b in itertools.combinations(range(n), 2):
        legs = {str(r): (ms(a, r), ms(r, b)) for r in range(n) if r not in (a, b)}
        found = best_relay(ms(a, b), legs)
        expect = 0.0 if found is None else ms(a, b) - found[1]
        detoured += found is not None
        assert abs(gain[site[a], site[b]] - expect) < 1e-6, (placed[a], placed[b])
    assert detoured > 0


def test_small_swarm_figures():
    result = detours.run(200, 1)
    rows = list(result["rows"].values())
    assert list(result["rows"]) == list(detours.ROWS)
    share = [r["detoured_share"] for r in rows]
    assert share[0] >= share[1] >= share[2] and share[1] >= share[3]  # each rule is stricter
    assert share[1] >= share[4] > share[2]  # legs asked for: more than the records', at most every leg
    assert share[1] > 0
    for r in rows[1:]:
        if r["detoured_pairs"]:
            assert r["median_gain_pct"] >= 10.0 and r["median_gain_ms"] >= 2.0  # every detour passes the rule
    assert rows[0]["pairs"] == 200 * 199 // 2
    assert json.loads(json.dumps(result)) == result
    assert detours.run(200, 1)["rows"] == result["rows"]  # seeded
    assert "the switch rule" in detours.table(result)


def test_caps_bound_what_each_node_chooses_and_follows():
    rng = np.random.default_rng(0)
    n = 50
    gain = rng.uniform(-5, 10, (n, n))
    order = rng.permutation(n)
    used = detours._capped(gain, order, 3)
    assert (used == used.T).all()
    chooser = order[:, None] < order[None, :]
    chosen = used & chooser
    assert chosen.sum(axis=1).max() <= 3 and chosen.sum(axis=0).max() <= 3  # chosen by a node, followed by one
    assert not (used & (gain <= 0) & chooser).any()


def test_bench_figures_are_flat_numbers():
    from bench.routing import detour_figures

    figures = detour_figures(200, 1)
    assert figures["sim_detour_rule_share_pct"] > 0
    assert all(v is None or isinstance(v, (int, float)) for v in figures.values())


def test_asked_legs_row_is_the_records_row_without_asking_and_grows_with_what_is_asked_and_measured():
    # node by node (the asked row) against the country shortcut (the records row): the same without asking
    base = detours.run(200, 2, ask=0)["rows"]
    assert base[detours.ROWS[4]] == base[detours.ROWS[2]]
    share = [detours.run(200, 2, ask=k)["rows"][detours.ROWS[4]]["detoured_share"] for k in (2, 8, 32)]
    assert base[detours.ROWS[2]]["detoured_share"] <= share[0] <= share[1] <= share[2]
    unmeasured = detours.run(200, 2, measured=0.0)["rows"]
    assert unmeasured[detours.ROWS[4]] == unmeasured[detours.ROWS[2]]  # a peer answers only what it measured
    assert detours.measured_after(120.0, 1000) == pytest.approx(240 / 999) and detours.measured_after(1e4, 10) == 1.0


def test_estimates_are_coordinate_distances():
    kept: dict = {}
    coords.run(coords.Setup(nodes=30, seconds=20.0, checkpoints=(), publish_every=10.0), keep=kept)
    est = detours._estimates(kept["current"], kept["known"])
    for i in range(0, 30, 7):
        for j in range(30):
            expect = kept["current"][i].distance_to(kept["known"][j]) * 1000
            assert est[i, j] == pytest.approx(expect, rel=1e-6, abs=1e-6)
