"""vivaldi/coordinates: serf's Vivaldi (its unit cases and its performance_test.go scenarios),
the safeguards (bad RTTs, NaN reset), hostile coordinates from the wire, and what a hostile
member's well-formed samples can do to a converged node (the bounds on weight, force and
plausibility)."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.vivaldi.coordinates import DEFAULT, MAX_COMPONENT, MAX_RTT, Client, Config, Coordinate, origin

C3 = Config(dimensionality=3)


def coord(vec, *, error=1.5, adjustment=0.0, height=10.0e-6) -> Coordinate:
    return Coordinate(vec=tuple(float(x) for x in vec), error=error, adjustment=adjustment, height=height)


def test_defaults_are_serfs():
    """coordinate/config.go DefaultConfig."""
    assert (DEFAULT.dimensionality, DEFAULT.vivaldi_error_max, DEFAULT.vivaldi_ce, DEFAULT.vivaldi_cc,
            DEFAULT.adjustment_window_size, DEFAULT.height_min, DEFAULT.latency_filter_size,
            DEFAULT.gravity_rho) == (8, 1.5, 0.25, 0.25, 20, 10.0e-6, 3, 150.0)
    assert origin() == coord([0.0] * 8)
    assert Client().coordinate == origin()


@pytest.mark.parametrize("field, value", [("dimensionality", 0), ("latency_filter_size", 0),
                                          ("adjustment_window_size", -1), ("vivaldi_cc", math.nan),
                                          ("gravity_rho", 0.0), ("height_min", -1.0), ("vivaldi_ce", 1.5),
                                          ("peer_error_share", -0.1), ("force_rtt_min", 0.0),
                                          ("implausible_slack", math.inf), ("implausible_reset", 1)])
def test_a_bad_config_is_refused(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        replace(DEFAULT, **{field: value})


# serf coordinate_test.go TestCoordinate_DistanceTo: (c1 changes, c2 changes, expected seconds)
BASE = 4.104875150354758
DISTANCES = [
    ({}, {}, BASE),
    ({"adjustment": -1.0e6}, {}, BASE),  # a negative total adjustment is ignored
    ({"adjustment": 0.1}, {"adjustment": 0.2}, BASE + 0.3),
    ({"adjustment": 0.1, "height": 0.7}, {"adjustment": 0.2, "height": 0.1}, BASE + 0.3 + 0.8),
]


@pytest.mark.parametrize("one, two, expected", DISTANCES)
def test_distance(one, two, expected):
    c1 = replace(coord([-0.5, 1.3, 2.4]), **({"height": 0.0} | one))
    c2 = replace(coord([1.2, -2.3, 3.4]), **({"height": 0.0} | two))
    assert c1.distance_to(c2) == pytest.approx(expected, abs=1e-9)
    assert c2.distance_to(c1) == pytest.approx(expected, abs=1e-9)
    assert c1.distance_to(c1) == pytest.approx(2 * c1.height + (2 * c1.adjustment if c1.adjustment > 0 else 0))


def test_distance_needs_one_dimensionality():
    with pytest.raises(ValueError, match="dimensions"):
        coord([0, 0, 0]).distance_to(coord([0, 0]))


def test_update_moves_away_from_a_peer_further_than_it_looks():
    """serf TestClient_Update: a peer 1 ms straight above, measured at 2 ms: we move down."""
    client = Client(C3)
    c = client.update("node", coord([0.0, 0.0, 0.001]), 0.002)
    assert c is not None and c.vec[2] < 0.0
    assert client.coordinate == c and client.updates == 1
    assert client.estimate(coord([0.0, 0.0, 0.001])) == c.distance_to(coord([0.0, 0.0, 0.001]))


def test_latency_filter_takes_the_median_of_the_last_three():
    """serf TestClient_latencyFilter: a blip never reaches Vivaldi; peers are not coupled;
    forget() drops a peer's samples."""
    client = Client()
    steps = [(0.201, 0.201), (0.200, 0.201), (0.207, 0.201), (1.9, 0.207), (0.203, 0.207), (0.199, 0.203),
             (0.211, 0.203)]
    for rtt, median in steps:
        assert client._filter("alice", rtt) == median
    assert client._filter("bob", 0.310) == 0.310
    client.forget("alice")
    assert client._filter("alice", 0.888) == 0.888
    client.forget("nobody")  # unknown: nothing to do


