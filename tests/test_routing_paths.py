"""Path choice (swarmd/routing/paths.py): the switch rule, hysteresis, failure, the follower's
checks on a hostile announcement, lying relays, the caps."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.routing.paths import HOLD_DOWN_S, MAX_RELAYED, STABLE_ROUNDS, AskLegs, Measure, Paths, UsePath, best_relay
from tests.routing.world import World


def detour_world() -> World:
    """The lab's matrix: a-b 120 ms direct, 20 + 30 through r."""
    w = World("a")
    w.add("b", "r")
    w.link("a", "b", 120)
    w.link("a", "r", 20)
    w.link("r", "b", 30)
    return w


def run(core: Paths, w: World, rounds: int, t0: float = 0.0) -> list[list]:
    return [core.evaluate(t0 + i, w.view()) for i in range(rounds)]


def test_best_relay_rule():
    legs = {"r1": (20.0, 30.0), "r2": (25.0, 25.0), "r3": (10.0, 90.0)}
    assert best_relay(120.0, legs) == ("r1", 50.0)  # ties on total: the lowest id
    assert best_relay(55.0, legs) is None  # 50 > 55 x 0.9
    assert best_relay(56.0, legs) == ("r1", 50.0)  # 50 <= 50.4 and 6 ms faster
    assert best_relay(10.0, {"r": (4.0, 4.0)}) == ("r", 8.0)  # 20 % and 2 ms faster: both thresholds met
    assert best_relay(9.0, {"r": (4.0, 4.0)}) is None  # 11 % faster but 1 ms: under the 2 ms floor
    assert best_relay(100.0, {}) is None


def test_switches_after_three_rounds_not_two_and_announces_it():
    w, core = detour_world(), Paths("a")
    out = run(core, w, 3)
    assert out[0] == [] and out[1] == []
    assert out[2] == [UsePath(peer="b", relay="r")]
    assert core.path("b") == "r" and core.announced() == {"b": "r"} and core.paths() == {"b": "r"}
    assert run(core, w, 5, 3) == [[]] * 5  # stays


def test_an_extra_evaluation_is_not_a_round():
    w, core = detour_world(), Paths("a")
    for t in (0.0, 0.1, 0.2, 0.3, 1.0, 1.2):
        assert core.evaluate(t, w.view()) == []
    assert core.evaluate(2.0, w.view()) == [UsePath(peer="b", relay="r")]


# Each row: the relay path's total (direct stays 100 ms) per round, and the path after each round.
HYSTERESIS = [
    ("clearly better: switch on the third round", [80, 80, 80, 80], [None, None, "r", "r"]),
    ("one worse round resets the count", [80, 80, 95, 80, 80, 80], [None, None, None, None, None, "r"]),
    ("jitter across the switch threshold never switches", [89, 91, 89, 91, 89, 91], [None] * 6),
    ("on the relay, jitter inside the band never goes back", [80, 80, 80, 92, 94, 93, 94.9, 92],
     [None, None, "r", "r", "r", "r", "r", "r"]),
    ("worse than 0.95 x direct for three rounds: back", [80, 80, 80, 96, 96, 96], [None, None, "r", "r", "r", None]),
    ("jitter across the back threshold never goes back", [80, 80, 80, 96, 94, 96, 94, 96],
     [None, None, "r", "r", "r", "r", "r", "r"]),
]


@pytest.mark.parametrize("what,totals,paths", HYSTERESIS, ids=[h[0] for h in HYSTERESIS])
def test_hysteresis_table(what, totals, paths):
    w, core = World("a"), Paths("a")
    w.add("b", "r")
    w.link("a", "b", 100)
    got = []
    for i, total in enumerate(totals):
        w.link("a", "r", total / 2)
        w.link("r", "b", total / 2)
        core.evaluate(float(i), w.view())
        got.append(core.path("b"))
    assert got == paths


