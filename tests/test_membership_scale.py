"""The core at swarm size: confirmations of a suspicion are gossiped by about
``Timing.confirm_fanout`` members whatever the swarm's size (the simulator found 2n rumors of n
deliveries each per crash: 8 M at 2,000 nodes) while a small swarm keeps every one; syncs and
refreshes slow down as the swarm grows; a member is forgotten only once its record expired."""

from __future__ import annotations

import random

import pytest

from sim.network import Latency
from sim.swarm import SimRecord, Small, Swarm
from swarmd.gossip.membership import Membership, PeerIndex, Probe, ProbeVia, PublishRumor, State, Timing
from swarmd.gossip.wire import Rumor


def confirms(members: int, seed: int) -> bool:
    """Whether one member, whose own probe of an accused member fails, gossips its confirmation."""
    core = Membership("me", 1, Timing.wan(), random.Random(seed), 0.0)
    for i in range(members - 1):
        core.receive_record(0.0, SimRecord(f"p{i}", 1))
    core.take_actions()
    accusation = Rumor(kind="suspect", swarm="s", sender="p1", about="p0", incarnation=1, issued=0.0, blob=b"")
    assert core.receive_rumor(0.0, accusation) == "suspect"
    probe = next(a for a in core.take_actions() if isinstance(a, Probe))
    core.probe_result(0.1, probe.id, False)
    vias = [a for a in core.take_actions() if isinstance(a, ProbeVia)]
    for via in vias:
        core.via_result(0.2, probe.id, via.via, False)
    assert core.members["p0"].state is State.SUSPECT
    return any(isinstance(a, PublishRumor) and a.kind == "suspect" for a in core.take_actions())


def test_in_a_small_swarm_every_confirmation_is_gossiped():
    assert all(confirms(5, seed) for seed in range(20))


def test_in_a_large_swarm_about_confirm_fanout_members_confirm():
    said = sum(confirms(300, seed) for seed in range(300))
    assert 1 <= said <= 20, f"{said} of 300 members gossiped their confirmation (expected about 6)"


def test_a_crash_in_300_nodes_costs_tens_of_rumors_and_is_still_seen_by_all():
    swarm = Swarm(Latency.uniform(300, 40.0), timing=Timing.wan(), seed=3)
    swarm.run_until(20.0)
    before = swarm.counters()
    sent = swarm.traffic.msgs_sent.sum()
    swarm.crash(7)
    swarm.run_until(50.0)
    assert all(swarm.state(o, 7) is State.DEAD for o in swarm.running_nodes()), "every node saw the crash"
    after = swarm.counters()
    unsaid = after["confirmations_unsaid"] - before["confirmations_unsaid"]
    assert unsaid > 2 * 299 - 60, f"only {unsaid} of ~598 confirmations kept quiet"
    assert swarm.traffic.msgs_sent.sum() > sent


def test_small_cluster_detection_unchanged():
    c = Small(["a", "b", "c", "d", "e"])
    c.run_for(5)
    c.kill("e")
    took = c.wait_for(lambda: all(c.state(o, "e") is State.DEAD for o in "abcd"), 10)
    assert took < 5


def test_syncs_and_refreshes_slow_down_as_the_swarm_grows_so_a_node_receives_about_the_same():
    from swarmd.gossip.membership import sync_scale

    assert sync_scale(15.0, 5) == sync_scale(15.0, 32) == 15.0  # the lab's swarms: unchanged
    assert sync_scale(15.0, 2000) == 15.0 * 7 and sync_scale(15.0, 10_000) == 15.0 * 10  # memberlist's figures
    small = Membership("me", 1, Timing.wan(), random.Random(1), 0.0)
    for i in range(4):
        small.receive_record(0.0, SimRecord(f"p{i}", 1))
    assert small.record_ttl == Timing.wan().record_ttl
    big = Membership("me", 1, Timing.wan(), random.Random(1), 0.0)
    for i in range(1999):
        big.receive_record(0.0, SimRecord(f"p{i}", 1, ttl=10_000.0))
    assert big.record_ttl == Timing.wan().record_ttl * (2000 / 4.0) / 30.0  # refreshed every 500 s, ttl 2,000 s
    # a member that just started refreshes sooner: 30 s after its first record, the step doubling
    # with each record up to the swarm's period (Trickle's timer), x0.75-1.25 each
    big.take_actions()
    issued, now = [0.0], 0.0
    while now < 3_000:
        now += 1.0
        big.handle_timeout(now)
        for a in big.take_actions():
            if type(a).__name__ == "PublishRecord":
                issued.append(now)
            elif isinstance(a, Probe):
                big.probe_result(now, a.id, True, 0.05)
    steps = [b - a for a, b in zip(issued, issued[1:])]
    assert len(steps) >= 7, steps
    for got, want in zip(steps, (30, 60, 120, 240, 480, 500, 500)):
        assert 0.75 * want - 1 <= got <= 1.25 * want + 1, steps
    # a member of a swarm that has run a while (the simulator's warm start) refreshes at the period
    settled = Membership("me", 1, Timing.wan(), random.Random(1), 0.0, first_refresh=10.0)
    for i in range(1999):
        settled.receive_record(0.0, SimRecord(f"p{i}", 1, ttl=10_000.0))
    settled.take_actions()
    settled.handle_timeout(10.0)
    assert [a for a in settled.take_actions() if type(a).__name__ == "PublishRecord"]
    settled.handle_timeout(10.0 + 0.74 * 500)
    assert not [a for a in settled.take_actions() if type(a).__name__ == "PublishRecord"], "not before 0.75 x 500 s"


