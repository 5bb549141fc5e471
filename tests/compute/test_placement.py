"""Placement on synthetic views: latency ranking, filters, explanations, determinism, scale."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from swarmd.compute.coordinator import placement
from swarmd.compute.coordinator.placement import Candidate, NoFit, Placement, place
from swarmd.compute.spec import build
from swarmd.p2p.transport import Transport


def spec(**fields):
    return build({"cmd": ["python", "x.py"], **fields}, {})


def node(peer, *, state="alive", gpus=0, slots=2, cpu=4.0, mem=16000, labels=None, load=0.0):
    return Candidate(peer=peer, state=state, gpus_free=gpus, gpu_model="H100" if gpus else None, slots_free=slots,
                     cpu_free=cpu, memory_free_mb=mem, labels=labels or {}, load=load)


def line(pos: dict[str, float]):
    """Hosts on a line: the RTT is the distance."""
    return lambda a, b: abs(pos[a] - pos[b])


def plane(pos: dict[str, tuple[float, float]]):
    return lambda a, b: math.dist(pos[a], pos[b])


def clustered(rng: random.Random, hosts: int, clusters: int, spread: float) -> dict[str, tuple[float, float]]:
    centres = [(rng.uniform(0, 1000), rng.uniform(0, 1000)) for _ in range(clusters)]
    return {f"p{i:03d}": (centres[i % clusters][0] + rng.uniform(0, spread),
                          centres[i % clusters][1] + rng.uniform(0, spread)) for i in range(hosts)}


def test_the_tightest_set_wins_and_its_middle_hosts_rank_0():
    pos = {"a": 0, "b": 1, "c": 2, "x": 100, "y": 101.5, "z": 103}
    assert place(spec(nodes=3), [node(p) for p in pos], line(pos)) == Placement(("b", "a", "c"), 2.0)


def test_two_clusters_the_tight_one_is_chosen_even_when_busier():
    pos = {"eu1": (0, 0), "eu2": (3, 0), "eu3": (0, 3), "us1": (80, 0), "us2": (80, 40), "us3": (120, 0)}
    view = [node(p, load=5 if p.startswith("eu") else 0) for p in pos]
    result = place(spec(nodes=3), view, plane(pos))
    assert set(result.peers) == {"eu1", "eu2", "eu3"} and result.worst_rtt_ms == pytest.approx(math.hypot(3, 3))


def test_equal_latency_goes_to_the_least_loaded_then_to_the_lowest_peer_ids():
    view = [node("a", load=3), node("b"), node("c"), node("d", load=1), node("e")]
    assert place(spec(nodes=2), view, lambda a, b: 10.0).peers == ("b", "c")
    assert place(spec(nodes=3), view, lambda a, b: 10.0).peers == ("b", "c", "e")


def test_one_node_is_the_least_loaded_member_whatever_the_latency():
    view = [node("a", load=2), node("b", load=0.5), node("c", load=0.5)]
    assert place(spec(), view, lambda a, b: None) == Placement(("b",), 0.0)


def test_a_service_replica_goes_where_its_requests_enter_weighed_by_them():
    """Hosts on a line: demand enters at 'asia' (90 req/s) and 'eu' (10): the replica goes to
    the free host nearest the weighted demand, whatever the load; unknown RTTs count as far."""
    import dataclasses

    from swarmd.compute.spec import Serve
    pos = {"asia": 0.0, "asia2": 5.0, "eu": 200.0, "eu2": 205.0, "us": 300.0}
    view = [node("asia2", load=2.0), node("eu2"), node("us")]
    replica = dataclasses.replace(spec(), serve=Serve(service="embed", replica=0, near=(("asia", 90), ("eu", 10))))
    assert place(replica, view, line(pos)).peers == ("asia2",)
    eu_heavy = dataclasses.replace(replica, serve=Serve(service="embed", replica=0, near=(("asia", 10), ("eu", 90))))
    assert place(eu_heavy, view, line(pos)).peers == ("eu2",)
    # a demand point that is itself a fitting host is 0 ms from itself
    assert place(replica, [*view, node("asia", load=5.0)], line(pos)).peers == ("asia",)
    # nothing measured: the least loaded, as for any one-node job
    assert place(replica, view, lambda a, b: None).peers == ("eu2",)
    assert place(spec(), view, line(pos)).peers == ("eu2",), "without demand: the least loaded"


@pytest.mark.parametrize("out, why", [
    (node("h", state="suspect", gpus=2, labels={"region": "eu"}), "suspect"),
    (node("h", state="dead", gpus=2, labels={"region": "eu"}), "dead"),
    (node("h", state="left", gpus=2, labels={"region": "eu"}), "left"),
    (node("h", gpus=2), "no label region"),
    (node("h", gpus=2, labels={"region": "us"}), "label region=us not eu"),
    (node("h", labels={"region": "eu"}), "no free GPU, 2 needed"),
    (node("h", gpus=1, labels={"region": "eu"}), "1 free GPU, 2 needed"),
    (node("h", gpus=2, slots=0, labels={"region": "eu"}), "no free job slot"),
    (node("h", gpus=2, cpu=1.5, labels={"region": "eu"}), "1.5 free cores < 2"),
    (node("h", gpus=2, mem=4000, labels={"region": "eu"}), "4000 MB free < 8192"),
])
def test_each_filter_keeps_a_host_out_and_says_why(out, why):
    asked = spec(nodes=2, gpus_per_node=2, cpus=2, mem="8G", labels={"region": "eu"})
    fits = node("g", gpus=2, labels={"region": "eu", "tier": "gold"})
    result = place(asked, [fits, out], lambda a, b: 1.0)
    assert result == NoFit("need 2 nodes with ≥2 free GPUs, ≥2 free cores, ≥8192 MB free, region=eu; "
                           f"1 alive member fits: g; 1 other: h ({why})")
    assert place(asked, [fits, node("k", gpus=8, cpu=2, mem=8192, labels={"region": "eu"}), out],
                 lambda a, b: 1.0).peers == ("g", "k"), "exactly the amount asked is enough"


def test_no_fit_names_what_was_asked_and_each_member_short():
    view = [node("12D3KooWaaaaaaaaaaaa1111", gpus=1), node("12D3KooWbbbbbbbbbbbb2222", gpus=1),
            node("12D3KooWdddddddddddd4444", state="suspect", gpus=1), node("12D3KooWcccccccccccc3333")]
    result = place(spec(nodes=3, gpus_per_node=1), view, lambda a, b: 1.0)
    assert result == NoFit("need 3 nodes with ≥1 free GPU; 2 alive members fit: aaaa1111, bbbb2222; "
                           "2 others: cccc3333 (no free GPU, 1 needed); dddd4444 (suspect)")


def test_no_fit_lists_eight_of_each_then_counts():
    view = [node(f"fit{i:02d}") for i in range(10)] + [node(f"dead{i:02d}", state="dead") for i in range(3)]
    view += [node(f"full{i:02d}", slots=0) for i in range(7)]
    result = place(spec(nodes=11), view, lambda a, b: 1.0)
    fits = ", ".join(f"fit{i:02d}" for i in range(8))
    others = "; ".join(f"full{i:02d} (no free job slot)" for i in range(7))
    assert result == NoFit(f"need 11 nodes; 10 alive members fit: {fits} and 2 more; "
                           f"10 others: {others}; dead00 (dead) and 2 more"), "alive hosts are listed first"


def test_no_member_at_all():
    assert place(spec(nodes=2), [], lambda a, b: 1.0) == NoFit("need 2 nodes; no member fits")


def test_hosts_that_refused_are_excluded_with_their_reason():
    view = [node("a"), node("b"), node("12D3KooWcccccccccccc3333")]
    result = place(spec(nodes=2), view, lambda a, b: 1.0, exclude={"b", "a"})
    assert result == NoFit("need 2 nodes; 1 alive member fits: cccc3333; "
                           "2 others: a (refused the last reservation); b (refused the last reservation)")
    refused = {"12D3KooWcccccccccccc3333": "cccc3333: 2 of 4 job slots taken", "a": "no answer within 5 s"}
    result = place(spec(nodes=2), view, lambda a, b: 1.0, exclude=refused)
    assert result == NoFit("need 2 nodes; 1 alive member fits: b; 2 others: "
                           "cccc3333 (refused: 2 of 4 job slots taken); a (refused: no answer within 5 s)")


def test_an_unknown_rtt_is_worse_than_any_known_one():
    known = {frozenset("ab"): 500.0, frozenset("bc"): 20.0}
    result = place(spec(nodes=2), [node("a"), node("b"), node("c")], lambda a, b: known.get(frozenset((a, b))))
    assert result == Placement(("b", "c"), 20.0)
    known[frozenset("bc")] = math.nan
    result = place(spec(nodes=2), [node("a"), node("b"), node("c")], lambda a, b: known.get(frozenset((a, b))))
    assert result == Placement(("a", "b"), 500.0), "NaN is not a measurement"


def test_rtts_known_one_way_count_both_ways():
    one_way = {("b", "a"): 7.0}
    result = place(spec(nodes=2), [node("a"), node("b"), node("c")], lambda a, b: one_way.get((a, b)))
    assert result == Placement(("a", "b"), 7.0)


def test_with_all_rtts_unknown_the_least_loaded_set_is_still_placed():
    view = [node("x", load=1), node("y"), node("z")]
    assert place(spec(nodes=2), view, lambda a, b: None) == Placement(("y", "z"), None)


def test_a_coordinator_that_knows_only_its_own_rtts_picks_itself_and_its_nearest():
    mine = {"b": 40.0, "c": 5.0, "d": 9.0, "e": 300.0}

    def rtt(a, b):
        return mine.get(b) if a == "me" else mine.get(a) if b == "me" else None

    result = place(spec(nodes=3), [node(p) for p in ("b", "c", "d", "e", "me")], rtt)
    assert result == Placement(("me", "c", "d"), None), "fewest unknown pairs, then the worst known"


def test_the_same_view_in_any_order_gives_the_same_placement():
    rng = random.Random(7)
    pos = {f"p{i:03d}": rng.uniform(0, 200) for i in range(12)}
    view = [node(p, load=rng.choice([0, 1, 2])) for p in pos]
    pos |= {"q1": pos["p001"], "q2": pos["p001"]}  # exact ties on latency and load
    view += [node("q2", load=view[1].load), node("q1", load=view[1].load)]
    first = place(spec(nodes=4), view, line(pos))
    for _ in range(20):
        rng.shuffle(view)
        assert place(spec(nodes=4), view, line(pos)) == first


def test_a_large_view_is_placed_quickly_in_one_cluster():
    rng = random.Random(1)
    pos = clustered(rng, hosts=300, clusters=30, spread=3)
    view = [node(p, load=rng.choice([0, 1])) for p in pos]
    started = time.perf_counter()
    result = place(spec(nodes=8), view, plane(pos))
    took = time.perf_counter() - started
    assert took < 2, f"{took:.2f} s"
    assert result.worst_rtt_ms < 3 * math.sqrt(2), "eight of one cluster's ten"
    assert len({int(p[1:]) % 30 for p in result.peers}) == 1


def test_greedy_search_agrees_with_exact_search(monkeypatch):
    rng = random.Random(3)

    def exact_and_greedy(pos):
        view = [node(p, load=rng.choice([0, 1])) for p in pos]
        exact = place(spec(nodes=4), view, plane(pos))
        with monkeypatch.context() as m:
            m.setattr(placement, "EXACT_LIMIT", 0)
            return exact, place(spec(nodes=4), view, plane(pos))

    for _ in range(40):
        exact, greedy = exact_and_greedy(clustered(rng, hosts=12, clusters=3, spread=5))
        assert greedy == exact, "clustered hosts: the same set in the same order"
    agree = 0
    for _ in range(40):
        pos = {f"p{i}": (rng.uniform(0, 100), rng.uniform(0, 100)) for i in range(10)}
        exact, greedy = exact_and_greedy(pos)
        assert exact.worst_rtt_ms == min(max(math.dist(pos[a], pos[b]) for a, b in itertools.combinations(g, 2))
                                         for g in itertools.combinations(pos, 4))
        assert greedy.worst_rtt_ms <= 1.25 * exact.worst_rtt_ms
        agree += greedy == exact
    assert agree >= 36, "scattered hosts: nearly always the same"


def test_greedy_with_fewer_seeds_starts_from_the_tightest_neighbourhoods(monkeypatch):
    rng = random.Random(5)
    pos = clustered(rng, hosts=60, clusters=6, spread=20)
    pos |= {f"t{i}": (500 + i, 500) for i in range(4)}  # one tight group far from the rest
    monkeypatch.setattr(placement, "EXACT_LIMIT", 0)
    monkeypatch.setattr(placement, "GREEDY_WORK", 4 * len(pos))  # one seed
    result = place(spec(nodes=4), [node(p) for p in pos], plane(pos))
    assert result == Placement(("t1", "t0", "t2", "t3"), 3.0)


def test_an_elastic_job_takes_as_many_as_fit_up_to_its_max():
    pos = {"a": 0, "b": 1, "c": 2, "d": 3, "e": 50}
    assert len(place(spec(nodes="2:4"), [node(p) for p in pos], line(pos)).peers) == 4
    three = [node("a"), node("b"), node("c"), node("d", slots=0), node("e", state="dead")]
    assert sorted(place(spec(nodes="2:4"), three, line(pos)).peers) == ["a", "b", "c"]
    one = [node("a"), node("b", slots=0)]
    no = place(spec(nodes="2:4"), one, line(pos))
    assert isinstance(no, NoFit) and no.reason.startswith("need 2 to 4 nodes; 1 alive member fits: a;")


def test_a_restart_keeps_the_survivors_and_adds_the_member_nearest_them():
    pos = {"a": 0, "b": 1, "lost": 2, "near": 3, "far": 40}
    nodes = [node(p) for p in pos]
    got = place(spec(nodes=3), nodes, line(pos), exclude={"lost": "lost in attempt 1"}, require=("a", "b"))
    assert sorted(got.peers) == ["a", "b", "near"]
    # the survivors' records may still count the slot their last attempt used: they are kept
    busy = [node("a", slots=0), node("b", slots=0), node("far"), node("near", state="dead")]
    assert sorted(place(spec(nodes=3), busy, line(pos), require=("a", "b")).peers) == ["a", "b", "far"]


def test_a_restart_shrinks_to_the_survivors_when_nothing_else_fits_and_min_allows():
    pos = {"a": 0, "b": 1, "lost": 2}
    nodes = [node("a"), node("b"), node("lost", state="dead")]
    assert sorted(place(spec(nodes="2:3"), nodes, line(pos), require=("a", "b")).peers) == ["a", "b"]
    no = place(spec(nodes=3), nodes, line(pos), require=("a", "b"))
    assert isinstance(no, NoFit) and "lost (dead)" in no.reason


def test_a_required_survivor_under_suspicion_is_kept():
    """A crash can make the failure detector suspect a healthy host for a moment: a survivor
    that just reported its ranks' exit is kept, and its reservation says whether it is there."""
    got = place(spec(nodes="2:3"), [node("a"), node("b", state="suspect"), node("lost", state="dead")],
                lambda a, b: 1.0, require=("a", "b"))
    assert sorted(got.peers) == ["a", "b"]
    assert isinstance(place(spec(nodes=2), [node("a"), node("b", state="suspect")], lambda a, b: 1.0), NoFit)