def test_back_to_direct_when_the_direct_path_improves():
    w, core = detour_world(), Paths("a")
    run(core, w, 3)
    w.link("a", "b", 30)  # lab link: direct improved to 30 ms
    out = run(core, w, 3, 10)
    assert out == [[], [], [UsePath(peer="b", relay=None)]]
    assert core.announced() == {}


def test_a_clearly_better_relay_replaces_the_one_in_use():
    w, core = detour_world(), Paths("a")
    run(core, w, 3)
    w.add("s")
    w.link("a", "s", 10)
    w.link("s", "b", 15)  # 25 ms against r's 50
    assert run(core, w, 3, 10) == [[], [], [UsePath(peer="b", relay="s")]]
    w.link("s", "b", 38)  # 48 vs 50: not clearly better than r, but s is in use now and stays
    assert run(core, w, 5, 20) == [[]] * 5


def test_two_near_equal_relays_alternating_as_best_still_switch():
    w, core = World("a"), Paths("a")
    w.add("b", "r", "s")
    w.link("a", "b", 120)
    for i in range(3):
        w.link("a", "r", 20 + (i % 2) * 2)
        w.link("a", "s", 22 - (i % 2) * 2)
        w.link("r", "b", 30)
        w.link("s", "b", 30)
        out = core.evaluate(float(i), w.view())
    assert out == [UsePath(peer="b", relay="r")]  # the best at the moment of the move


def test_a_failing_relay_sends_the_pair_direct_at_once_and_is_held_down():
    w, core = detour_world(), Paths("a")
    run(core, w, 3)
    w.failing = {"r"}
    assert core.evaluate(3.0, w.view()) == [UsePath(peer="b", relay=None)]
    w.failing = set()  # not in use any more, so not pinged, so not failing: held down all the same
    assert run(core, w, int(HOLD_DOWN_S) - 2, 4) == [[]] * (int(HOLD_DOWN_S) - 2)
    assert core.explain("b", w.view(), now=10.0)["held_down"] == {"r": 53.0}
    out = run(core, w, STABLE_ROUNDS + 1, 3 + HOLD_DOWN_S)
    assert [a for a in out if a] == [[UsePath(peer="b", relay="r")]]


@pytest.mark.parametrize("change", ["dead", "stops relaying"])
def test_a_relay_gone_from_the_view_sends_the_pair_direct_at_once(change):
    w, core = detour_world(), Paths("a")
    run(core, w, 3)
    if change == "dead":
        w.peers.discard("r")
    w.relays.discard("r")
    assert core.evaluate(3.0, w.view()) == [UsePath(peer="b", relay=None)]


def test_a_peer_that_leaves_releases_its_relay():
    w, core = detour_world(), Paths("a")
    run(core, w, 3)
    w.peers.discard("b")
    assert core.evaluate(3.0, w.view()) == [UsePath(peer="b", relay=None)]
    assert core.paths() == {} and core.announced() == {}


def test_unknown_relay_legs_for_three_rounds_mean_direct():
    w, core = detour_world(), Paths("a")
    run(core, w, 3)
    del w.reported["b"]["r"]  # b no longer reports r (fell out of its nearest)
    assert run(core, w, 3, 3)[-1] == [UsePath(peer="b", relay=None)]


def test_a_lying_relay_cannot_attract_traffic():
    w, core = World("a"), Paths("a")
    w.add("b", "r")
    w.link("a", "b", 120)
    w.link("a", "r", 20)
    w.report("r", "b", 1)  # r claims 1 ms to b; b measured 100
    w.report("b", "r", 100)
    assert run(core, w, 5) == [[]] * 5
    assert core.leg("r", "b", w.view()) == 100
    w.reported["b"].pop("r")  # r's claim alone makes no leg
    assert core.leg("r", "b", w.view()) is None
    assert run(core, w, 5, 5) == [[]] * 5
    w.report("b", "r", 30)
    w.report("r", "b", 300)  # a relay claiming more only makes itself look worse
    assert core.leg("r", "b", w.view()) == 300
    assert run(core, w, 5, 10) == [[]] * 5