@pytest.mark.parametrize("rtt", [0, 0.0, -35, -1e-9, 10.000001, 11, 2**63 - 1, math.nan, math.inf, -math.inf,
                                 True, "0.1", None])
def test_an_rtt_outside_0_to_10_s_is_rejected_and_counted(rtt):
    """serf TestClient_InvalidInPingValues: the estimate does not move."""
    client = Client(C3)
    other = coord([0.0, 0.0, 0.001])
    before = client.estimate(other)
    assert client.update("node", other, rtt) is None
    assert client.estimate(other) == before and client.coordinate == origin(C3)
    assert client.rejections == {"rtt": 1} and client.rejected == 1 and client.updates == 0
    assert client._filters == {}  # a refused sample never enters the filter


def test_the_longest_rtt_allowed_is_10_s():
    assert Client(C3).update("node", coord([0.0, 0.0, 0.001]), MAX_RTT) is not None


@pytest.mark.parametrize("other", [
    coord([0.0, 0.0]),  # another dimensionality
    coord([math.nan, 0.0, 0.0]),
    coord([0.0, math.inf, 0.0]),
    coord([0.0, 0.0, 0.0], error=math.nan),
    coord([0.0, 0.0, 0.0], height=math.inf),
    coord([0.0, 0.0, 0.0], adjustment=-math.inf),
    coord([MAX_COMPONENT * 2, 0.0, 0.0]),
    coord([0.0, 0.0, 0.0], height=0.0),
    coord([0.0, 0.0, 0.0], error=-0.1),
    None, [0.0, 0.0, 0.0, 0.001, 0.5, 0.0],  # not a Coordinate at all
])
def test_a_bad_peer_coordinate_is_rejected_and_counted(other):
    """serf TestClient_NaN_Defense (first half): an invalid or alien coordinate never enters."""
    client = Client(C3)
    assert client.update("node", other, 0.25) is None
    assert client.coordinate == origin(C3)
    assert client.rejections == {"coordinate": 1}


def test_a_nan_inside_resets_the_client_and_is_counted():
    """serf TestClient_NaN_Defense (second half): poisoned state resets on the next update."""
    client = Client(C3)
    client._coord = coord([math.nan, 0.0, 0.0])
    c = client.update("node", origin(C3), 0.25)
    assert c == origin(C3) and client.coordinate == origin(C3)
    assert client.resets == 1 and client.updates == 0
    # and it goes on from there
    assert client.update("node", coord([0.0, 0.0, 0.01]), 0.02) is not None and client.updates == 1


def test_a_result_the_wire_would_refuse_resets_too():
    """Our coordinate goes out in our record: it is never one the others refuse."""
    client = Client(C3)
    client._coord = coord([MAX_COMPONENT - 1e-3, 0.0, 0.0], error=1.5)
    client.update("node", coord([MAX_COMPONENT - 2e-3, 0.0, 0.0], error=0.0), MAX_RTT)  # pushed past the bound
    assert client.resets == 1 and client.coordinate == origin(C3)


WIRE = st.lists(st.floats(-MAX_COMPONENT, MAX_COMPONENT), min_size=3, max_size=3)
PEER = st.builds(lambda vec, h, e, a: coord(vec, height=h, error=e, adjustment=a), WIRE,
                 st.floats(10.0e-6, 10.0), st.floats(0.0, 1.5), st.floats(-10.0, 10.0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), PEER, st.floats(1e-9, MAX_RTT)), min_size=1, max_size=40))