def test_a_required_survivor_that_is_dead_now_is_no_fit():
    no = place(spec(nodes="1:2"), [node("a"), node("b", state="dead")], lambda a, b: 1.0, require=("a", "b"))
    assert isinstance(no, NoFit) and "b (dead)" in no.reason


def test_required_members_are_grown_from_when_the_search_is_greedy(monkeypatch):
    monkeypatch.setattr(placement, "EXACT_LIMIT", 1)
    pos = {f"p{i}": float(i) for i in range(30)}
    got = place(spec(nodes=4), [node(p) for p in pos], line(pos), require=("p10", "p11"))
    assert {"p10", "p11"} <= set(got.peers) and got.worst_rtt_ms == 3.0  # p9-p12 or p10-p13


def test_a_pair_nobody_measured_is_ranked_by_its_coordinate_estimate():
    """The coordinator measures pairs through routing (Routing.rtt_function: the chosen path's RTT,
    else measured, else the coordinate estimate): b and c never probed each other, yet their
    estimate makes them the tightest pair. Without routing only probed pairs are known, and the
    one measured pair wins however far apart its ends are."""
    from types import MappingProxyType, SimpleNamespace

    from swarmd.compute.coordinator.coordinator import Jobs
    from swarmd.gossip.membership import MemberView, State, View

    def member(peer, rtt_s=None):
        return MemberView(peer=peer, state=State.ALIVE, stale=False, record=SimpleNamespace(rtts={}), since=0.0,
                          expires=1e9, rtt_ewma=rtt_s, rtt_min=rtt_s)
    view = View(version=1, me="me", members=MappingProxyType({"a": member("a", 0.08), "b": member("b"),
                                                              "c": member("c")}))
    candidates = [node(p) for p in ("me", "a", "b", "c")]

    class Routing:  # routing.service.Routing's rtt_function, from tables
        estimates = {frozenset(("b", "c")): 12.0}
        measured = {frozenset(("me", "a")): 80.0}

        def rtt_function(self):
            return lambda a, b: self.measured.get(frozenset((a, b)), self.estimates.get(frozenset((a, b)), 150.0))

    without = Jobs._rtt(SimpleNamespace(path_rtt=None), view)
    assert place(spec(nodes=2), candidates, without) == Placement(("a", "me"), 80.0)
    with_routing = Jobs._rtt(SimpleNamespace(path_rtt=Routing().rtt_function), view)
    assert place(spec(nodes=2), candidates, with_routing) == Placement(("b", "c"), 12.0)