def test_own_measurement_of_the_first_leg_beats_the_relays_claim():
    w, core = World("a"), Paths("a")
    w.add("b", "r")
    w.link("a", "b", 120)
    w.report("r", "a", 1)  # r claims to be 1 ms from me; I never measured it
    w.link("r", "b", 30)
    assert core.evaluate(0.0, w.view()) == [Measure(peers=("r",))]  # no coordinates: asked all the same
    assert run(core, w, 5, 1) == [[]] * 5  # never chosen on its claim; asked once a minute at most
    core = Paths("a")
    w.coords[("a", "r")] = 200.0
    assert core.evaluate(0.0, w.view()) == []  # by coordinates not worth a probe: 200 + 30 > 108
    w.coords[("a", "r")] = 25.0
    assert core.evaluate(1.0, w.view()) == [Measure(peers=("r",))]  # 25 + 30 < 108


def test_the_follower_uses_the_choosers_announcement():
    w, core = World("z"), Paths("z")
    w.add("b", "r")
    w.via["b"] = "r"
    assert core.role("b") == "follower"
    assert core.evaluate(0.0, w.view()) == [UsePath(peer="b", relay="r")]  # no hysteresis: the chooser had it
    assert core.announced() == {}  # a follower announces nothing
    w.via.pop("b")
    assert core.evaluate(1.0, w.view()) == [UsePath(peer="b", relay=None)]


@pytest.mark.parametrize("relay,setup,reason", [
    ("z", None, "names this node as the relay"),
    ("b", None, "names the peer itself as the relay"),
    ("x", None, "not an alive member"),
    ("q", lambda w: w.add("q", relay=False), "does not offer relaying"),
    ("r", lambda w: w.failing.add("r"), "failing from here"),
    (["r"], None, "not a peer id"),
])
def test_a_hostile_or_unusable_announcement_means_direct(relay, setup, reason):
    w, core = World("z"), Paths("z")
    w.add("b", "r")
    if setup:
        setup(w)
    w.via["b"] = relay
    assert core.evaluate(0.0, w.view()) == []
    assert core.path("b") is None
    info = core.explain("b", w.view(), now=0.0)
    assert info["announced"] == relay and info["refused"] == reason


def test_the_follower_ignores_announcements_from_a_peer_that_is_not_the_chooser():
    w, core = World("a"), Paths("a")  # a < b: a is the chooser, b's `via` is not for it to follow
    w.add("b", "r")
    w.via["b"] = "r"
    assert [a for out in run(core, w, 5) for a in out if isinstance(a, UsePath)] == []


def test_both_ends_reach_the_same_path_and_each_falls_back_on_its_own_failure():
    wa = detour_world()
    wb = World("b")
    wb.add("a", "r")
    wb.link("b", "a", 120)
    wb.link("b", "r", 30)
    wb.link("r", "a", 20)
    a, b = Paths("a"), Paths("b")
    for t in range(4):
        a.evaluate(float(t), wa.view())
        wb.via = {"a": r for p, r in a.announced().items() if p == "b"}
        b.evaluate(float(t), wb.view())
    assert a.path("b") == b.path("a") == "r"
    wb.failing = {"r"}  # only b cannot reach r
    assert b.evaluate(4.0, wb.view()) == [UsePath(peer="a", relay=None)]


def test_max_relayed_keeps_the_biggest_gains():
    w, core = World("a"), Paths("a")
    peers = [f"p{i:02d}" for i in range(MAX_RELAYED + 4)]
    w.add("r", *peers)
    w.link("a", "r", 10)
    for i, p in enumerate(peers):
        w.link("a", p, 100 + i)  # gain grows with i
        w.link("r", p, 10)
    run(core, w, 3)
    assert sorted(core.announced()) == peers[4:]  # the 16 biggest gains
    w.add("new")
    w.link("a", "new", 300)
    w.link("r", "new", 10)
    out = run(core, w, 3, 3)
    assert sorted(out[-1], key=lambda u: u.peer) == [UsePath(peer="new", relay="r"), UsePath(peer="p04", relay=None)]
    assert len(core.announced()) == MAX_RELAYED