def test_no_peer_can_make_our_coordinate_unsendable(samples):
    """Hostile but well-formed coordinates and RTTs: ours always passes from_wire. Each is used,
    resets us, or is dropped as implausible (its estimate absurd against its RTT)."""
    client = Client(C3, seed=1)
    for peer, other, rtt in samples:
        client.update(peer, other, rtt)
        mine = client.coordinate
        assert Coordinate.from_wire(mine.to_wire(), 3) == mine
    assert client.updates + client.resets + client.rejected == len(samples)
    assert set(client.rejections) <= {"implausible"}


def test_wire_round_trip():
    c = Coordinate(vec=tuple(0.01 * i for i in range(8)), error=0.3, adjustment=-0.002, height=0.004)
    assert c.to_wire() == [*c.vec, 0.004, 0.3, -0.002]
    assert Coordinate.from_wire(c.to_wire()) == c
    assert Coordinate.from_wire([0] * 8 + [1, 1, 0]) == coord([0.0] * 8, height=1.0, error=1.0)  # ints are numbers


GOOD = [0.0] * 8 + [0.001, 0.5, 0.0]


def _with(i, value):
    data = list(GOOD)
    data[i] = value
    return data


@pytest.mark.parametrize("data, problem", [
    (None, "list"), ("abc", "list"), ({"vec": []}, "list"), (b"\x00" * 11, "list"),
    (GOOD[:-1], "11 values"), (GOOD + [0.0], "11 values"), ([], "11 values"),
    (_with(0, "1"), "value 0 is not a number"), (_with(3, None), "value 3"), (_with(8, True), "value 8"),
    (_with(9, [0.5]), "value 9"), (_with(1, 10**400), "value 1 is out of range"),
    (_with(2, math.nan), "component 2 is not finite"), (_with(7, -math.inf), "component 7"),
    (_with(5, 10.5), "component 5"), (_with(5, -1e300), "component 5"),
    (_with(8, math.nan), "height is not finite"), (_with(8, 0.0), "height"), (_with(8, 11.0), "height"),
    (_with(9, math.inf), "error is not finite"), (_with(9, -0.01), "error"), (_with(9, 1.6), "error"),
    (_with(10, math.nan), "adjustment is not finite"), (_with(10, -10.5), "adjustment"),
    (_with(10, 1e308), "adjustment"),
])
def test_from_wire_refuses_what_is_wrong_and_says_what(data, problem):
    with pytest.raises(ValueError, match=problem):
        Coordinate.from_wire(data)


def test_from_wire_checks_the_dimensionality_asked_for():
    assert Coordinate.from_wire([0.0, 0.0, 0.001, 0.5, 0.0], 2) == coord([0.0, 0.0], error=0.5, height=0.001)
    with pytest.raises(ValueError, match="5 values"):
        Coordinate.from_wire(GOOD, 2)


def test_determinism():
    """Same seed, same samples: the same coordinates (the only randomness is the direction two
    coinciding points part in); another seed parts them another way."""
    def run(seed):
        a, b = Client(C3, seed=seed), Client(C3, seed=f"{seed}/b")
        for _ in range(20):
            a.update("b", b.coordinate, 0.05)
            b.update("a", a.coordinate, 0.05)
        return a.coordinate, b.coordinate
    assert run(1) == run(1)
    assert run(1) != run(2)
    one, two = run(1)
    assert one.distance_to(two) == pytest.approx(0.05, rel=0.05)


# serf's phantom.go: topologies (truth matrices, seconds), Simulate and Evaluate.

def line(n, spacing):
    return [[abs(i - j) * spacing for j in range(n)] for i in range(n)]