def test_the_daemons_routing_estimates_the_pairs_nobody_measured():
    """The same with the driver itself (routing.service.Routing, whose rtt_function the node hands to Jobs):
    records carry coordinates and one reported RTT (c-d, 80 ms); a and b, 2 ms apart by their
    coordinates, have never probed each other and are chosen."""
    from types import MappingProxyType, SimpleNamespace

    from prometheus_client import CollectorRegistry

    from swarmd.compute.coordinator.coordinator import Jobs
    from swarmd.gossip.membership import MemberView, State, View
    from swarmd.vivaldi.coordinates import Coordinate
    from swarmd.routing.service import Routing

    def at(x_ms):
        return Coordinate(vec=(x_ms / 1000,) + (0.0,) * 7, error=0.2, adjustment=0.0, height=10e-6)
    place_at, rtts = {"a": 0.0, "b": 2.0, "c": 300.0, "d": 380.0}, {"c": {"d": 80.0}}
    view = View(version=1, me="me", members=MappingProxyType({
        p: MemberView(peer=p, state=State.ALIVE, stale=False, record=SimpleNamespace(rtts=rtts.get(p, {}), coord=at(x)),
                      since=0.0, expires=1e9, rtt_ewma=None, rtt_min=None) for p, x in place_at.items()}))
    gossip = SimpleNamespace(me="me", view=lambda: view)
    routing = Routing(gossip=gossip, mesh=None, config=SimpleNamespace(),
                      metrics=SimpleNamespace(registry=CollectorRegistry()), transport=Transport(SimpleNamespace()))
    candidates = [node(p) for p in place_at]
    assert place(spec(nodes=2), candidates, Jobs._rtt(SimpleNamespace(path_rtt=None), view)).peers == ("c", "d")
    got = place(spec(nodes=2), candidates, Jobs._rtt(SimpleNamespace(path_rtt=routing.rtt_function), view))
    assert got.peers == ("a", "b") and got.worst_rtt_ms == pytest.approx(2.0, abs=0.1)
    assert routing.rtt_ms("c", "d") == 80.0, "a reported RTT is used before an estimate"