def test_max_relayed_bounds_the_paths_followed():
    w, core = World("z"), Paths("z")
    peers = [f"p{i:02d}" for i in range(MAX_RELAYED + 3)]
    w.add("r", *peers)
    w.via = {p: "r" for p in peers}
    core.evaluate(0.0, w.view())
    assert sorted(core.paths()) == peers[:MAX_RELAYED]
    assert core.explain(peers[-1], w.view(), now=0.0)["refused"] == f"already following {MAX_RELAYED} relayed paths"


def test_explain_is_plain_json():
    w, core = detour_world(), Paths("a")
    run(core, w, 2)
    info = core.explain("b", w.view(), now=2.0)
    assert json.loads(json.dumps(info)) == info
    assert info["role"] == "chooser" and info["path"] == "direct" and info["direct_ms"] == 120
    assert info["candidates"][0] == {"relay": "r", "leg1_ms": 20.0, "leg2_ms": 30.0, "leg2_source": "record",
                                     "total_ms": 50.0, "estimate_ms": None, "usable": True,
                                     "why_not": None}
    assert info["hysteresis"] == {"wants": "relay", "candidate": "r", "rounds": 2, "needed": STABLE_ROUNDS}
    run(core, w, 1, 2)
    info = core.explain("b", w.view(), now=3.0)
    assert info["path"] == "relay" and info["current"] == "r" and info["path_ms"] == 50
    assert info["hysteresis"] == {"wants": None, "candidate": None, "rounds": 0, "needed": STABLE_ROUNDS}
    with pytest.raises(KeyError):
        core.explain("nobody", w.view(), now=2.0)


def test_bad_values_in_the_view_are_ignored_and_counted():
    w, core = detour_world(), Paths("a")
    w.report("b", "r", float("nan"))
    w.report("a", "b", -5.0)
    w.report("r", "b", float("inf"))
    assert run(core, w, 4) == [[], [], [], []]  # no direct, no leg: nothing to decide on
    assert core.ignored_values > 0


rtts = st.floats(min_value=0.5, max_value=400.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("bcdefg"), st.sampled_from("bcdefg"), rtts), min_size=1, max_size=40),
       st.lists(st.tuples(st.sampled_from("bcdefg"), st.sampled_from("abcdefgx")), max_size=6),
       st.sets(st.sampled_from("bcdefg")), st.integers(0, 20))
def test_property_only_valid_relays_and_deterministic(links, vias, failing, rounds):
    """Random worlds and announcements: a path in use is always an alive, relay-offering,
    non-failing third member; two cores fed the same views act the same."""
    for me in ("a", "h"):  # chooser of everything, follower of everything
        w = World(me)
        w.add(*"bcdefg")
        w.relays.discard("g")
        for x, y, ms in links:
            if x != y:
                w.link(me, x, ms)
                w.link(x, y, ms / 3)
        w.via = {p: r for p, r in vias if me > p}
        one, two = Paths(me, max_relayed=2), Paths(me, max_relayed=2)
        for t in range(rounds):
            w.failing = set(failing) if t % 5 == 4 else set()
            assert one.evaluate(float(t), w.view()) == two.evaluate(float(t), w.view())
            for peer, relay in one.paths().items():
                assert relay not in (me, peer, "g", "x") and relay in w.peers and relay not in w.failing
            assert len(one.announced()) <= 2


def two_pair_world(me: str = "a") -> World:
    """b and c both 120 ms from me directly, 20 + 30 through r."""
    w = World(me)
    w.add("b", "c", "r")
    for peer in ("b", "c"):
        w.link(me, peer, 120)
        w.link("r", peer, 30)
    w.link(me, "r", 20)
    return w


