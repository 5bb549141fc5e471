"""sim/coords: Vivaldi cores on the country matrix reach issue 16's accuracy target (1,000 nodes,
median relative error below 10 % within 120 simulated seconds: about 4 s of wall time here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.routing import EXCHANGE_FRESH
from sim import coords, runner, scenario
from swarmd.vivaldi.coordinates import Client, origin


def test_1000_nodes_on_the_country_matrix_reach_the_target_in_120_s():
    figures = coords.run(coords.Setup(nodes=1000, seconds=120.0))
    by_t = {c["t_s"]: c for c in figures["checkpoints"]}
    assert list(by_t) == [10.0, 30.0, 60.0, 120.0]
    assert by_t[120.0]["median"] < coords.TARGET_MEDIAN
    assert by_t[120.0]["p90"] < 0.30  # the tail too: 17.9 % with this seed
    medians = [c["median"] for c in figures["checkpoints"]]
    assert medians == sorted(medians, reverse=True)  # it converges: the error falls at each checkpoint
    assert figures["updates"] == 1000 * 240 and figures["rejected"] == figures["resets"] == 0
    assert figures["setup"]["countries"] > 50


def test_the_placement_is_the_weighted_scenarios():
    """The same countries a ``countries = "weighted"`` scenario with this seed gets."""
    s = scenario.parse({"name": "c", "nodes": 300, "seconds": 10, "seed": 7, "network": {"countries": "weighted"}})
    assert coords.place(300, 7) == runner.place(s)


def test_the_error_is_the_cores_own_estimate():
    clients = [Client(seed=i) for i in range(4)]
    for _ in range(30):
        for i, c in enumerate(clients):
            j = (i + 1) % 4
            c.update(str(j), clients[j].coordinate, 0.01 * (i + j + 1))
    a, b = np.array([0, 1, 2, 3, 0]), np.array([1, 2, 3, 0, 2])
    truth = np.full(5, 0.02)
    now = [c.coordinate for c in clients]
    got = coords._errors(now, None, a, b, truth)
    want = [abs(clients[i].estimate(clients[j].coordinate) - 0.02) / 0.02 for i, j in zip(a, b)]
    assert got == pytest.approx(want, rel=1e-12)
    published = [origin()] * 4  # what the others last published: a's own is current, b's published
    got = coords._errors(now, published, a, b, truth)
    assert got == pytest.approx([abs(clients[i].estimate(origin()) - 0.02) / 0.02 for i in a], rel=1e-12)


def test_stale_coordinates_from_records_converge_later():
    """Peers' coordinates as records carry them, republished every 100 s at 1,000 members
    (membership's refresh): far from the target at 120 s (19 %), there by 600 s (3.9 %, bench
    part routing)."""
    assert coords.record_refresh(1000) == 250.0 and coords.record_refresh(100) == 30.0
    fresh = coords.run(coords.Setup(nodes=200, seconds=60.0, pairs=2000))
    stale = coords.run(coords.Setup(nodes=200, seconds=60.0, pairs=2000, publish_every=30.0))
    assert stale["setup"]["publish_every"] == 30.0
    assert stale["checkpoints"][-1]["median"] > fresh["checkpoints"][-1]["median"]
    # the routing service's exchange: a record over 30 s old is replaced by the peer's current
    # coordinate for the update; the embedding gets closer to the fresh one
    exchange = coords.run(coords.Setup(nodes=200, seconds=60.0, pairs=2000, publish_every=30.0, fresh_after=10.0))
    assert exchange["checkpoints"][-1]["current_median"] < stale["checkpoints"][-1]["current_median"]


def test_a_run_is_reproducible_and_the_access_delay_is_optional():
    small = coords.Setup(nodes=60, seconds=5.0, pairs=500)
    one, two = coords.run(small), coords.run(small)
    assert one["checkpoints"] == two["checkpoints"]
    access = coords.run(coords.Setup(nodes=60, seconds=5.0, pairs=500, access_ms=5.0))
    assert access["checkpoints"] != one["checkpoints"] and access["setup"]["access_ms"] == 5.0
    with pytest.raises(ValueError, match="2 nodes"):
        coords.run(coords.Setup(nodes=1))


def test_the_command_prints_a_table_and_json(capsys):
    coords.main(["--nodes", "50", "--seconds", "20", "--pairs", "300"])
    out = capsys.readouterr().out
    table, _, data = out.partition("\n{")
    assert "50 nodes" in table and "median" in table and "target: median < 10%" in table
    figures = json.loads("{" + data)
    assert [c["t_s"] for c in figures["checkpoints"]] == [10.0, 20.0]



def test_the_daemons_policy_reaches_the_target_at_1000_nodes_within_120_s():
    """What the daemon does: peers' coordinates from their records (refreshed every 100 s at
    1,000 members), and a peer's current one when its record is over exchange.FRESH (10 s) old
    at the time of a probe (swarmd/routing/exchange.py). Nodes' estimates, from records, reach
    a median error under 10 % by 120 s (8.4-9.0 % over seeds 1-4; 12 % with FRESH = 30 s)."""
    from swarmd.routing import exchange

    assert EXCHANGE_FRESH == exchange.FRESH == 10.0
    result = coords.run(coords.Setup(nodes=1000, seconds=120.0, pairs=5000, publish_every=coords.record_refresh(1000),
                                     fresh_after=EXCHANGE_FRESH))
    assert result["checkpoints"][-1]["median"] < coords.TARGET_MEDIAN, result["checkpoints"][-1]
