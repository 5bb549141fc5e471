"""Group formation by latency (swarmd/compute/groups.py): complete linkage under a threshold."""

import itertools
import math
import random
import time

import pytest

from swarmd.compute import groups


def regions(*sizes: int, inside: float = 5.0, between: float = 150.0):
    """Hosts in regions: ``inside`` ms within one, ``between`` ms across."""
    nodes, region = [], {}
    for r, size in enumerate(sizes):
        for i in range(size):
            name = f"r{r}h{i}"
            nodes.append(name)
            region[name] = r
    return nodes, lambda a, b: inside if region[a] == region[b] else between


def test_two_regions_make_two_groups_and_one_region_one():
    nodes, rtt = regions(3, 3)
    assert groups.form(nodes, rtt) == ((0, 1, 2), (3, 4, 5))
    nodes, rtt = regions(4)
    assert groups.form(nodes, rtt) == ((0, 1, 2, 3),)
    assert groups.form([], rtt) == ()


def test_interleaved_ranks_group_by_region_in_rank_order():
    nodes, rtt = regions(3, 3)
    shuffled = [nodes[i] for i in (3, 0, 4, 1, 5, 2)]
    assert groups.form(shuffled, rtt) == ((0, 2, 4), (1, 3, 5))


def test_a_chain_of_short_hops_never_spans_a_slow_link():
    """a-b 20 ms, b-c 20 ms, a-c 40 ms with a 30 ms cap: single linkage would join all three."""
    table = {("a", "b"): 20.0, ("b", "c"): 20.0, ("a", "c"): 40.0}
    rtt = lambda x, y: table.get((x, y)) or table.get((y, x))  # noqa: E731
    assert groups.form(["a", "b", "c"], rtt, max_rtt_ms=30) == ((0, 1), (2,))
    assert groups.form(["a", "b", "c"], rtt, max_rtt_ms=40) == ((0, 1, 2),)


def test_the_closest_pair_merges_first():
    """b-c 2 ms beats a-b 10 ms: b joins c, and a, 35 ms from c, stays alone under a 30 ms cap."""
    table = {("a", "b"): 10.0, ("b", "c"): 2.0, ("a", "c"): 35.0}
    rtt = lambda x, y: table.get((x, y)) or table.get((y, x))  # noqa: E731
    assert groups.form(["a", "b", "c"], rtt) == ((0,), (1, 2))


@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -1.0, True, "5"])
def test_an_unknown_or_malformed_rtt_never_joins_a_group(bad):
    rtt = lambda x, y: bad if {x, y} == {"a", "c"} else 5.0  # noqa: E731
    assert groups.form(["a", "b", "c"], rtt) == ((0, 1), (2,))


def test_a_pair_counts_as_its_slower_reading():
    """A member reporting a 1 ms RTT to a host 150 ms away cannot pull it into its group."""
    rtt = lambda x, y: 1.0 if (x, y) == ("a", "b") else 150.0  # noqa: E731
    assert groups.form(["a", "b"], rtt) == ((0,), (1,))
    one_way = lambda x, y: 4.0 if (x, y) == ("a", "b") else None  # noqa: E731
    assert groups.form(["a", "b"], one_way) == ((0, 1),), "measured one way only: that reading"


def test_the_answer_is_the_same_whatever_the_order_ties_are_met_in():
    nodes, rtt = regions(2, 2, inside=5.0, between=5.0)
    assert groups.form(nodes, rtt, max_rtt_ms=5) == ((0, 1, 2, 3),)
    assert groups.form(nodes, rtt, max_rtt_ms=4.9) == ((0,), (1,), (2,), (3,))


def test_no_group_spans_a_link_slower_than_the_cap_on_random_matrices():
    rng = random.Random(7)
    for trial in range(200):
        n = rng.randint(1, 12)
        nodes = [f"n{i}" for i in range(n)]
        table = {frozenset(p): rng.choice([None, rng.uniform(0, 200)]) for p in itertools.combinations(nodes, 2)}
        rtt = lambda a, b: table[frozenset((a, b))]  # noqa: E731
        cap = rng.uniform(0, 150)
        out = groups.form(nodes, rtt, max_rtt_ms=cap)
        assert sorted(i for g in out for i in g) == list(range(n)), "every node in exactly one group"
        assert [g[0] for g in out] == sorted(g[0] for g in out) and all(list(g) == sorted(g) for g in out)
        assert groups.check([list(g) for g in out], n) == out  # what a record carries, a successor takes
        for g in out:
            for i, j in itertools.combinations(g, 2):
                assert table[frozenset((nodes[i], nodes[j]))] is not None
                assert table[frozenset((nodes[i], nodes[j]))] <= cap, (trial, out)
        # maximal: no two groups could still merge under the cap
        for a, b in itertools.combinations(out, 2):
            links = [table[frozenset((nodes[i], nodes[j]))] for i in a for j in b]
            assert any(x is None or x > cap for x in links), (trial, out)


@pytest.mark.parametrize("bad", [None, [], [[]], [[0], [0]], [[0, 2]], [[1, 0]], [[1], [0]], [[0], [1], [2]],
                                 [[0.0], [1]], [[False], [1]], [["0"], [1]], "01", {0: [0]}])
def test_groups_a_member_recorded_are_refused_unless_form_could_have_made_them(bad):
    with pytest.raises(ValueError, match="groups"):
        groups.check(bad, 2)


def test_bad_arguments_are_refused():
    rtt = lambda a, b: 1.0  # noqa: E731
    with pytest.raises(ValueError, match="twice"):
        groups.form(["a", "a"], rtt)
    with pytest.raises(ValueError, match="at most"):
        groups.form([f"n{i}" for i in range(groups.MAX_NODES + 1)], rtt)
    for bad in (math.nan, -1, math.inf, "30"):
        with pytest.raises(ValueError, match="max_rtt_ms"):
            groups.form(["a"], rtt, max_rtt_ms=bad)


def test_the_most_nodes_are_grouped_in_well_under_a_second():
    rng = random.Random(1)
    nodes = [f"n{i}" for i in range(groups.MAX_NODES)]
    region = {n: rng.randrange(6) for n in nodes}
    rtt = lambda a, b: 3.0 if region[a] == region[b] else 120.0  # noqa: E731
    started = time.perf_counter()
    out = groups.form(nodes, rtt)
    assert len(out) == len(set(region.values()))
    assert time.perf_counter() - started < 5.0  # ~0.06 s here: a wide margin for a loaded CI machine