def test_a_refused_pair_holds_the_relay_down_for_that_pair_only():
    w, core = two_pair_world(), Paths("a")
    run(core, w, 3)
    assert core.paths() == {"b": "r", "c": "r"}
    w.refused = {("b", "r")}  # r refused b's pair, or b never asked, or the path did not carry it
    assert core.evaluate(3.0, w.view()) == [UsePath(peer="b", relay=None)]  # b at once; c stays
    w.refused = set()  # the session is gone: held down all the same, for HOLD_DOWN_S
    w.add("d")
    w.link("a", "d", 120)
    w.link("r", "d", 30)
    out = run(core, w, int(HOLD_DOWN_S) - 2, 4)
    assert [a for a in out if a] == [[UsePath(peer="d", relay="r")]]  # another pair may still take r
    assert core.paths() == {"c": "r", "d": "r"} and core.held(10.0) == {}  # r itself is not held down
    out = run(core, w, STABLE_ROUNDS + 1, 3 + HOLD_DOWN_S)
    assert [a for a in out if a] == [[UsePath(peer="b", relay="r")]]  # after HOLD_DOWN_S, b may use r again
    assert core.paths() == {"b": "r", "c": "r", "d": "r"}


def test_a_refused_pair_is_not_chosen_through_that_relay_but_through_another():
    w, core = two_pair_world(), Paths("a")
    w.add("s")
    w.link("a", "s", 25)
    w.link("s", "b", 30)  # 55 through s: worse than r's 50, still clearly better than 120
    w.refused = {("b", "r")}
    out = run(core, w, 3)
    assert sorted(out[-1], key=lambda u: u.peer) == [UsePath(peer="b", relay="s"), UsePath(peer="c", relay="r")]


def test_the_follower_does_not_follow_a_refused_pair_and_keeps_its_other_pairs():
    w, core = World("z"), Paths("z")
    w.add("b", "c", "r")
    w.via = {"b": "r", "c": "r"}
    assert sorted(core.evaluate(0.0, w.view()), key=lambda u: u.peer) == [UsePath(peer="b", relay="r"),
                                                                          UsePath(peer="c", relay="r")]
    w.refused = {("b", "r")}
    assert core.evaluate(1.0, w.view()) == [UsePath(peer="b", relay=None)]
    assert core.explain("b", w.view(), now=1.0)["refused"] == "refused or did not carry this pair lately"
    w.refused = set()
    assert run(core, w, int(HOLD_DOWN_S) - 1, 2) == [[]] * (int(HOLD_DOWN_S) - 1)  # held until 61
    assert core.paths() == {"c": "r"}
    assert core.evaluate(1.0 + HOLD_DOWN_S, w.view()) == [UsePath(peer="b", relay="r")]


# --- legs asked for (AskLegs, legs_answered) --------------------------------------------------

def hidden_world() -> World:
    """a-b 120 ms direct; b's record reports only q (its nearest, no help); r would carry the pair in
    20 + 30 ms, but b does not report r: only asking b finds it. Coordinates rank r first."""
    w = World("a")
    w.add("b", "q", "r")
    w.link("a", "b", 120)
    w.link("a", "q", 100)
    w.report("b", "q", 10)
    w.own["r"] = 20
    w.coords = {("r", "b"): 35.0, ("q", "b"): 12.0, ("a", "q"): 100.0}
    return w


def asks(actions: list) -> list[AskLegs]:
    return [a for a in actions if isinstance(a, AskLegs)]


def test_a_detour_only_the_peers_unpublished_leg_shows_is_found_by_asking():
    w, core = hidden_world(), Paths("a")
    out = core.evaluate(0.0, w.view())
    assert out == [AskLegs(peer="b", relays=("r",))]  # q is in b's record: nothing to ask about it
    assert core.legs_answered(0.5, "b", {"r": 30.0}) is None
    out = run(core, w, STABLE_ROUNDS, 1.0)
    assert out[-1] == [UsePath(peer="b", relay="r")] and core.legs("b") == {"r": 30.0}
    found = core.explain("b", w.view(), now=4.0)["candidates"]
    assert found[0]["relay"] == "r" and found[0]["total_ms"] == 50.0 and found[0]["leg2_source"] == "asked"


