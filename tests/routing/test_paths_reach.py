"""Path choice with members behind NATs (swarmd/routing/paths.py with direct.py): no direct path
means a relay, chosen for latency among the publicly reachable members, with its reason; no
flapping; a follower's checks; the cap. A fake clock, one evaluation a second."""

import json

from swarmd.routing import direct as dp
from swarmd.routing.paths import Measure, Paths, UsePath
from tests.routing.world import World


def nat_world(me_nat: str = "eim", peer_nat: str = "edm") -> World:
    """a (NATed) and b (NATed) 30 ms apart; public relays r (10 + 25) and s (5 + 40); q is NATed
    and the fastest (2 + 2): no relay for a NATed pair."""
    w = World("a")
    w.nat["a"] = (me_nat, "198.51.100.1:51820")
    w.add("b", relay=False, nat=peer_nat)
    w.add("r", "s", nat="public")
    w.add("q", nat="eim")
    w.link("a", "b", 30)
    w.link("a", "r", 10)
    w.link("r", "b", 25)
    w.link("a", "s", 5)
    w.link("s", "b", 40)
    w.link("a", "q", 2)
    w.link("q", "b", 2)
    return w


def run(p: Paths, w: World, start: float, end: float, step: float = 1.0) -> list:
    out, t = [], start
    while t <= end:
        out += [a for a in p.evaluate(t, w.view()) if isinstance(a, UsePath)]
        t += step
    return out


def test_no_handshake_within_the_grace_relays_through_the_fastest_public_member():
    w, p = nat_world("eim", "eim"), Paths("a")
    w.unshaken = {"b"}
    assert run(p, w, 0, 9) == [], "within the grace: direct (a punch takes a moment)"
    assert run(p, w, 10, 10) == [UsePath(peer="b", relay="r")], "at once, no stable rounds; q is NATed"
    assert p.reason("b") == dp.NO_DIRECT and p.announced() == {"b": "r"}
    w.unshaken = set()  # the relayed path shakes hands: that says nothing of the direct one
    assert run(p, w, 11, 39) == [], "never back to direct for latency (direct is faster on paper), only for a try"


def test_a_symmetric_nat_against_a_symmetric_nat_goes_at_once_and_says_so():
    w, p = nat_world("edm", "edm"), Paths("a")
    w.unshaken = {"b"}
    assert run(p, w, 0, 0) == [UsePath(peer="b", relay="r")]
    assert p.reason("b") == dp.SYMMETRIC
    info = p.explain("b", w.view(), now=1.0)
    assert info["reason"] == dp.SYMMETRIC and info["direct_path"]["state"] == "none"
    assert info["direct_path"]["impossible"] is True and info["direct_path"]["retry_in_s"] is None
    assert info["nated_pair"] is True
    q = next(c for c in info["candidates"] if c["relay"] == "q")
    assert q["usable"] is False and "not publicly reachable" in q["why_not"], q
    json.dumps(info)
    assert run(p, w, 1, 5000, step=10) == [], "theory rules it out: no tries on a timer"


def test_symmetric_against_eim_is_tried_and_named_when_it_fails():
    w, p = nat_world("edm", "eim"), Paths("a")
    w.unshaken = {"b"}
    assert run(p, w, 0, 10) == [UsePath(peer="b", relay="r")]
    assert p.reason("b") == dp.SYMMETRIC


def test_relayed_for_lack_of_a_direct_path_retries_rarely_and_stays_when_it_works():
    w, p = nat_world("eim", "eim"), Paths("a")
    w.unshaken = {"b"}
    run(p, w, 0, 10)
    assert run(p, w, 11, 39) == []
    assert run(p, w, 40, 40) == [UsePath(peer="b", relay=None)], "the first try soon: the other end may have lagged"
    assert run(p, w, 41, 50) == [], "the try's grace (from its first observation on the direct path)"
    assert run(p, w, 51, 51) == [UsePath(peer="b", relay="r")], "failed: back on the relay"
    assert run(p, w, 52, 80) == [] and run(p, w, 81, 81) == [UsePath(peer="b", relay=None)], \
        "CHANGE_TRIES in all soon (the first was the set-up)"
    assert run(p, w, 82, 92) == [UsePath(peer="b", relay="r")]
    assert run(p, w, 93, 691) == [], "the next try after twice retry_s"
    assert run(p, w, 692, 693) == [UsePath(peer="b", relay=None)]
    w.unshaken = set()  # the punch worked this time
    assert run(p, w, 964, 2000, step=5) == [] and p.path("b") is None and p.reason("b") is None


def test_a_new_reflexive_endpoint_retries_direct_at_once():
    w, p = nat_world("eim", "eim"), Paths("a")
    w.unshaken = {"b"}
    run(p, w, 0, 10)
    w.nat["b"] = ("eim", "203.0.113.99:40000")
    assert run(p, w, 11, 11) == [UsePath(peer="b", relay=None)]
    assert run(p, w, 12, 21) == []
    assert run(p, w, 22, 22) == [UsePath(peer="b", relay="r")]


def test_an_endpoint_attested_at_last_retries_direct_at_once():
    # at start-up the peer's reflexive endpoint is in its record before two members' attestations
    # reach our view: the pair fails on no endpoint, and is tried again when we have one to send to
    w, p = nat_world("eim", "eim"), Paths("a")
    w.unshaken = {"b"}
    run(p, w, 0, 10)
    w.target["b"] = w.nat["b"][1]
    assert run(p, w, 11, 11) == [UsePath(peer="b", relay=None)]


