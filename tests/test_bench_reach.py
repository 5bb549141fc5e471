"""The reach bench's pure parts: the census weighting, the percentiles, a pair's outcome (the lab
run itself is `SWARMD_BENCH_ONLY=reach python -m bench`, as root)."""

import itertools
import statistics

import pytest

from bench.reach import (APDF, CENSUS, CLASSES, EDM, EIM, FIREWALL, PUBLIC, class_matrix, classify, edm_share_at,
                         heal_time, normalised, percentile, theory_direct, weight_from_theory, weighted_direct_share)

ALL_DIRECT = {frozenset((a, b)): True for a, b in itertools.combinations_with_replacement(CLASSES, 2)}


def test_theory_relays_only_a_symmetric_nat_against_port_filtering_or_another_symmetric_nat():
    relayed = {frozenset((a, b)) for a, b in itertools.combinations_with_replacement(CLASSES, 2)
               if not theory_direct(a, b)}
    assert relayed == {frozenset((EDM, APDF)), frozenset((EDM, FIREWALL)), frozenset((EDM,))}


@pytest.mark.parametrize(("weights", "share"), [
    ({PUBLIC: 1.0}, 1.0),
    ({EDM: 1.0}, 0.0),  # every pair edm-edm
    ({PUBLIC: 1.0, EDM: 1.0}, 0.75),  # a quarter of the pairs are edm-edm
    ({APDF: 1.0, EDM: 1.0}, 0.25),  # only apdf-apdf
    ({EIM: 3.0, EDM: 1.0}, 1 - 1 / 16),  # scale-free: weights need not sum to 1
])
def test_the_direct_share_weighs_each_class_pair_by_both_ends_shares(weights, share):
    direct, _ = class_matrix({})
    assert weighted_direct_share(weights, direct) == pytest.approx(share)


def test_the_census_share_is_one_minus_the_relayed_class_pairs():
    direct, _ = class_matrix({})
    w = normalised(CENSUS)
    expected = 1 - (w[EDM] ** 2 + 2 * w[EDM] * w[APDF])
    assert weighted_direct_share(CENSUS, direct) == pytest.approx(expected)
    assert 0.8 < expected < 0.9  # 21 / 64 / 11: the conservative split is below the 95 % target


def test_a_measured_pair_overrides_theory_and_unmeasured_ones_are_reported():
    measured = {frozenset((PUBLIC,)): True, frozenset((EDM, EIM)): False}
    direct, from_theory = class_matrix(measured)
    assert direct[frozenset((EDM, EIM))] is False  # what the lab saw wins
    assert frozenset((EDM, EIM)) not in from_theory and frozenset((EIM,)) in from_theory
    assert len(direct) == len(CLASSES) * (len(CLASSES) + 1) // 2
    assert weight_from_theory({PUBLIC: 1.0}, from_theory) == 0.0
    assert weight_from_theory({PUBLIC: 1.0, EIM: 1.0}, from_theory) == pytest.approx(0.75)


def test_the_break_even_symmetric_share_gives_the_target_exactly():
    direct, _ = class_matrix({})
    rest = {PUBLIC: 21.0, APDF: 64.0}
    e = edm_share_at(0.95, direct, rest)
    w = normalised(rest)
    assert weighted_direct_share({PUBLIC: (1 - e) * w[PUBLIC], APDF: (1 - e) * w[APDF], EDM: e},
                                 direct) == pytest.approx(0.95, abs=1e-9)
    assert edm_share_at(0.95, ALL_DIRECT, rest) == pytest.approx(1.0)


def test_weights_are_checked():
    for bad in ({PUBLIC: -1.0}, {PUBLIC: float("nan")}, {PUBLIC: 0.0}):
        with pytest.raises(ValueError):
            normalised(bad)


@pytest.mark.parametrize("q", [5, 25, 50, 90, 95, 99])
def test_percentiles_match_statistics_inclusive_quantiles(q):
    xs = [3.1, 0.0, 7.5, 2.2, 9.9, 4.0, 4.0, 1.25]
    assert percentile(xs, q) == pytest.approx(statistics.quantiles(xs, n=100, method="inclusive")[q - 1])


def test_percentiles_at_the_edges():
    assert percentile([], 50) is None
    assert percentile([4.2], 95) == 4.2
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    assert percentile([1.0, 3.0], 50) == 2.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_a_pairs_outcome():
    assert classify("direct", "direct", True) == "direct"
    assert classify("via ab12cd34 (symmetric NAT)", "direct", True) == "relayed"
    assert classify("direct", "direct", False) == "failed"
    assert classify(None, None, True) == "relayed"  # reached, but not direct at both ends


def test_heal_time_is_zero_when_the_path_came_before_the_records():
    assert heal_time(10.0, 12.5) == 2.5
    assert heal_time(10.0, 8.0) == 0.0
    assert heal_time(None, 8.0) is None and heal_time(10.0, None) is None