def test_an_asked_leg_counts_as_the_peers_claim_the_relays_larger_report_still_applies():
    w, core = hidden_world(), Paths("a")
    w.report("r", "b", 100)  # r says its leg to b is 100: the larger of b's and r's counts
    core.evaluate(0.0, w.view())
    assert core.legs_answered(0.5, "b", {"r": 30.0}) is None
    assert run(core, w, STABLE_ROUNDS + 1, 1.0) == [[]] * (STABLE_ROUNDS + 1)
    assert core.leg("r", "b", w.view()) == 100.0


def test_the_records_own_value_wins_over_an_answer():
    w, core = hidden_world(), Paths("a")
    core.evaluate(0.0, w.view())
    assert core.legs_answered(0.5, "b", {"r": 30.0}) is None
    w.report("b", "r", 90)  # r entered b's record since: its value is the newer claim
    assert core.leg("r", "b", w.view()) == 90.0


def test_asked_legs_are_ranked_by_my_leg_plus_the_estimate_and_bounded():
    w, core = World("a"), Paths("a", ask_legs=3)
    w.add("b", "c", "r1", "r2", "r3", "r4", "r5", "r6", "f", "h")
    w.add("x", relay=False)  # offers no relaying
    w.link("a", "b", 120)
    w.report("b", "r6", 5)  # in b's record: its leg is known already
    w.own.update({"r1": 50, "r2": 10})  # my measured legs rank before my estimates
    est = {"r1": (5, 10), "r2": (80, 30), "r3": (20, 20), "r4": (10, 45), "r5": (None, 1), "r6": (1, 1),
           "f": (1, 1), "h": (1, 1), "x": (1, 1), "c": (30, 30)}
    for relay, (mine, theirs) in est.items():
        w.coords[("a", relay)] = mine
        w.coords[(relay, "b")] = theirs
    w.failing = {"f"}
    w.refused = {("b", "h")}  # held down for this pair
    # r1 50 + 10 = 60, r2 10 + 30 = 40, r3 40, r4 55, c 60; r5 has no estimate from me; r6 is in the record;
    # f is failing, h held down for b; x offers no relaying
    assert asks(core.evaluate(0.0, w.view())) == [AskLegs(peer="b", relays=("r2", "r3", "r4"))]


def test_peers_are_asked_in_rotation_a_few_per_round_each_once_per_interval():
    w, core = World("a"), Paths("a", ask_per_round=2, ask_interval_s=10.0)
    peers = ["b", "c", "d", "e", "f"]
    w.add(*peers, "r")
    w.add("0")  # a follower pair (0 < a): its chooser asks, not us
    w.link("a", "0", 100)
    for p in peers:
        if p != "e":  # e: no direct RTT known, nothing to improve on yet
            w.link("a", p, 100)
        w.coords[("r", p)] = 10.0
    w.own["r"] = 10
    asked = [[a.peer for a in asks(core.evaluate(float(t), w.view()))] for t in range(12)]
    assert asked[:3] == [["b", "c"], ["d", "f"], []]
    assert asked[10:] == [["b", "c"], ["d", "f"]]  # after ask_interval_s, the same rotation
    w.link("a", "e", 100)
    assert [a.peer for a in asks(core.evaluate(12.0, w.view()))] == ["e"]