def test_a_symmetric_nats_port_per_observer_retries_nothing():
    # an edm end's reflexive port is the one its last observers saw: it changes every reach round
    w, p = nat_world("eim", "edm"), Paths("a")
    w.unshaken = {"b"}
    run(p, w, 0, 100)  # found lacking, and its quick tries failed
    assert p.path("b") == "r" and p.direct.row(100, "b")["retry_in_s"] > 500
    for t, port in ((101, 31813), (121, 49113), (141, 2000)):
        w.nat["b"] = ("edm", f"203.0.113.2:{port}")
        assert run(p, w, t, t + 19) == [], "a new port of the same symmetric NAT is no new mapping"
    w.nat["b"] = ("edm", "192.0.2.7:2000")  # a new public IP is
    assert run(p, w, 161, 161) == [UsePath(peer="b", relay=None)]


def test_without_a_public_relay_the_pair_stays_direct_and_asks_for_legs():
    w, p = nat_world("eim", "eim"), Paths("a")
    w.public = set()
    w.unshaken = {"b"}
    assert run(p, w, 0, 30) == []
    assert p.direct.lacking("b") == dp.NO_DIRECT and p.path("b") is None


def test_unmeasured_relays_are_ranked_by_estimate_and_measured():
    w = World("a")
    w.nat["a"] = ("eim", "198.51.100.1:51820")
    w.add("b", relay=False, nat="firewall")
    w.add("r", "s", nat="public")
    w.coords = {("a", "r"): 50.0, ("r", "b"): 50.0, ("a", "s"): 10.0, ("s", "b"): 10.0}
    w.unshaken = {"b"}
    p = Paths("a", measure_interval_s=5.0)
    for t in range(10):
        p.evaluate(float(t), w.view())
    actions = p.evaluate(10.0, w.view())
    assert UsePath(peer="b", relay="s") in actions
    assert any(isinstance(a, Measure) and "s" in a.peers for a in actions), "the pick's leg is asked for"
    w.own = {"s": 90.0, "r": 10.0}
    w.reported = {"b": {"r": 10.0, "s": 10.0}}
    assert run(p, w, 11, 13) == [UsePath(peer="b", relay="r")], "measured: the faster relay by the switch rule"
    assert p.reason("b") == dp.NO_DIRECT


def test_a_public_pair_without_a_direct_path_may_use_any_relay():
    w = World("a")
    w.nat["a"] = ("public", None)
    w.add("b", relay=False, nat=None)
    w.add("q", nat="eim")
    w.link("a", "b", 30)
    w.link("a", "q", 20)
    w.link("q", "b", 20)
    w.unshaken = {"b"}
    p = Paths("a")
    assert run(p, w, 0, 10) == [UsePath(peer="b", relay="q")]
    assert p.reason("b") == dp.NO_DIRECT


def test_speed_stays_the_reason_for_a_detour():
    w = World("a")
    w.nat["a"] = ("public", None)
    w.add("b", relay=False, nat="public")
    w.add("r", nat="public")
    w.link("a", "b", 120)
    w.link("a", "r", 20)
    w.link("r", "b", 30)
    p = Paths("a")
    assert run(p, w, 0, 5) == [UsePath(peer="b", relay="r")]
    assert p.reason("b") == dp.FASTER


def test_the_follower_refuses_a_relay_nobody_behind_a_nat_can_reach_and_records_why_it_follows():
    w = nat_world("eim", "eim")
    w.me = "c"
    w.nat["c"] = w.nat.pop("a")
    w.peers.discard("c")
    w.add("a", relay=False, nat="eim")  # the chooser (a < c)
    w.unshaken = {"a"}
    p = Paths("c")
    w.via = {"a": "q"}
    assert run(p, w, 0, 0) == [] and "publicly reachable" in p.explain("a", w.view(), now=0.0)["refused"]
    w.via = {"a": "r"}
    assert run(p, w, 1, 1) == [UsePath(peer="a", relay="r")]
    assert p.reason("a") == dp.NO_DIRECT, "its own direct path was unproven as it followed"
    w.nat["a"] = ("edm", "203.0.113.7:40000")  # its verdict, found after the follow began (seen in CI)
    run(p, w, 2, 2)
    assert p.reason("a") == dp.SYMMETRIC and p.explain("a", w.view(), now=2.0)["reason"] == dp.SYMMETRIC
    w.nat["a"] = ("eim", None)
    w.via = {}
    run(p, w, 3, 3)
    w.unshaken = set()
    w.via = {"a": "r"}
    run(p, w, 4, 4)
    assert p.reason("a") == dp.FASTER


def test_pairs_without_a_direct_path_take_the_cap_before_detours():
    w = World("a")
    w.nat["a"] = ("public", None)
    w.add("r", nat="public")
    w.link("a", "r", 5)
    for i in range(3):
        fast = f"f{i}"
        w.add(fast, relay=False, nat="public")
        w.link("a", fast, 120)
        w.link("r", fast, 10)
    p = Paths("a", max_relayed=3)
    run(p, w, 0, 5)
    assert len(p.announced()) == 3
    w.add("n", relay=False, nat="edm")
    w.link("a", "n", 20)
    w.link("r", "n", 20)
    w.unshaken = {"n"}
    assert run(p, w, 6, 15) == [], "an edm NAT against a public member: tried for the grace"
    moves = run(p, w, 16, 16)
    assert UsePath(peer="n", relay="r") in moves and len(p.announced()) == 3
    assert sum(1 for m in moves if m.relay is None) == 1, "the weakest detour made room"
    w.add("n2", relay=False, nat="edm")
    w.link("a", "n2", 20)
    w.link("r", "n2", 20)
    w.unshaken = {"n", "n2"}
    run(p, w, 17, 27)
    assert set(p.announced()) >= {"n", "n2"} and len(p.announced()) == 3
