"""The SWIM + Lifeguard core: alone, and unmodified in every node of a small simulated swarm (sim.swarm.Small)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from swarmd.gossip.membership import (MAX_SEQ, Changed, Membership, Probe, ProbeVia, PublishRecord, PublishRumor,
                                      State, Sync, SyncMerge, Timing)
from sim.swarm import Small
from swarmd.gossip.wire import Record, Rumor

NAMES = ["a", "b", "c", "d", "e"]


INFINITE_CERT = SimpleNamespace(expires=float("inf"))


def record(peer: str, seq: int, addrs: tuple[str, ...] = ("/ip4/10.0.0.1/tcp/4001",)) -> Record:
    return Record(swarm="s", peer=peer, seq=seq, issued=0.0, ttl=120.0, addrs=addrs, resources=None,  # type: ignore[arg-type]
                  labels={}, wg=None, cert=INFINITE_CERT, blob=b"")  # type: ignore[arg-type]


def all_see(cluster: Small, peer: str, state: State) -> bool:
    return all(cluster.state(o, peer) is state for o in cluster.names if o != peer and o not in cluster.down)


def test_members_learn_each_other_at_once():
    c = Small(NAMES)
    c.run_for(0.1)
    for o in NAMES:
        assert {p for p in NAMES if p != o} == set(c.nodes[o].members)
        assert all(m.state is State.ALIVE for m in c.nodes[o].members.values())


def test_probes_measure_rtt():
    c = Small(NAMES, latency=0.03)
    c.run_for(10)
    m = c.nodes["a"].view().get("b")
    assert m.rtt_min == pytest.approx(0.06)
    assert m.rtt_ewma == pytest.approx(0.06)


def test_a_killed_node_is_dead_everywhere_within_5_s():
    for seed in range(20):
        c = Small(NAMES, seed=seed)
        c.run_for(5)
        c.kill("c")
        took = c.wait_for(lambda: all_see(c, "c", State.DEAD), limit=5.0)
        assert took < 5.0
        assert any(ch.new is State.SUSPECT for _, _, ch in c.changes), "dead only after a suspicion"


def test_a_silent_node_is_dead_within_5_s_without_the_refused_hint():
    c = Small(NAMES)
    c.run_for(5)
    c.partition({"c"})  # no answers at all, as when a machine loses power
    c.wait_for(lambda: all_see(c, "c", State.DEAD), limit=6.0)


def test_graceful_leave_is_seen_at_once():
    c = Small(NAMES)
    c.run_for(2)
    c.leave("b")
    assert c.wait_for(lambda: all_see(c, "b", State.LEFT), limit=0.1) <= 0.1


def test_a_suspect_refutes_and_is_never_declared_dead():
    c = Small(NAMES)
    c.run_for(2)
    seq = c.nodes["c"].seq
    rumor = Rumor(kind="suspect", swarm="s", sender="a", about="c", incarnation=seq, issued=0.0, blob=b"")
    for o in ("a", "b", "d", "e"):
        c.nodes[o].receive_rumor(c.now, rumor)
    assert all_see(c, "c", State.SUSPECT)
    c.deliver("c", rumor)
    c.wait_for(lambda: all_see(c, "c", State.ALIVE), limit=1.0)
    assert c.nodes["c"].seq > seq
    assert c.nodes["c"].counters.refutations == 1
    c.run_for(30)
    assert not any(ch.new is State.DEAD for _, _, ch in c.changes)


def test_a_restarted_node_rejoins_with_its_new_life():
    c = Small(NAMES)
    c.run_for(2)
    c.kill("d")
    c.wait_for(lambda: all_see(c, "d", State.DEAD), limit=6)
    c.start("d")
    c.wait_for(lambda: all_see(c, "d", State.ALIVE), limit=1)
    assert all(c.nodes[o].view().get("d").record.seq >> 32 == 2 for o in "abce")  # the second epoch's record


def test_replayed_and_equal_records_change_nothing():
    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    assert node.receive_record(0.0, record("x", 10)) == "new"
    assert node.receive_record(0.1, record("x", 12)) == "updated"
    assert node.receive_record(0.2, record("x", 12)) == "duplicate"
    assert node.receive_record(0.3, record("x", 11)) == "old"
    assert node.members["x"].record.seq == 12
    assert node.counters.records_old == 1


def test_rumors_about_an_older_incarnation_are_ignored():
    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    node.receive_record(0.0, record("x", 10))
    old = Rumor(kind="dead", swarm="s", sender="y", about="x", incarnation=9, issued=0.0, blob=b"")
    assert node.receive_rumor(0.1, old) == "old"
    assert node.members["x"].state is State.ALIVE


def test_a_dead_rumor_about_ourselves_is_refuted():
    node = Membership("me", 5 << 32, Timing.wan(), random.Random(1), 0.0)
    node.take_actions()
    seq = node.seq
    rumor = Rumor(kind="dead", swarm="s", sender="y", about="me", incarnation=seq, issued=0.0, blob=b"")
    assert node.receive_rumor(1.0, rumor) == "refuted"
    published = [a for a in node.take_actions() if isinstance(a, PublishRecord)]
    assert published and published[-1].seq == seq + 1
    assert node.awareness.score == 1  # being suspected makes us doubt our own health


def test_partition_and_heal_converge_with_nobody_stuck_dead():
    c = Small(NAMES)
    c.run_for(3)
    c.partition({"a", "b"})
    c.wait_for(lambda: c.state("a", "c") is State.DEAD and c.state("c", "a") is State.DEAD, limit=10)
    c.heal()
    c.wait_for(lambda: all(all_see(c, p, State.ALIVE) for p in NAMES), limit=10)


def test_lossy_network_makes_no_false_deaths():
    c = Small(NAMES, loss=0.05, seed=7)
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
    node.receive_record(0.0, record("x", 10))
    node.take_actions()
    node.leave(1.0)
    assert PublishRumor("left", "me", node.seq) in node.take_actions()
    node.handle_timeout(100.0)
    assert not [a for a in node.take_actions() if type(a).__name__ in ("Probe", "PublishRecord")]


# --- issue 11: lies from certified members --------------------------------------------

def rumor(kind: str, about: str, inc: int, sender: str = "y") -> Rumor:
    return Rumor(kind=kind, swarm="s", sender=sender, about=about, incarnation=inc, issued=0.0, blob=b"")


def published(node: Membership) -> list[int]:
    return [a.seq for a in node.take_actions() if isinstance(a, PublishRecord)]


@pytest.mark.parametrize("inc", [2**64 - 2, 2**64 - 1, MAX_SEQ - 1])
def test_a_rumor_about_a_future_incarnation_of_ours_is_refused(inc):
    """The crash of issue 11: a signed suspect rumor at 2^64 - 2 made the node refute with
    2^64 - 1, then 2^64 at its next refresh, which msgpack cannot encode."""
    node = Membership("me", 5 << 32, Timing.wan(), random.Random(1), 0.0)
    seq = node.seq
    node.take_actions()
    for kind in ("suspect", "dead"):
        assert node.receive_rumor(1.0, rumor(kind, "me", inc)) == "future_incarnation"
    assert node.merge_sync(1.0, [], [("me", "dead", inc)], by="y").claims == ["future_incarnation"]
    assert node.seq == seq and published(node) == []
    node.handle_timeout(1000.0)  # refreshes go on from our own seq
    assert published(node) == [seq + 1]


def test_a_claim_at_our_current_incarnation_is_refuted_once():
    node = Membership("me", 5 << 32, Timing.wan(), random.Random(1), 0.0)
    node.take_actions()
    seq = node.seq
    assert node.merge_sync(1.0, [], [("me", "suspect", seq), ("other", "dead", 7)], by="y").claims == ["refuted"]
    assert published(node) == [seq + 1]
    assert node.merge_sync(1.1, [], [("me", "suspect", seq)], by="y").claims == ["old"]


# --- push-pull sync merge (issue 15: the rules moved from the driver into the core) ----

def test_a_sync_merge_takes_records_in_order_and_only_claims_about_us():
    node = Membership("me", 5 << 32, Timing.wan(), random.Random(1), 0.0)
    node.receive_record(0.0, record("x", 10))
    node.take_actions()
    merged = node.merge_sync(1.0, [record("x", 11), record("y", 3), record("x", 9), record("me", node.seq)],
                             [("x", "dead", 11), ("y", "suspect", 3), ("me", "alive", node.seq)], by="y")
    assert merged == SyncMerge(records=["updated", "new", "old", "self"], claims=[], refuted=False)
    assert node.members["x"].state is State.ALIVE, "claims about others are not verdicts"
    assert not [a for a in node.take_actions() if isinstance(a, (Sync, PublishRecord))]


def test_a_sync_that_makes_us_refute_is_answered_by_a_sync_with_our_new_record():
    """The peer holds us suspect: it must get our new record at once, not by gossip it may not
    be part of yet (a healed partition). The record is published before the resync is asked."""
    node = Membership("me", 5 << 32, Timing.wan(), random.Random(1), 0.0)
    node.take_actions()
    seq = node.seq
    merged = node.merge_sync(1.0, [record("x", 10)], [("me", "suspect", seq)], by="x")
    assert merged == SyncMerge(records=["new"], claims=["refuted"], refuted=True)
    actions = [a for a in node.take_actions() if isinstance(a, (Sync, PublishRecord))]
    assert actions == [PublishRecord(seq + 1), Sync("x")]
    again = node.merge_sync(1.1, [], [("me", "suspect", seq)], by="x")  # its old claim, before our record arrived
    assert again == SyncMerge(records=[], claims=["old"], refuted=False) and node.take_actions() == []


def test_our_own_record_from_an_older_life_in_a_sync_also_resyncs():
    node = Membership("me", 5 << 32, Timing.wan(), random.Random(1), 0.0)
    node.take_actions()
    merged = node.merge_sync(1.0, [record("me", (5 << 32) + 50)], [], by="x")
    assert merged.refuted and merged.records == ["refuted"]
    assert [a for a in node.take_actions() if isinstance(a, (Sync, PublishRecord))] == \
        [PublishRecord((5 << 32) + 51), Sync("x")]


def test_a_lie_in_a_sync_is_refused_and_asks_for_no_resync():
    node = Membership("me", 5 << 32, Timing.wan(), random.Random(1), 0.0)
    node.take_actions()
    merged = node.merge_sync(1.0, [], [("me", "dead", node.seq + 1)], by="x")
    assert merged == SyncMerge(records=[], claims=["future_incarnation"], refuted=False)
    assert node.take_actions() == []


def test_our_own_record_from_an_older_life_that_got_further_is_jumped_past_within_range():
    node = Membership("me", 5 << 32, Timing.wan(), random.Random(1), 0.0)
    node.take_actions()
    assert node.receive_record(1.0, record("me", (5 << 32) + 1000)) == "refuted"
    assert published(node) == [(5 << 32) + 1001]
    node.receive_record(2.0, record("me", MAX_SEQ - 1))  # our own signature at the very top of the range
    assert published(node) == [] and node.counters.seq_exhausted == 1 and node.seq < MAX_SEQ


def test_one_members_dead_rumor_is_an_accusation_that_our_probe_clears():
    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    node.receive_record(0.0, record("x", 10))
    node.take_actions()
    assert node.receive_rumor(1.0, rumor("dead", "x", 10, sender="liar")) == "suspect"
    assert node.members["x"].state is State.SUSPECT  # in the mesh still: SWIM keeps suspects
    probes = [a for a in node.take_actions() if isinstance(a, Probe) and a.peer == "x"]
    assert probes, "the accused is probed at once"
    node.probe_result(1.05, probes[0].id, True, 0.05)
    assert node.members["x"].state is State.ALIVE
    assert node.counters.accusations_cleared == 1


def test_a_lone_accusation_waits_the_longest_timeout_before_death():
    t = Timing.wan()
    node = Membership("me", 1 << 32, t, random.Random(1), 0.0)
    for p in ("x", "a", "b", "c", "d"):
        node.receive_record(0.0, record(p, 10))
    node.receive_rumor(1.0, rumor("dead", "x", 10, sender="liar"))
    suspicion = node.suspicion("x")
    assert suspicion is not None and suspicion.deadline == pytest.approx(1.0 + suspicion.high)
    node.handle_timeout(1.0 + suspicion.high - 0.01)
    assert node.members["x"].state is State.SUSPECT
    confirmed = node.receive_rumor(1.5, rumor("suspect", "x", 10, sender="a"))  # an independent member agrees
    assert confirmed == "confirmed" and node.suspicion("x").deadline < 1.0 + suspicion.high


def test_accusations_are_rate_limited_per_accuser():
    t = Timing.wan()
    node = Membership("me", 1 << 32, t, random.Random(1), 0.0)
    for i in range(100):
        node.receive_record(0.0, record(f"p{i}", 10))
    results = [node.receive_rumor(1.0, rumor("dead", f"p{i}", 10, sender="liar")) for i in range(100)]
    assert results.count("suspect") == t.accusation_burst
    assert results.count("accusation_rate") == 100 - t.accusation_burst
    assert node.receive_rumor(1.0, rumor("dead", "p99", 10, sender="honest")) == "suspect", "per accuser"
    assert node.receive_rumor(1.0 + 2 / t.accusation_rate, rumor("dead", "p98", 10, sender="liar")) == "suspect"


def test_a_burst_of_false_dead_rumors_flaps_nobody():
    c = Small(NAMES)
    c.run_for(3)
    for _ in range(50):
        for o in ("a", "b", "d", "e"):
            c.deliver(o, rumor("dead", "c", c.nodes["c"].seq, sender="b"))
        c.deliver("c", rumor("dead", "c", c.nodes["c"].seq, sender="b"))
        c.run_for(0.05)
    c.run_for(30)
    assert not [ch for _, _, ch in c.changes if ch.new is State.DEAD]
    assert all_see(c, "c", State.ALIVE)
    assert sum(n.counters.refutations for n in c.nodes.values()) <= Timing.wan().accusation_burst + 5


def test_a_record_goes_stale_at_its_ttl_and_fresh_with_a_new_one():
    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    r = dataclasses.replace(record("x", 10), issued=1000.0, ttl=120.0)
    node.receive_record(0.0, r, wall=1100.0)  # 100 s old when it arrived: 20 s left
    assert not node.view().get("x").stale
    node.handle_timeout(19.9)
    assert not node.view().get("x").stale
    node.handle_timeout(20.0)
    x = node.view().get("x")
    assert x.stale and x.state is State.ALIVE and not x.in_service
    assert any(isinstance(a, Changed) and a.reason.startswith("stale") for a in node.take_actions())
    node.receive_record(21.0, dataclasses.replace(r, seq=11, issued=1121.0), wall=1121.0)
    assert node.view().get("x").in_service


def test_a_member_leaves_the_view_when_its_certificate_expires():
    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    cert = SimpleNamespace(expires=1005.0)
    assert node.receive_record(0.0, dataclasses.replace(record("x", 10), issued=1000.0, cert=cert), wall=1000.0) == "new"
    node.handle_timeout(4.9)
    assert "x" in node.view()
    node.handle_timeout(5.0)
    assert "x" not in node.view() and node.counters.certs_expired == 1
    late = dataclasses.replace(record("x", 11), issued=1006.0, cert=cert)
    assert node.receive_record(6.0, late, wall=1006.0) == "cert_expired"


def test_an_excluded_member_is_dropped_and_refused_until_readmitted():
    node = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    for p in ("x", "y"):
        node.receive_record(0.0, record(p, 10))
    node.take_actions()
    node.exclude(1.0, "x", "revoked by the owner")
    assert "x" not in node.view()
    assert Changed("x", State.ALIVE, None, "excluded: revoked by the owner") in node.take_actions()
    assert node.receive_record(2.0, record("x", 11)) == "excluded"
    assert node.receive_rumor(2.0, rumor("dead", "y", 10, sender="x")) == "excluded"
    node.handle_timeout(100.0)
    assert not [a for a in node.take_actions() if isinstance(a, (Probe, ProbeVia)) and "x" in (a.peer if isinstance(a, Probe) else a.target)]
    node.readmit("x")
    assert node.receive_record(101.0, record("x", 12)) == "new"


def test_a_lie_about_us_is_screened_before_it_is_passed_on():
    node = Membership("me", 5 << 32, Timing.wan(), random.Random(1), 0.0)
    assert node.screen(rumor("suspect", "me", node.seq + 1)) == "future_incarnation"
    assert node.screen(rumor("suspect", "me", node.seq)) is None  # refuted, and passed on: others should hear
    assert node.screen(rumor("dead", "x", 2**62)) is None  # about others: their own record decides