@pytest.mark.parametrize("legs,why", [
    ({"s": 30.0}, "not asked for"),  # a key that was not asked
    ({"r": 30.0, "b": 1.0}, "entries"),  # more than asked
    ({"r": float("nan")}, "outside"), ({"r": float("inf")}, "outside"), ({"r": -1.0}, "outside"),
    ({"r": 0}, "outside"), ({"r": 1e9}, "outside"), ({"r": True}, "outside"), ({"r": "30"}, "outside"),
    ({"r": [30]}, "outside"), ({"r": None}, "outside"), ({b"r": 30.0}, "not asked for"), ({1: 30.0}, "not asked for"),
    ([["r", 30.0]], "expected a map"), ("r", "expected a map"), (None, "expected a map"), (30.0, "expected a map"),
])
def test_a_hostile_answer_is_dropped_whole_and_counted(legs, why):
    w, core = hidden_world(), Paths("a")
    w.add("s")
    core.evaluate(0.0, w.view())
    assert why in core.legs_answered(0.5, "b", legs)
    assert core.legs("b") == {} and (core.legs_taken, core.legs_dropped) == (0, 1)
    assert run(core, w, STABLE_ROUNDS + 1, 1.0) == [[]] * (STABLE_ROUNDS + 1)  # no detour from it
    assert core.legs_answered(5.0, "b", {"r": 30.0}) is None  # the honest answer is still taken


def test_an_answer_is_taken_once_per_ask_and_only_from_the_peer_asked():
    w, core = hidden_world(), Paths("a")
    assert core.legs_answered(0.0, "b", {"r": 30.0}) == "not asked"  # before any ask
    core.evaluate(0.0, w.view())
    assert core.legs_answered(0.5, "q", {"r": 1.0}) == "not asked"  # q was not asked
    assert core.legs_answered(0.5, "b", {}) is None  # b measured none of them: taken, nothing known
    assert core.legs_answered(0.6, "b", {"r": 30.0}) == "not asked"  # a second answer to one ask
    assert core.legs("b") == {} and (core.legs_taken, core.legs_dropped) == (1, 3)


def test_answered_legs_are_forgotten_after_their_ttl_or_when_the_peer_leaves():
    w, core = hidden_world(), Paths("a", ask_interval_s=100.0, legs_ttl_s=200.0)
    core.evaluate(0.0, w.view())
    core.legs_answered(0.5, "b", {"r": 30.0})
    core.evaluate(200.0, w.view())  # asked again at 100 s; that answer never came
    assert core.legs("b") == {"r": 30.0}
    core.evaluate(200.5, w.view())
    assert core.legs("b") == {} and core.leg("r", "b", w.view()) is None
    core.legs_answered(200.6, "b", {"r": 30.0})  # the ask at 200 s
    w.peers.discard("b")
    core.evaluate(201.0, w.view())
    assert core.legs("b") == {}


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=3), st.lists(st.floats(), max_size=3),
                 st.dictionaries(st.one_of(st.sampled_from(["r", "q", "b", "a", "s"]), st.binary(max_size=2),
                                           st.integers()),
                                 st.one_of(st.floats(), st.integers(), st.booleans(), st.none(), st.text(max_size=2)),
                                 max_size=4)))
def test_property_an_answer_is_taken_only_when_every_entry_is_a_valid_asked_leg(legs):
    w, core = hidden_world(), Paths("a")
    w.add("s")
    w.coords[("s", "b")] = 50.0
    w.own["s"] = 10
    core.evaluate(0.0, w.view())  # asks b about r and s
    why = core.legs_answered(0.5, "b", legs)
    if why is None:
        assert isinstance(legs, dict) and set(legs) <= {"r", "s"}
        assert all(0 < ms <= 60000 for ms in core.legs("b").values())
    else:
        assert core.legs("b") == {} and core.legs_dropped == 1
    for i in range(STABLE_ROUNDS + 1):
        for action in core.evaluate(1.0 + i, w.view()):
            assert not isinstance(action, UsePath) or action.relay in {"r", "s", None}


