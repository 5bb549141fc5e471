import math

import pytest

from swarmd.gossip.suspicion import (Awareness, Suspicion, expected_confirmations, suspicion_bounds,
                                     suspicion_timeout)


@pytest.mark.parametrize("members, interval, mult, max_mult, low", [
    (0, 1.0, 4.0, 6.0, 4.0),  # an empty view counts as one member, log10 floored at 1
    (1, 1.0, 4.0, 6.0, 4.0),
    (5, 1.0, 4.0, 6.0, 4.0),  # log10(5) < 1: small swarms get the floor
    (10, 1.0, 4.0, 6.0, 4.0),
    (50, 1.0, 4.0, 6.0, 4.0 * math.log10(50)),
    (100, 1.0, 4.0, 6.0, 8.0),
    (1000, 0.5, 4.0, 6.0, 6.0),
    (100, 0.2, 5.0, 3.0, 2.0),
])
def test_suspicion_bounds_scale_with_log10_of_the_swarm(members, interval, mult, max_mult, low):
    got_low, got_high = suspicion_bounds(members, interval, mult, max_mult)
    assert got_low == pytest.approx(low)
    assert got_high == pytest.approx(low * max_mult)


@pytest.mark.parametrize("members, cap, low", [
    (5, 1.4, 2.0),  # a lab's swarm: under the cap, unchanged
    (25, 1.4, 2.0 * math.log10(25)),
    (2000, 1.4, 2.8),  # not memberlist's 6.6 s
    (100_000, 1.4, 2.8),
    (2000, math.inf, 2.0 * math.log10(2000)),
])
def test_the_log10_factor_stops_at_its_cap(members, cap, low):
    got_low, got_high = suspicion_bounds(members, 0.5, 4.0, 6.0, cap)
    assert got_low == pytest.approx(low) and got_high == pytest.approx(6 * low)


@pytest.mark.parametrize("members, mult, k", [
    (100, 4.0, 2),  # memberlist: K = SuspicionMult - 2
    (4, 4.0, 2),  # n - 2 == K: just enough other members to confirm
    (3, 4.0, 0),  # n - 2 < K: not enough members to ever reach K, so do not wait for them
    (1, 4.0, 0),
    (0, 4.0, 0),
    (100, 5.0, 3),
    (100, 4.9, 2),  # the multiplier is truncated, as memberlist's integer one
    (100, 2.0, 0),
])
def test_expected_confirmations(members, mult, k):
    assert expected_confirmations(members, mult) == k


# memberlist's suspicion_test.go TestSuspicion_remainingSuspicionTime, as timeouts (min 2 s, max 30 s)
@pytest.mark.parametrize("confirmations, k, timeout", [
    (0, 3, 30.0),
    (1, 3, 30.0 - 28.0 * math.log(2) / math.log(4)),  # 16 s
    (2, 3, 30.0 - 28.0 * math.log(3) / math.log(4)),  # about 7.81 s
    (3, 3, 2.0),  # K confirmations reach the minimum
    (4, 3, 2.0),  # and more never go below it
    (5, 3, 2.0),
    (0, 0, 2.0),  # K == 0: no confirmations expected, the minimum from the start
    (7, 0, 2.0),
    (0, -1, 2.0),
])
def test_suspicion_timeout_table(confirmations, k, timeout):
    assert suspicion_timeout(confirmations, k, 2.0, 30.0) == pytest.approx(timeout)


def test_suspicion_timeout_decays_from_max_to_min():
    timeouts = [suspicion_timeout(c, 5, 4.0, 24.0) for c in range(8)]
    assert timeouts[0] == 24.0
    assert all(a > b for a, b in zip(timeouts[:6], timeouts[1:6]))
    assert timeouts[5:] == [4.0, 4.0, 4.0]
    # logarithmic: the first confirmation buys more than the second, and so on
    drops = [a - b for a, b in zip(timeouts[:5], timeouts[1:6])]
    assert all(a > b for a, b in zip(drops, drops[1:]))


def test_first_suspector_is_not_a_confirmation():
    s = Suspicion(started=100.0, k=3, low=2.0, high=30.0, confirmers={"a"})
    assert s.deadline == 130.0
    assert not s.confirm("a")
    assert s.deadline == 130.0
    assert s.confirm("b")
    assert s.deadline == pytest.approx(100.0 + suspicion_timeout(1, 3, 2.0, 30.0))
    assert not s.confirm("b")  # the same confirmer twice is one confirmation
    assert s.confirm("c") and s.confirm("d")
    assert s.deadline == 102.0


def test_suspicion_without_confirmers_waits_the_maximum():
    assert Suspicion(started=5.0, k=2, low=1.0, high=6.0).deadline == 11.0


@pytest.mark.parametrize("deltas, score", [
    ([], 0),
    ([-1], 0),  # clamped at 0: healthy is as good as it gets
    ([+1, +1], 2),
    ([+1, +1, -1], 1),
    ([+100], 7),  # clamped at limit - 1, memberlist's AwarenessMaxMultiplier semantics
    ([+100, -2], 5),
    ([+3, -100, +1], 1),
])
def test_awareness_clamps(deltas, score):
    a = Awareness(limit=8)
    for d in deltas:
        a.apply(d)
    assert a.score == score


@pytest.mark.parametrize("score, scaled", [(0, 0.5), (1, 1.0), (3, 2.0), (7, 4.0)])
def test_awareness_scales_the_interval_by_score_plus_one(score, scaled):
    assert Awareness(limit=8, score=score).scale(0.5) == scaled


def test_awareness_with_limit_one_never_scales():
    a = Awareness(limit=1)
    a.apply(+5)
    assert a.score == 0
    assert a.scale(2.0) == 2.0