def _peer_ids(n: int) -> list[str]:
    from nacl.signing import SigningKey

    from swarmd.p2p.signed import peer_from_key, peer_str

    return sorted(peer_str(peer_from_key(bytes(SigningKey(bytes([i + 1]) * 32).verify_key))) for i in range(n))


def test_a_job_runs_only_on_the_hosts_its_user_allows_and_is_placed_again_only_there():
    """Finding 6: a job trusts its hosts (rank 0 and a Ray head most), so a user may name the
    members they trust; the nearest member outside the list is never chosen, not at the
    first placement and not for a restart's replacement."""
    a, b, c, d, intruder = _peer_ids(5)
    pos = {a: 0.0, b: 50.0, c: 100.0, d: 150.0, intruder: 1.0}  # the intruder is the nearest to a
    nodes = [node(p) for p in pos]
    trusted = spec(nodes=2, hosts=[a, b, c])
    assert sorted(place(trusted, nodes, line(pos)).peers) == [a, b]
    assert sorted(place(spec(nodes=2), nodes, line(pos)).peers) == sorted([a, intruder])
    again = place(trusted, nodes, line(pos), exclude={b: "lost in attempt 1"}, require=(a,))
    assert sorted(again.peers) == [a, c]  # c, not the nearer intruder
    none = place(trusted, [node(intruder), node(d)], line(pos))
    assert isinstance(none, NoFit) and "not in the job's hosts" in none.reason
    assert "among the 3 hosts of its allow list" in none.reason