def test_a_pair_on_an_asked_relay_keeps_its_leg_known_however_long_the_rotation():
    # 21 chooser pairs, one asked a second: the rotation takes 21 s, longer than an answer counts (15 s);
    # b's pair, on r through an asked leg, is asked first whenever it is due, and for r first, even once
    # another relay s ranks better (with ask_legs = 1, s is never asked while b is on r)
    w, core = hidden_world(), Paths("a", ask_legs=1, ask_per_round=1, ask_interval_s=10.0, legs_ttl_s=15.0)
    others = [f"c{i:02d}" for i in range(20)]
    w.add(*others)
    for p in others:
        w.link("a", p, 100)
    w.add("s")
    w.own["s"] = 25
    w.coords[("s", "b")] = 60.0  # r: 20 + 35, s: 25 + 60
    asked_b = []
    for t in range(120):
        if t == 30:
            w.coords[("s", "b")] = 1.0  # s ranks first from now on
        for action in core.evaluate(float(t), w.view()):
            if isinstance(action, AskLegs) and action.peer == "b":
                asked_b.append((t, action.relays))
                assert core.legs_answered(t + 0.5, "b", {"r": 30.0} if "r" in action.relays else {}) is None
        if t >= 3:
            assert core.path("b") == "r", t
    assert asked_b[0] == (0, ("r",)) and all(relays == ("r",) for _, relays in asked_b)
    assert [t for t, _ in asked_b] == list(range(0, 120, 10))


def test_a_busy_pair_is_not_moved_for_latency_its_own_queues_raise():
    """A relayed all-reduce queues on the relay's legs: they measure slower than the idle direct
    path, but the pair stays relayed while busy (else it would go direct, load it, and come
    back); once idle, the rule applies again."""
    w, core = detour_world(), Paths("a")
    assert run(core, w, STABLE_ROUNDS)[-1] == [UsePath(peer="b", relay="r")]
    w.busy.add("b")
    w.link("a", "r", 90)  # our own packets queue on the legs: 90 + 30 > 0.95 x 120
    assert run(core, w, 10, 10.0) == [[]] * 10
    info = core.explain("b", w.view(), now=20.0)
    assert core.path("b") == "r" and info["busy"] and info["hysteresis"]["rounds"] == 0
    w.busy.clear()  # the transfer ended and the legs are still slow: now it moves
    assert run(core, w, STABLE_ROUNDS, 30.0)[-1] == [UsePath(peer="b", relay=None)]


def test_a_busy_direct_pair_is_not_moved_to_a_relay_but_a_failure_still_moves_a_busy_one():
    w, core = detour_world(), Paths("a")
    w.busy.add("b")
    assert run(core, w, 2 * STABLE_ROUNDS) == [[]] * (2 * STABLE_ROUNDS) and core.path("b") is None
    w.busy.clear()
    assert run(core, w, STABLE_ROUNDS, 10.0)[-1] == [UsePath(peer="b", relay="r")]
    w.busy.add("b")
    w.failing.add("r")  # the relay stopped answering: back to direct at once, busy or not
    assert core.evaluate(20.0, w.view()) == [UsePath(peer="b", relay=None)]


def test_a_busy_relayed_pair_is_not_the_one_evicted_at_the_cap():
    """At the cap a bigger gain evicts the weakest relayed pair, but never a busy one: moving it
    would disturb its transfer (the newcomer waits, direct)."""
    w, core = World("a"), Paths("a", max_relayed=1)
    w.add("b", "c", "r")
    w.link("a", "b", 120)
    w.link("a", "r", 20)
    w.link("r", "b", 30)  # b: 120 direct, 50 through r (gain 70)
    w.link("a", "c", 60)
    w.link("r", "c", 30)  # c: 60 direct, 50 through r (gain 10)
    w.link("b", "c", 80)
    w.peers.discard("b")
    assert run(core, w, STABLE_ROUNDS)[-1] == [UsePath(peer="c", relay="r")]
    w.peers.add("b")
    w.busy.add("c")
    assert run(core, w, 2 * STABLE_ROUNDS, 10.0) == [[]] * (2 * STABLE_ROUNDS)
    assert core.paths() == {"c": "r"}
    w.busy.clear()  # the transfer ended: now the bigger gain takes the place
    assert core.evaluate(20.0, w.view()) == [UsePath(peer="c", relay=None), UsePath(peer="b", relay="r")]
