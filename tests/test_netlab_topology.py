import pytest

from sim.netlab import topology
from sim.netlab.topology import plan


def test_every_pair_gets_its_own_segment_and_rtt():
    hosts, links = plan(4, lambda a, b: 10.0 * a.index + b.index)
    assert [h.address for h in hosts] == ["10.200.0.1", "10.200.0.2", "10.200.0.3", "10.200.0.4"]
    assert [(l.a, l.b, l.rtt_ms) for l in links] == [
        ("h1", "h2", 12), ("h1", "h3", 13), ("h1", "h4", 14), ("h2", "h3", 23), ("h2", "h4", 24), ("h3", "h4", 34)]
    ends = [a for l in links for a in (l.a_addr, l.b_addr)]
    assert len(set(ends)) == len(ends)  # no address used twice


@pytest.mark.parametrize("pair, ends", [(0, ("10.250.0.1", "10.250.0.2")), (1, ("10.250.0.5", "10.250.0.6")),
                                        (64, ("10.250.1.1", "10.250.1.2"))])
def test_segments_are_disjoint_slash_30s(pair, ends):
    assert topology.segment(pair) == ends


def test_country_rtts_come_from_the_measured_data():
    table = topology.country_table()
    assert len(table) > 6000
    hosts, links = plan(3, topology.from_countries(table), countries=["DE", "US", "DE"])
    rtt = {(l.a, l.b): l.rtt_ms for l in links}
    assert rtt[("h1", "h2")] == rtt[("h2", "h3")] == round(table[frozenset(("DE", "US"))], 2)
    assert 50 < rtt[("h1", "h2")] < 200  # transatlantic
    assert rtt[("h1", "h3")] == round(table[frozenset(("DE",))], 2)  # within one country


def test_unknown_country_is_named():
    with pytest.raises(ValueError, match="unknown country codes XX"):
        topology.check_countries(["DE", "XX"], topology.country_table())


def test_matrix_csv(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("0,10,20\n10,0,30\n20,30,0\n")
    _, links = plan(3, topology.from_matrix_csv(path))
    assert [l.rtt_ms for l in links] == [10, 20, 30]
    path.write_text("0,10\n10\n")
    with pytest.raises(ValueError, match="must be square"):
        topology.from_matrix_csv(path)


def test_host_count_is_checked():
    with pytest.raises(ValueError, match="--hosts must be between 1 and"):
        plan(0, topology.uniform(1))
