"""Where a service's requests enter (swarmd/serve/demand.py): this member's entries from its
gateway's figures, the swarm's sum as a controller reads it, and what a member's inflated
figures can and cannot do."""

from dataclasses import dataclass, field

import pytest

from swarmd.gossip.registry import MAX_DEMAND, DemandEntry
from swarmd.serve.demand import POOL_PER_REPLICA, PUBLISH_S, WINDOW_S, LocalDemand, swarm_demand


def stats(**services):
    """The gateway's figures: (requests answered so far, in flight, p99) per service."""
    return {"services": {name: {"rate_per_s": 0.5, "in_flight": in_flight, "p99_ms": p99, "requests": requests}
                         for name, (requests, in_flight, p99) in services.items()}}


def steady(d, start, end, rate, in_flight=1.0, name="embed", p99=None, count=0):
    """The gateway's polls, one a second, at ``rate`` requests per second; returns the count."""
    for t in range(start, end):
        count += rate
        d.observe(float(t), stats(**{name: (count, in_flight, p99)}))
    return count


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


def test_the_rate_comes_from_the_count_and_in_flight_is_averaged_over_the_window_quiet_left_out():
    d = LocalDemand()
    for t, n in ((0.0, 2.0), (1.0, 4.0), (2.0, 6.0)):
        d.observe(t, stats(embed=(100 + 30 * int(t), n, 120.0), idle=(7, 0.0, None)))
    assert d.entries() == (DemandEntry(service="embed", rate=30.0, in_flight=4.0, p99_ms=120.0),), \
        "30 more answered a second: 30 req/s (the gateway's own minute-long rate is not used)"
    d.observe(2.0 + WINDOW_S + 0.5, stats(embed=(100 + 60 + 30 * 7, 10.0, 120.0)))
    assert d.entries()[0].in_flight == 10.0, "older figures left the window"
    d.observe(20.0, stats())
    assert d.entries() == (), "a service gone from the gateway's table reports nothing"


def test_a_restarted_gateways_count_starts_the_window_over_instead_of_a_negative_rate():
    d = LocalDemand()
    count = steady(d, 0, 5, 20)
    d.observe(5.0, stats(embed=(3, 1.0, None)))
    assert d.entries()[0].rate == 0.0
    steady(d, 6, 9, 10, count=3)
    assert d.entries()[0].rate == 10.0 and count == 100


def test_entries_are_published_when_they_move_enough_and_not_more_often_than_the_period():
    d = LocalDemand()
    count = steady(d, 0, 3, 30)
    assert d.changed(2.0) is not None
    count = steady(d, 3, 4, 150, count=count)
    assert d.changed(3.0) is None, "within the period"
    steady(d, 4, 5, 150, count=count)
    assert [e.rate for e in d.changed(4.0)] == [90.0], "the period over: the move is published"
    d2 = LocalDemand()
    count = steady(d2, 0, 7, 30)
    d2.changed(6.0)
    count = steady(d2, 7, 10, 32, in_flight=1.1, count=count)
    assert d2.changed(9.0) is None, "a small move is not worth a record"
    steady(d2, 10, 18, 0, in_flight=0.0, count=count)
    assert d2.changed(17.0) == (), "going quiet is published"


def test_the_gateways_figures_are_checked_and_the_busiest_services_kept():
    d = LocalDemand()
    for t in (0.0, 1.0):
        d.observe(t, {"services": {"Bad/Name": {"requests": 5 + int(t), "in_flight": 1.0},
                                   "nan": {"requests": float("nan"), "in_flight": 1.0},
                                   "neg": {"requests": -1, "in_flight": 1.0},
                                   "big": {"requests": 5, "in_flight": 1e12},
                                   "list": [1, 2], "ok": {"requests": 1, "in_flight": True}}})
    assert d.entries() == ()
    d.observe(1.5, "not a map")
    for t in (2.0, 3.0):
        d.observe(t, {"services": {f"s{i}": {"requests": int(t) * (i + 1), "in_flight": 1.0} for i in range(40)}})
    kept = d.entries()
    assert len(kept) == MAX_DEMAND and {e.service for e in kept} == {f"s{i}" for i in range(40 - MAX_DEMAND, 40)}


def test_the_swarms_demand_sums_the_members_in_service():
    members = [member("a", 30.0, 3.0, 100.0), member("b", 10.0, 1.0, 900.0), member("c", 5.0, name="other"),
               member("gone", 500.0, 50.0, in_service=False), M("quiet")]
    d = swarm_demand("embed", members, replicas=2)
    assert (d.rate, d.in_flight, d.reporters) == (40.0, 4.0, 2)
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


def test_a_requests_typical_time_is_the_members_median_latency_weighed_by_their_requests():
    d = LocalDemand()
    for t in range(3):
        d.observe(float(t), {"services": {"embed": {"requests": 10 * t, "in_flight": 0.0, "p99_ms": 400.0,
                                                    "p50_ms": 250.0}}})
    assert d.entries()[0].p50_ms == 250.0, "the gateway's median goes into the entry"
    a = M("a", Rec(demand=(DemandEntry(service="embed", rate=30.0, in_flight=0.0, p50_ms=200.0),)))
    b = M("b", Rec(demand=(DemandEntry(service="embed", rate=10.0, in_flight=0.0, p50_ms=600.0),)))
    quiet = M("c", Rec(demand=(DemandEntry(service="embed", rate=0.0, in_flight=0.1, p50_ms=9000.0),)))
    assert swarm_demand("embed", [a, b, quiet], replicas=1).latency_ms == pytest.approx(300.0)
    assert swarm_demand("embed", [member("x", 5.0)], replicas=1).latency_ms is None
