"""The network model: country RTTs, TCP loss as delay, power states, cuts, congestion."""

import pytest

from sim.network import CRASHED, RTO_FLOOR, SAME_SITE_MS, STOPPED, Latency, Network

TABLE = {frozenset(("DE", "US")): 100.0, frozenset(("DE",)): 8.0}


def test_country_latency_uses_the_pairs_and_the_diagonal():
    lat = Latency.countries(["DE", "US", "DE", "US"], TABLE)
    assert lat.rtt(0, 1) == pytest.approx(0.1)
    assert lat.rtt(0, 2) == pytest.approx(0.008)  # the data's diagonal
    assert lat.rtt(1, 3) == pytest.approx(SAME_SITE_MS / 1000)  # none in the data
    assert lat.max_one_way() == pytest.approx(0.05)
    with pytest.raises(ValueError, match="no measured RTT between DE and JP"):
        Latency.countries(["DE", "JP"], TABLE)


def test_the_bundled_data_places_real_countries():
    lat = Latency.countries(["DE", "JP"])
    assert 0.15 < lat.rtt(0, 1) < 0.4


def test_a_matrix_places_node_i_on_row_i_mod_rows():
    lat = Latency.matrix([[0, 30], [30, 0]], n=5)
    assert lat.sites == [0, 1, 0, 1, 0]
    assert lat.rtt(0, 1) == pytest.approx(0.03)
    assert lat.rtt(0, 2) == pytest.approx(SAME_SITE_MS / 1000)
    with pytest.raises(ValueError, match="square"):
        Latency.matrix([[0, 1]], n=2)


def test_loss_delays_a_message_by_retransmissions_never_drops_it():
    net = Network(Latency.uniform(2, 40.0), loss=0.3, seed=3)
    delays = [net.delay(0, 1) for _ in range(5000)]
    assert min(delays) == pytest.approx(0.02)
    late = [d for d in delays if d > 0.021]
    assert 0.25 < len(late) / len(delays) < 0.35  # one lost first attempt in ~30 %
    assert all(d >= 0.02 + RTO_FLOOR - 1e-9 for d in late)  # each costs at least one RTO
    assert max(delays) >= 0.02 + 3 * RTO_FLOOR - 1e-9  # two lost attempts: RTO + 2 RTO


def test_jitter_and_congestion_add_delay():
    net = Network(Latency.uniform(3, 40.0), jitter_ms=10.0, seed=1)
    ds = [net.delay(0, 1) for _ in range(1000)]
    assert 0.02 <= min(ds) and max(ds) <= 0.03 and max(ds) - min(ds) > 0.008
    net.congest(1, 0.8)
    assert net.delay(0, 1) >= 0.82 and net.delay(1, 2) >= 0.82 and net.delay(0, 2) < 0.1
    net.congest(1, 0.0)
    assert not net.congested


def test_crashed_is_silent_stopped_refuses_cut_is_silent():
    net = Network(Latency.uniform(4, 20.0))
    assert net.reachable(0, 1)
    net.set_power(1, CRASHED)
    assert not net.reachable(0, 1) and not net.refuses(0, 1)
    net.set_power(2, STOPPED)
    assert not net.reachable(0, 2) and net.refuses(0, 2)
    cut = net.partition([0], [3])
    assert not net.reachable(0, 3) and not net.reachable(3, 0)
    net.heal(cut)
    assert net.reachable(0, 3)
    with pytest.raises(ValueError, match="both sides"):
        net.partition([0], [0])