def test_a_dead_member_is_not_forgotten_while_its_record_could_still_bring_it_back():
    """At 10,000 members a record lives 10,000 s, longer than forget_after (3,600 s): forgetting
    at 3,600 s let a sync (or a replay) of its last record make it a new, alive member again."""
    wall0 = 1_000_000.0
    core = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0)
    for i in range(9_999):
        core.receive_record(0.0, SimRecord(f"p{i}", 1, ttl=10_000.0, issued=wall0), wall0)
    assert core.record_ttl == 10_000.0
    last = SimRecord("p0", 2, ttl=core.record_ttl, issued=wall0)
    core.receive_record(0.0, last, wall0)
    for p in ("p1", "p2", "p3"):
        core.receive_rumor(0.0, Rumor(kind="dead", swarm="s", sender=p, about="p0", incarnation=2, issued=0.0,
                                      blob=b""))
    now = 0.0
    while core.members["p0"].state is not State.DEAD:  # its probes go unanswered: our own timeout
        now += 0.5
        core.handle_timeout(now)
        for a in core.take_actions():
            if isinstance(a, ProbeVia):
                core.via_result(now, a.id, a.via, False)
            elif isinstance(a, Probe):
                core.probe_result(now, a.id, False)
    while "p0" in core.members and now < 12_000:
        now += 10.0
        core.handle_timeout(now)
        core.take_actions()
    assert now > 9_900, f"forgotten at {now} s, before its record expired at 10,000 s"


def test_a_member_costs_the_simulators_core_under_50_bytes():
    """The simulator holds n cores of n members: at 20,000 nodes every byte a member costs is 400 MB.
    A compact core under a shared PeerIndex keeps it under 50 B (39 measured; float64 columns were 77 B,
    rows of slots 167 B), and a core with its own index (the daemon's) under 120 B (96 at 10,000; was 132)."""
    from bench.core_cost import bytes_per_member

    assert bytes_per_member(3000, shared=True) < 50
    assert bytes_per_member(3000) < 120


def test_a_core_sharing_a_peer_index_sees_only_its_own_members():
    """Cores that share a PeerIndex share the ints, not the view: a peer another core interned is
    not a member here until its record arrives, and a core grows its columns as the index grows."""
    peers = PeerIndex(["a", "b"])
    one = Membership("a", 1, Timing.wan(), random.Random(1), 0.0, peers=peers)
    two = Membership("b", 1, Timing.wan(), random.Random(2), 0.0, peers=peers)
    one.receive_record(0.0, SimRecord("late", 1))  # interned by one: rows now past two's columns
    assert "late" in one.members and "late" not in two.members and len(two.members) == 0
    assert two.receive_record(0.0, SimRecord("late", 1)) == "new" and two.members["late"].record.seq == 1
    assert one.view().get("late").state is State.ALIVE and "b" not in one.view()


def _state(core: Membership) -> tuple:
    """Everything a core's later behaviour depends on, comparable."""
    return (list(core._rec), bytes(core._st), core._since.tobytes(), core._expires.tobytes(), core._due.tobytes(),
            core._pos.tobytes(), {s: g.tobytes() for s, g in core._in.items()}, core._timers.tobytes(),
            core._order.tobytes(), core._count, core.counters, core.rng.getstate(), core.view().members)


@pytest.mark.parametrize("compact", [False, True])
def test_a_warm_start_loaded_at_once_is_the_core_that_took_each_record_in_turn(compact):
    """The simulator's warm start (n cores of n records each: 400 million at 20,000 nodes) loads a core's
    records at once: the same columns, heaps and random draws as a receive_record for each, so a run is
    the run it was, and no "joined" changes (a formed swarm's start is no one's news)."""
    peers = PeerIndex([f"p{i}" for i in range(400)] + ["me"])
    recs = [SimRecord(f"p{i}", 10 + i % 3, ttl=60.0 + i % 7) for i in range(400)]
    one, two = (Membership("me", 1 << 32, Timing.wan(), random.Random(5), 0.0, peers=peers, compact=compact)
                for _ in range(2))
    early = SimRecord("p3", 9)
    for core in (one, two):
        core.receive_record(0.5, early)  # one member already in: its row is skipped by neither
        core.take_actions()
    rest = [r for r in recs if r.peer != "p3"]
    for r in rest:
        assert one.receive_record(1.0, r) == "new"
    assert {type(a).__name__ for a in one.take_actions()} == {"Changed"}
    two.load(1.0, rest)
    assert two.take_actions() == []
    assert _state(one) == _state(two)
    for t in (2.0, 30.0, 65.0, 200.0):  # and they stay the same core: probes, expiries
        for core in (one, two):
            core.handle_timeout(t)
        assert one.take_actions() == two.take_actions() and _state(one) == _state(two)


def test_a_warm_start_refuses_a_member_it_already_has():
    core = Membership("me", 1 << 32, Timing.wan(), random.Random(5), 0.0)
    core.receive_record(0.0, SimRecord("a", 1))
    for bad in ([SimRecord("a", 2)], [SimRecord("me", 2)], [SimRecord("b", 1), SimRecord("b", 2)]):
        with pytest.raises(ValueError):
            core.load(1.0, bad)
    assert list(core.members) == ["a"] and core.members["a"].record.seq == 1
