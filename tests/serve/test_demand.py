"""Where a service's requests enter (swarmd/serve/demand.py): this member's entries from its
gateway's figures, the swarm's sum as a controller reads it, and what a member's inflated
figures can and cannot do."""

from dataclasses import dataclass, field

import pytest

from swarmd.gossip.registry import MAX_DEMAND, DemandEntry
from swarmd.serve.demand import POOL_PER_REPLICA, PUBLISH_S, WINDOW_S, LocalDemand, swarm_demand


def stats(**services):
    return {"services": {name: {"rate_per_s": rate, "in_flight": in_flight, "p99_ms": p99, "requests": 1}
                         for name, (rate, in_flight, p99) in services.items()}}


@dataclass(frozen=True)
class Rec:
    demand: tuple = ()


@dataclass(frozen=True)
class M:
    peer: str
    record: Rec = field(default_factory=Rec)
    in_service: bool = True


def member(peer, rate, in_flight=0.0, p99=None, name="embed", in_service=True):
    return M(peer, Rec(demand=(DemandEntry(service=name, rate=rate, in_flight=in_flight, p99_ms=p99),)),
             in_service=in_service)


def test_the_in_flight_figure_is_averaged_over_the_window_and_quiet_services_are_left_out():
    d = LocalDemand()
    for t, n in ((0.0, 2.0), (1.0, 4.0), (2.0, 6.0)):
        d.observe(t, stats(embed=(30.0, n, 120.0), idle=(0.0, 0.0, None)))
    assert d.entries() == (DemandEntry(service="embed", rate=30.0, in_flight=4.0, p99_ms=120.0),)
    d.observe(2.0 + WINDOW_S + 0.5, stats(embed=(30.0, 10.0, 120.0)))
    assert d.entries()[0].in_flight == 10.0, "older figures left the window"
    d.observe(20.0, stats())
    assert d.entries() == (), "a service gone from the gateway's table reports nothing"


def test_entries_are_published_when_they_move_enough_and_not_more_often_than_the_period():
    d = LocalDemand()
    d.observe(0.0, stats(embed=(30.0, 4.0, None)))
    assert d.changed(0.0) is not None
    d.observe(0.5, stats(embed=(60.0, 4.0, None)))
    assert d.changed(0.5) is None, "within the period"
    d.observe(PUBLISH_S, stats(embed=(60.0, 4.0, None)))
    assert [e.rate for e in d.changed(PUBLISH_S)] == [60.0], "the period over: the move is published"
    d2 = LocalDemand()
    d2.observe(0.0, stats(embed=(30.0, 4.0, None)))
    d2.changed(0.0)
    d2.observe(5.0, stats(embed=(32.0, 4.2, None)))
    assert d2.changed(5.0) is None, "a small move is not worth a record"
    d2.observe(10.0, stats(embed=(0.0, 0.0, None)))
    for t in (10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0):
        d2.observe(t, stats(embed=(0.0, 0.0, None)))
    assert d2.changed(17.0) == (), "going quiet is published"


def test_the_gateways_figures_are_checked_and_the_busiest_services_kept():
    d = LocalDemand()
    d.observe(0.0, {"services": {"Bad/Name": {"rate_per_s": 5.0, "in_flight": 1.0},
                                 "nan": {"rate_per_s": float("nan"), "in_flight": 1.0},
                                 "neg": {"rate_per_s": -1.0, "in_flight": 1.0},
                                 "list": [1, 2], "ok": {"rate_per_s": 1.0, "in_flight": True}}})
    assert d.entries() == ()
    d.observe(1.0, "not a map")
    d.observe(2.0, {"services": {f"s{i}": {"rate_per_s": float(i + 1), "in_flight": 1.0} for i in range(40)}})
    kept = d.entries()
    assert len(kept) == MAX_DEMAND and {e.service for e in kept} == {f"s{i}" for i in range(40 - MAX_DEMAND, 40)}


def test_the_swarms_demand_sums_the_members_in_service():
    members = [member("a", 30.0, 3.0, 100.0), member("b", 10.0, 1.0, 900.0), member("c", 5.0, name="other"),
               member("gone", 500.0, 50.0, in_service=False), M("quiet")]
    d = swarm_demand("embed", members, replicas=2)
    assert (d.rate, d.in_flight, d.members) == (40.0, 4.0, 2)
    assert d.p99_ms == 900.0, "b carries a quarter of the requests: its p99 counts"
    assert [p for p, _ in d.points] == ["a", "b"]


def test_a_member_inflating_its_figures_gets_bounded_weight_in_flight_and_latency():
    honest = [member("a", 40.0, 4.0, 100.0), member("b", 20.0, 2.0, 110.0)]
    liar = member("liar", 90_000.0, 9_000.0, 0.0)
    d = swarm_demand("embed", [*honest, liar], replicas=2)
    assert d.in_flight == 6.0 + 2 * POOL_PER_REPLICA, "no more in flight than its gateway can hold for 2 replicas"
    assert dict(d.points)["liar"] == pytest.approx(240.0), "placement weighs it at most 80 % of the whole"
    slow_liar = member("tiny", 1.0, 0.1, 60_000.0)
    assert swarm_demand("embed", [*honest, slow_liar], replicas=2).p99_ms == 110.0, \
        "a member carrying under a tenth of the requests cannot push the p99 over the SLO alone"
    alone = swarm_demand("embed", [member("a", 40.0, 4.0)], replicas=1)
    assert alone.points == (("a", 40.0),), "a lone entry point weighs what it reports"