def grid(n, spacing):
    k = math.isqrt(n)
    return [[math.hypot(i % k - j % k, i // k - j // k) * spacing for j in range(n)] for i in range(n)]


def split(n, lan, wan):
    half = n // 2
    return [[lan + (wan if (i <= half) != (j <= half) else 0.0) for j in range(n)] for i in range(n)]


def circle(n, radius):
    """Nodes 1.. evenly on a circle; node 0 at its centre but 2 * radius from everyone."""
    def at(i):
        t = 2 * math.pi * i / n
        return math.cos(t), math.sin(t)
    return [[2 * radius if 0 in (i, j) else math.dist(at(i), at(j)) * radius for j in range(n)] for i in range(n)]


def gaussian(n, mean, deviation):
    rng = random.Random(1)
    truth = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            truth[i][j] = truth[j][i] = rng.gauss(mean, deviation)
    return truth


def simulate(clients, truth, cycles, seed):
    """Each cycle each client probes a random node (not itself) and learns the true RTT."""
    rng = random.Random(seed)
    for _ in range(cycles):
        for i, client in enumerate(clients):
            j = rng.randrange(len(clients))
            if j != i:
                client.update(f"node_{j}", clients[j].coordinate, truth[i][j])


def evaluate(clients, truth):
    """(mean, max) relative error of the estimates over all pairs."""
    errors = [abs(clients[i].estimate(clients[j].coordinate) - truth[i][j]) / truth[i][j]
              for i in range(len(clients)) for j in range(i + 1, len(clients))]
    return sum(errors) / len(errors), max(errors)


SEEDS = range(7)
SLACK = 1.25
# serf performance_test.go: (topology, config, its ErrorAvg and ErrorMax bounds). serf's
# bounds are the figures of one seeded run plus a small margin, and moved by up to 1.7x when
# Go's random numbers changed (serf #813/#816: "too tight in the face of small changes in the
# toolchain"). Python draws other numbers, and a single run may land in one of Vivaldi's
# local minima (a seed of ``split`` does); so each scenario runs with 7 seeds and the median
# of their figures must be within 1.25x of serf's bounds.
SCENARIOS = {
    "line": (lambda: line(10, 0.010), DEFAULT, 0.0031, 0.0130),
    "grid": (lambda: grid(25, 0.010), DEFAULT, 0.0016, 0.0230),
    "split": (lambda: split(25, 0.001, 0.010), DEFAULT, 0.000060, 0.00048),
    "random": (lambda: gaussian(25, 0.100, 0.010), DEFAULT, 0.075, 0.33),
    "height": (lambda: circle(25, 0.100), Config(dimensionality=2), 0.0028, 0.064),
}


def _runs(name):
    make, config, _, _ = SCENARIOS[name]
    truth = make()
    for seed in SEEDS:
        clients = [Client(config, seed=f"{seed}/{i}") for i in range(len(truth))]
        simulate(clients, truth, 1000, seed)
        yield clients, truth


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_accuracy_as_serf_measures_it(name):
    _, _, avg_bound, max_bound = SCENARIOS[name]
    figures = []
    for clients, truth in _runs(name):
        figures.append(evaluate(clients, truth))
        if name == "height":
            # the centre node is above the plane by its extra radius, the others in it (serf's
            # 0.97 and 0.03 of the radius; over the seeds, as the errors)
            figures[-1] += (clients[0].coordinate.height, max(c.coordinate.height for c in clients[1:]))
    avg, worst = statistics.median(f[0] for f in figures), statistics.median(f[1] for f in figures)
    assert avg <= avg_bound * SLACK and worst <= max_bound * SLACK, (avg, worst, figures)
    if name == "height":
        assert statistics.median(f[2] for f in figures) >= 0.97 * 0.100
        assert statistics.median(f[3] for f in figures) <= 0.03 * 0.100 * SLACK


def test_gravity_pulls_a_drifting_system_back():
    """serf TestPerformance_Drift: four nodes in a square, placed off-centre; after 10,000 more
    cycles the centre of their bounding box is closer to the origin by 20 %."""
    side = 0.5
    clients = [Client(Config(dimensionality=2), seed=f"drift/{i}") for i in range(4)]
    for client, vec in zip(clients, [(0.0, 0.0), (0.0, side), (side, side), (side, side)]):
        client._coord = replace(client.coordinate, vec=vec)
    truth = [[(math.sqrt(2) if i % 2 == 0 and j % 2 == 0 else 1.0) * side for j in range(4)] for i in range(4)]

    def centre_error():
        vecs = [c.coordinate.vec for c in clients]
        return math.hypot(*((min(v[k] for v in vecs) + max(v[k] for v in vecs)) / 2 for k in range(2)))

    simulate(clients, truth, 1000, 1)
    baseline = centre_error()
    simulate(clients, truth, 10000, 2)
    assert centre_error() <= 0.8 * baseline


# A hostile member (module header, "A hostile peer"). SERF_RULE is serf's update without the
# bounds (the height's own bound aside), to show what each attack did before them.

SERF_RULE = replace(DEFAULT, peer_error_share=0.0, force_rtt_min=1e9, implausible_slack=1e9)
HONEST = grid(25, 0.050)  # 5 x 5 at 50 ms: RTTs of 50-283 ms, internet-like


def _step_bound(rtt, config=DEFAULT):
    """The most one sample moves our point or our height: vivaldi_cc * 4/5 * max(rtt, 100 ms);
    1e-5 s for gravity's pull in the same update."""
    return config.vivaldi_cc * 4 / 5 * max(rtt, config.force_rtt_min) + 1e-5


def _attack(config, liar, rtt, *, every=1, rounds=500):
    """A converged honest swarm (HONEST, 1,000 cycles) goes on probing; node 0 also takes a
    sample of ``liar`` (a Coordinate, or a function of node 0's coordinate) after every
    ``every``-th of its rounds. Returns (node 0, its converged coordinate, the largest move of
    point or height one liar sample made, the worst median relative error of node 0's estimates
    of the honest nodes, the largest move of point or height from the converged coordinate)."""
    clients = [Client(config, seed=f"attack/{i}") for i in range(len(HONEST))]
    simulate(clients, HONEST, 1000, 1)
    victim, start = clients[0], clients[0].coordinate
    rng = random.Random(5)
    step = worst_error = moved = 0.0
    for r in range(rounds):
        for i, client in enumerate(clients):
            j = rng.randrange(len(clients))
            if j != i:
                client.update(f"node_{j}", clients[j].coordinate, HONEST[i][j])
            if i == 0 and r % every == 0:
                before = victim.coordinate
                victim.update("liar", liar(before) if callable(liar) else liar, rtt)
                after = victim.coordinate
                step = max(step, math.dist(before.vec, after.vec), abs(before.height - after.height))
        now = victim.coordinate
        moved = max(moved, math.dist(now.vec, start.vec), abs(now.height - start.height))
        worst_error = max(worst_error, statistics.median(
            abs(victim.estimate(c.coordinate) - HONEST[0][j]) / HONEST[0][j] for j, c in enumerate(clients) if j))
    return victim, start, step, worst_error, moved


AT_THE_BOUNDS = Coordinate(vec=(MAX_COMPONENT,) * 8, height=10.0, adjustment=10.0, error=0.0)
FAR_AWAY = Coordinate(vec=(1.0,) * 8, height=0.5, adjustment=0.0, error=0.0)  # 3.3 s from everyone


@pytest.mark.parametrize("liar, rtt", [(AT_THE_BOUNDS, 0.5), (FAR_AWAY, 0.05)], ids=["at-the-bounds", "far-away"])
def test_a_member_at_the_wire_bounds_or_far_away_never_moves_us(liar, rtt):
    """Fed every other sample for 500 rounds (its RTT delayed to the probes' 0.5 s, or a true
    50 ms), claiming error 0: each of its samples is dropped and counted as implausible, we never
    reset, and we stay within 2 ms of where we had converged (1.2 ms: the honest swarm's own
    jitter). Under serf's rule the first resets us 115 times (28 s moves), the second carries us
    2.6 s away; each makes our estimates of the honest nodes several times too large."""
    victim, start, step, worst_error, moved = _attack(DEFAULT, liar, rtt)
    assert victim.rejections == {"implausible": 500} and victim.resets == 0
    assert step < 1e-4 and moved < 0.002 and worst_error < 0.01
    victim, start, step, worst_error, moved = _attack(SERF_RULE, liar, rtt)
    assert worst_error > 5 and moved > 2.0 and victim.rejected == 0
    assert (victim.resets > 100) == (liar is AT_THE_BOUNDS)


def _offset(coordinate, seconds, **fields):
    """A liar ``seconds`` from ``coordinate`` along the first axis, claiming error 0."""
    return Coordinate(vec=(coordinate.vec[0] + seconds, *coordinate.vec[1:]),
                      **({"height": 10.0e-6, "adjustment": 0.0, "error": 0.0} | fields))


def test_a_liar_claiming_error_0_moves_us_one_bounded_step_per_sample():
    """A plausible liar (1 s from where we converged, measured at 50 ms, claiming error 0) in
    one of our 25 samples, as a member of a 25-node swarm gets by round-robin, for 12,000
    rounds (500 of its samples): each of its samples moves our point and height by at most
    20 ms (vivaldi_cc * 4/5 * 100 ms; serf's rule: 237 ms), we never reset, and our estimates
    of the honest nodes stay within 25 % (median; 20 % here, and 11 % over the first 40 of its
    samples). Under serf's rule they are 110 % off within those 40. It is plausible (1 s < 10 x
    50 ms + 1 s), so it is not dropped, and it still drags us, slowly (232 ms by the end): the
    bounds are per sample; our honest samples are what pull us back."""
    liar = _offset(_converged_victim(), 1.0)
    victim, start, step, worst_error, moved = _attack(DEFAULT, liar, 0.05, every=24, rounds=12_000)
    assert step <= _step_bound(0.05) and victim.resets == 0 and victim.rejected == 0
    assert worst_error < 0.25 and moved < 0.3
    victim, start, step, worst_error, moved = _attack(SERF_RULE, liar, 0.05, every=24, rounds=960)
    assert step > 0.2 and worst_error > 1.0


def _converged_victim():
    clients = [Client(DEFAULT, seed=f"attack/{i}") for i in range(len(HONEST))]
    simulate(clients, HONEST, 1000, 1)
    return clients[0].coordinate


def test_an_adaptive_liar_beside_us_is_bounded_per_sample_only():
    """The limit of these bounds: a liar that places itself, at every sample, right beside our
    current coordinate with a large height (plausible: 1 s at 50 ms), or on top of us with its
    answers delayed to 0.5 s, is never dropped. Each sample still moves us by at most one step
    (20 ms, or 100 ms at 0.5 s: a fifth of the RTT), and we never reset. As every other of our
    samples for 200 rounds, far more than a member gets, they still carry us off: 355 ms and
    85 % median error beside us (serf's rule: 1.5 s, 396 %), 503 ms and 378 % on top (serf's:
    476 ms, 289 %). A push away is bounded by the RTT, which a member can delay."""
    beside = _attack(DEFAULT, lambda me: _offset(me, 2.0e-6, height=1.0), 0.05, rounds=200)
    on_top = _attack(DEFAULT, lambda me: _offset(me, 1.0e-3, adjustment=-10.0), 0.5, rounds=200)
    for (victim, _, step, _, _), rtt in ((beside, 0.05), (on_top, 0.5)):
        assert step <= _step_bound(rtt) and victim.resets == 0 and victim.rejected == 0


def test_a_peer_claiming_error_0_weighs_four_fifths_not_one():
    """serf's weight e_me / (e_me + e_peer) is 1 for a peer claiming error 0; ours floors the
    peer's error at a quarter of ours: 4/5. A peer 1 ms above us measured at 2 ms pushes us down by
    vivaldi_cc * weight * (2 ms - 1.02 ms)."""
    peer = coord([0.0, 0.0, 0.001], error=0.0)
    for config, weight in ((C3, 4 / 5), (replace(C3, peer_error_share=0.0), 1.0)):
        client = Client(config)
        moved = client.update("node", peer, 0.002)
        assert moved.vec[2] == pytest.approx(-0.25 * weight * (0.002 - 0.001 - 2 * 10.0e-6), rel=1e-3)
    honest = coord([0.0, 0.0, 0.001], error=1.5)  # as unsure as we are: serf's 1/2, untouched
    assert Client(C3).update("node", honest, 0.002).vec[2] == pytest.approx(-0.25 * 0.5 * 0.00098, rel=1e-3)


NEAR = st.builds(lambda me, d, h, e, a: (me, coord([x + y for x, y in zip(me, d)], height=h, error=e, adjustment=a)),
                 st.lists(st.floats(-0.3, 0.3), min_size=3, max_size=3),
                 st.lists(st.floats(-1e-3, 1e-3), min_size=3, max_size=3),
                 st.floats(10.0e-6, 10.0), st.floats(0.0, 1.5), st.floats(-10.0, 10.0))
ANYWHERE = st.builds(lambda me, other: (me, other), st.lists(st.floats(-0.3, 0.3), min_size=3, max_size=3), PEER)


@settings(max_examples=300, deadline=None)
@given(st.one_of(NEAR, ANYWHERE), st.floats(0.1, 1.5), st.floats(1e-4, 1.0))
def test_one_sample_moves_us_by_one_step_at_most(us_and_peer, error, rtt):
    """Any well-formed peer coordinate (anywhere within the wire bounds, or just beside us, any
    height, error and adjustment) and any RTT up to 1 s, against a coordinate an honest swarm
    could hold: the sample is dropped as implausible, or it moves our point and our height by at
    most vivaldi_cc * 4/5 * max(rtt, 100 ms) and puts at most max(rtt, 100 ms) / 40 into our
    adjustment (serf's rule: up to 12 s and 1 s); never a reset."""
    me, other = us_and_peer
    client = Client(C3, seed=2)
    client._coord = before = coord(me, error=error, height=0.005)
    after = client.update("peer", other, rtt)
    assert client.resets == 0
    if after is None:
        assert client.rejections == {"implausible": 1} and before.distance_to(other) > 10 * rtt + 1.0
        return
    assert math.dist(before.vec, after.vec) <= _step_bound(rtt, C3)
    assert abs(after.height - before.height) <= _step_bound(rtt, C3)
    assert abs(after.adjustment) <= max(rtt, C3.force_rtt_min) / 40 + 1e-12


def test_implausible_samples_from_5_peers_in_a_row_reset_us_and_we_converge_again():
    """Our own coordinate far off (5 s out, as a node before these bounds could be left): every
    honest peer's estimate is absurd, so each sample is dropped; the fifth peer in a row makes us
    the odd one out, we reset to the origin and converge like a new node. One peer alone, or
    peers with a plausible sample between them, never reset us."""
    clients = [Client(DEFAULT, seed=f"attack/{i}") for i in range(len(HONEST))]
    simulate(clients, HONEST, 1000, 1)
    victim = clients[0]
    victim._coord = replace(victim.coordinate, vec=(5.0,) + victim.coordinate.vec[1:])
    for j in range(1, 5):
        assert victim.update(f"node_{j}", clients[j].coordinate, HONEST[0][j]) is None
    assert victim.resets == 0 and victim.rejections == {"implausible": 4}
    assert victim.update("node_5", clients[5].coordinate, HONEST[0][5]) == origin()
    assert victim.resets == 1 and victim.rejections == {"implausible": 5}
    simulate(clients, HONEST, 200, 2)
    assert statistics.median(abs(victim.estimate(c.coordinate) - HONEST[0][j]) / HONEST[0][j]
                             for j, c in enumerate(clients) if j) < 0.05
    assert victim.resets == 1

    client = Client(C3)
    for _ in range(20):
        client.update("liar", coord([MAX_COMPONENT] * 3, error=0.0), 0.05)
    for peer in "abc":  # with "liar": 4 peers in a row
        client.update(peer, coord([MAX_COMPONENT] * 3, error=0.0), 0.05)
    client.update("honest", coord([0.0, 0.0, 0.01]), 0.02)  # plausible: the row is broken
    for peer in "efgh":
        client.update(peer, coord([MAX_COMPONENT] * 3, error=0.0), 0.05)
    assert client.resets == 0 and client.rejections == {"implausible": 27} and client.updates == 1
