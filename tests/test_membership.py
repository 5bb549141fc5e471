"""The SWIM + Lifeguard core, driven on a fake network with a fake clock."""

from __future__ import annotations

import random

import pytest

from swarmd.gossip.membership import Membership, PublishRecord, PublishRumor, State, Timing
from swarmd.gossip.wire import Rumor

from cluster import Cluster, record

NAMES = ["a", "b", "c", "d", "e"]


def all_see(cluster: Cluster, peer: str, state: State) -> bool:
    return all(cluster.state(o, peer) is state for o in cluster.names if o != peer and o not in cluster.down)


def test_members_learn_each_other_at_once():
    c = Cluster(NAMES)
    c.run_for(0.1)
    for o in NAMES:
        assert {p for p in NAMES if p != o} == set(c.nodes[o].members)
        assert all(m.state is State.ALIVE for m in c.nodes[o].members.values())


def test_probes_measure_rtt():
    c = Cluster(NAMES, latency=0.03)
    c.run_for(10)
    m = c.nodes["a"].members["b"]
    assert m.rtt_min == pytest.approx(0.06)
    assert m.rtt_ewma == pytest.approx(0.06)


def test_a_killed_node_is_dead_everywhere_within_5_s():
    for seed in range(20):
        c = Cluster(NAMES, seed=seed)
        c.run_for(5)
        c.kill("c")
        took = c.wait_for(lambda: all_see(c, "c", State.DEAD), limit=5.0)
        assert took < 5.0
        assert any(ch.new is State.SUSPECT for _, _, ch in c.changes), "dead only after a suspicion"


def test_a_silent_node_is_dead_within_5_s_without_the_refused_hint():
    c = Cluster(NAMES)
    c.run_for(5)
    c.partition({"c"})  # no answers at all, as when a machine loses power
    c.wait_for(lambda: all_see(c, "c", State.DEAD), limit=6.0)


def test_graceful_leave_is_seen_at_once():
    c = Cluster(NAMES)
    c.run_for(2)
    c.nodes["b"].leave(c.now)
    c._drain("b")
    c.kill("b")
    assert c.wait_for(lambda: all_see(c, "b", State.LEFT), limit=0.1) <= 0.1


def test_a_suspect_refutes_and_is_never_declared_dead():
    c = Cluster(NAMES)
    c.run_for(2)
    seq = c.nodes["c"].seq
    rumor = Rumor(kind="suspect", swarm="s", sender="a", about="c", incarnation=seq, issued=0.0, blob=b"")
    for o in ("a", "b", "d", "e"):
        c.nodes[o].receive(c.now, rumor)
    assert all_see(c, "c", State.SUSPECT)
    c._deliver("c", rumor, "a")
    c.wait_for(lambda: all_see(c, "c", State.ALIVE), limit=1.0)
    assert c.nodes["c"].seq > seq
    assert c.nodes["c"].counters.refutations == 1
    c.run_for(30)
    assert not any(ch.new is State.DEAD for _, _, ch in c.changes)


def test_a_restarted_node_rejoins_with_its_new_address():
    c = Cluster(NAMES)
    c.run_for(2)
    c.kill("d")
    c.wait_for(lambda: all_see(c, "d", State.DEAD), limit=6)
    c.start("d", addrs=("/ip4/10.9.9.9/tcp/4001",))
    c.wait_for(lambda: all_see(c, "d", State.ALIVE), limit=1)
    assert all(c.nodes[o].members["d"].record.addrs == ("/ip4/10.9.9.9/tcp/4001",) for o in "abce")


def test_replayed_and_equal_records_change_nothing():
    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    assert node.receive(0.0, record("x", 10)) == "new"
    assert node.receive(0.1, record("x", 12)) == "updated"
    assert node.receive(0.2, record("x", 12)) == "duplicate"
    assert node.receive(0.3, record("x", 11)) == "old"
    assert node.members["x"].record.seq == 12
    assert node.counters.records_old == 1


def test_rumors_about_an_older_incarnation_are_ignored():
    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    node.receive(0.0, record("x", 10))
    old = Rumor(kind="dead", swarm="s", sender="y", about="x", incarnation=9, issued=0.0, blob=b"")
    assert node.receive(0.1, old) == "old"
    assert node.members["x"].state is State.ALIVE


def test_a_dead_rumor_about_ourselves_is_refuted():
    node = Membership("me", 5 << 32, Timing.wan(), random.Random(1), 0.0)
    node.take_actions()
    rumor = Rumor(kind="dead", swarm="s", sender="y", about="me", incarnation=(5 << 32) + 3, issued=0.0, blob=b"")
    assert node.receive(1.0, rumor) == "refuted"
    published = [a for a in node.take_actions() if isinstance(a, PublishRecord)]
    assert published and published[-1].seq > (5 << 32) + 3
    assert node.awareness.score == 1  # being suspected makes us doubt our own health


def test_partition_and_heal_converge_with_nobody_stuck_dead():
    c = Cluster(NAMES)
    c.run_for(3)
    c.partition({"a", "b"})
    c.wait_for(lambda: c.state("a", "c") is State.DEAD and c.state("c", "a") is State.DEAD, limit=10)
    c.heal()
    c.wait_for(lambda: all(all_see(c, p, State.ALIVE) for p in NAMES), limit=10)


def test_lossy_network_makes_no_false_deaths():
    c = Cluster(NAMES, loss=0.05, seed=7)
    c.run_for(600)
    deaths = [ch for _, _, ch in c.changes if ch.new is State.DEAD]
    assert deaths == []
    assert all(all_see(c, p, State.ALIVE) for p in NAMES)


def test_publishes_are_rate_limited():
    t = Timing.wan()
    node = Membership("me", 1 << 32, t, random.Random(1), 0.0)
    node.take_actions()
    for i in range(10):
        node.local_change(0.01 * i)
    records = [a for a in node.take_actions() if isinstance(a, PublishRecord)]
    assert len(records) <= 1
    node.handle_timeout(t.publish_interval + 0.01)
    assert [a for a in node.take_actions() if isinstance(a, PublishRecord)]


def test_leaving_publishes_left_and_stops_probing():
    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    node.receive(0.0, record("x", 10))
    node.take_actions()
    node.leave(1.0)
    assert PublishRumor("left", "me", node.seq) in node.take_actions()
    node.handle_timeout(100.0)
    assert not [a for a in node.take_actions() if type(a).__name__ in ("Probe", "PublishRecord")]
