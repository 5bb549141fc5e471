"""Property: no sequence of well-signed messages from certified members breaks the membership core.

Random records (any seq, the 2^64 edge included), rumors of every kind about anyone at any
incarnation, and sync claims, signed by real member keys and checked by the real Verifier,
are thrown at a core driven by a fake clock. Whatever comes: no exception escapes, every
action the core emits encodes on the wire (the crash of issue 11 was a refutation at
2^64), and no counter goes negative."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nacl.signing import SigningKey

from swarmd.gossip.capacity import Resources
from swarmd.gossip.cert import issue_cert, swarm_id
from swarmd.gossip.membership import (_TIMED, REFUSED, Changed, Membership, Probe, ProbeVia, PublishRecord, PublishRumor, State,
                                      Sync, Timing)
from sim.swarm import SimRecord as Rec
from swarmd.p2p.signed import Invalid, peer_from_key, peer_str
from swarmd.gossip.wire import MAX_SEQ, Record, Verifier, make_record, make_rumor

ROOT = Path(__file__).resolve().parent.parent
OWNER = SigningKey(b"\x0a" * 32)
SWARM = swarm_id(bytes(OWNER.verify_key))
NOW = 1_700_000_000.0
KEYS = [SigningKey(bytes([i + 1]) * 32) for i in range(5)]
PEERS = [peer_str(peer_from_key(bytes(k.verify_key))) for k in KEYS]
ME = PEERS[0]
CERTS = [issue_cert(lambda d: OWNER.sign(d).signature, SWARM, peer_from_key(bytes(k.verify_key)), now=NOW - 60,
                    ttl=3600.0) for k in KEYS]
RES = Resources(cpu_count=1, cpu_free=1.0, memory_total_mb=1, memory_free_mb=1)
VERIFIER = Verifier(SWARM, bytes(OWNER.verify_key))
FIRST_SEQ = 3 << 32

incarnations = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from(
    [0, 1, FIRST_SEQ, FIRST_SEQ + 1, FIRST_SEQ + 2, MAX_SEQ - 2, MAX_SEQ - 1, MAX_SEQ, 2**64 - 2, 2**64 - 1]))
signers = st.integers(0, len(KEYS) - 1)
records = st.tuples(st.just("record"), signers, incarnations, st.floats(0, 300), st.floats(1, 200))
rumors = st.tuples(st.sampled_from(["suspect", "dead", "left"]), signers, st.integers(0, len(KEYS) - 1), incarnations)
claims = st.tuples(st.just("claims"), signers, st.lists(st.tuples(
    st.sampled_from(PEERS + ["nobody"]), st.sampled_from(["suspect", "dead", "alive", "left", "x"]), incarnations),
    max_size=4))
events = st.one_of(records, rumors, claims,
                   st.tuples(st.just("tick"), st.floats(0, 30)),
                   st.tuples(st.just("probe"), st.booleans(), st.floats(0, 2)),
                   st.tuples(st.just("exclude"), signers), st.tuples(st.just("readmit"), signers),
                   st.tuples(st.just("lost"), signers))


def sign(i: int):
    return lambda data: KEYS[i].sign(data).signature


def blob(event, wall: float) -> bytes:
    if event[0] == "record":
        _, i, seq, age, ttl = event
        return make_record(sign(i), swarm=SWARM, peer=PEERS[i], seq=seq, issued=wall - age, ttl=ttl, addrs=[],
                           resources=RES, labels={}, wg=None, cert=CERTS[i])
    kind, i, about, inc = event
    return make_rumor(sign(i), kind=kind, swarm=SWARM, sender=PEERS[i], about=PEERS[about if kind != "left" else i],
                      incarnation=inc, issued=wall - 1, cert=CERTS[i])


def encodes(core: Membership, wall: float) -> None:
    """Every action as the driver would perform it: records and rumors must be signable."""
    for action in core.take_actions():
        match action:
            case PublishRecord(seq):
                assert 0 <= seq < MAX_SEQ
                VERIFIER.decode(make_record(sign(0), swarm=SWARM, peer=ME, seq=seq, issued=wall, ttl=120.0, addrs=[],
                                            resources=RES, labels={}, wg=None, cert=CERTS[0]), wall)
            case PublishRumor(kind, about, inc):
                assert 0 <= inc < MAX_SEQ
                make_rumor(sign(0), kind=kind, swarm=SWARM, sender=ME, about=about, incarnation=inc, issued=wall,
                           cert=CERTS[0])
            case Probe() | ProbeVia() | Sync() | Changed():
                pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(events, max_size=40), st.integers(0, 2**32))
def test_no_message_from_a_member_breaks_the_core(script, seed):
    now, wall = 0.0, NOW
    core = Membership(ME, FIRST_SEQ, Timing.local(), random.Random(seed), now)
    probes: list[int] = []
    encodes(core, wall)
    for event in script:
        match event:
            case ("tick", dt):
                now, wall = now + dt, wall + dt
                core.handle_timeout(now)
            case ("probe", ok, rtt):
                if probes:
                    core.probe_result(now, probes.pop(0), ok, rtt if ok else None)
            case ("exclude", i):
                core.exclude(now, PEERS[i], "test")
            case ("readmit", i):
                core.readmit(PEERS[i])
            case ("lost", i):
                core.connection_lost(now, PEERS[i])
            case ("claims", i, claimed):
                merged = core.merge_sync(now, [], list(claimed), by=PEERS[i])
                assert merged.refuted == any(isinstance(a, Sync) and a.peer == PEERS[i] for a in core._actions)
            case _:
                try:
                    msg = VERIFIER.decode(blob(event, wall), wall)
                except Invalid as exc:
                    assert exc.reason in ("malformed", "stale"), exc
                    continue
                if isinstance(msg, Record):
                    result = core.receive_record(now, msg, wall)
                else:
                    why = core.screen(msg)  # the daemon drops a screened rumor; the core refuses it too
                    result = core.receive_rumor(now, msg)
                    assert why is None or result in REFUSED
                assert isinstance(result, str)
        probes += [a.id for a in core._actions if isinstance(a, Probe)]
        encodes(core, wall)
        assert 0 <= core.seq < MAX_SEQ
        assert core.next_deadline() == core.next_deadline()  # a number, not NaN
        for name, value in dataclasses.asdict(core.counters).items():
            assert value >= 0, name
        view = core.view()
        assert ME not in view
        assert set(view.counts()) == {s.value for s in State} and sum(view.counts().values()) == len(view)
        for m in view:
            assert isinstance(m.record, Record) and m.record.seq < MAX_SEQ


def test_the_issue_11_crash_replayed_through_the_wire():
    """A certified member gossips suspect at 2^64 - 2 about us: the wire refuses it; at 2^63 - 1
    (inside the wire's range) the core refuses it; our next refresh still encodes."""
    wall, now = NOW, 0.0
    core = Membership(ME, FIRST_SEQ, Timing.wan(), random.Random(1), now)
    encodes(core, wall)
    with pytest.raises(Invalid) as exc:
        VERIFIER.decode(blob(("suspect", 1, 0, 2**64 - 2), wall), wall)
    assert exc.value.reason == "malformed"
    lie = VERIFIER.decode(blob(("suspect", 1, 0, MAX_SEQ - 1), wall), wall)
    assert core.screen(lie) == "future_incarnation"
    assert core.receive_rumor(now, lie) == "future_incarnation"
    assert core.merge_sync(now, [], [(ME, "dead", 2**64 - 1)], by=PEERS[1]).claims == ["future_incarnation"]
    for t in (38.0, 76.0):  # refreshes (30 s x 0.75-1.25), where the daemon died
        core.handle_timeout(t)
        encodes(core, wall + t)
    assert core.seq == FIRST_SEQ + 3


# --- issue 15: the heaps and indexes agree with an O(N) recomputation -----------------


OTHERS = ["p0", "p1", "p2", "p3", "p4", "p5"]
others = st.sampled_from(OTHERS)
ops = st.one_of(
    st.tuples(st.just("record"), others, st.integers(1, 6), st.sampled_from([0.5, 3.0, 120.0]),
              st.sampled_from([None, 0.0, 2.0, 50.0]), st.sampled_from([float("inf"), 1.0, 10.0, 500.0])),
    st.tuples(st.sampled_from(["suspect", "dead", "left"]), others, others, st.integers(0, 6)),
    st.tuples(st.just("tick"), st.sampled_from([0.0, 0.01, 0.1, 0.3, 1.0, 5.0, 40.0])),
    st.tuples(st.just("probe"), st.booleans(), st.sampled_from([0.0, 0.05, 0.3])),
    st.tuples(st.just("via"), others, st.booleans()),
    st.tuples(st.just("claims"), others, st.sampled_from(["suspect", "dead"]), st.integers(-1, 1)),
    st.tuples(st.just("lost"), others),
    st.tuples(st.just("exclude"), others), st.tuples(st.just("readmit"), others),
    st.tuples(st.just("change"),), st.tuples(st.just("leave"),))


def reference_deadline(core: Membership) -> float:
    """The pre-issue-15 next_deadline: a scan of everything (O(N))."""
    deadlines = [core._next_probe, core._next_refresh, core._next_sync, core._next_reconnect]
    if core._publish_pending:
        deadlines.append(core._last_publish + core.timing.publish_interval)
    deadlines += [p.deadline for p in core._probes.values()]
    for m in core.members.values():
        deadlines.append(core._certs.get(m.peer, float("inf")))
        if not m.stale:
            deadlines.append(m.expires)
        if m.state is State.SUSPECT:
            deadlines.append(core.suspicion(m.peer).deadline)
    return min(deadlines)


def check_indexes(core: Membership) -> None:
    counts = {s.value: 0 for s in State}
    for m in core.members.values():
        counts[m.state.value] += 1
        assert core._in[m.state][m.pos] == m.row
    assert core.counts() == counts == core.view().counts()
    assert sum(len(group) for group in core._in.values()) == len(core.members)
    assert sorted(core.sync_claims()) == sorted((m.peer, m.state.value, m.incarnation) for m in core.members.values()
                                                if m.state in (State.SUSPECT, State.DEAD))
    assert {peer: p.id for peer, p in core._probing.items()} == {p.target: p.id for p in core._probes.values()}
    assert all(core.members.get(peer) is not None and core.members[peer].state in (State.ALIVE, State.SUSPECT)
               for peer in core._probing)
    assert all(core._rec[i] is not None for i in core._rtt), "a dropped row's RTT goes"
    assert all(low <= ewma for ewma, low in core._rtt.values())
    assert set(core._certs) <= set(core.members)
    assert set(core._suspicions) == {p for p, m in core.members.items() if m.state is State.SUSPECT}
    timers = list(core._timers)
    assert len(set(timers)) == len(timers), "a row is in the timer heap at most once"
    assert all(core._st[i] & _TIMED for i in timers)
    assert sum(1 for b in core._st if b & _TIMED) == len(timers), "the flag says which rows are in it"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=60), st.integers(0, 2**32), st.booleans())
def test_the_deadline_heaps_agree_with_a_full_scan(script, seed, compact):
    """``compact``: the simulator's float32 times, where a certificate's expiry (float64 on arrival) and the
    timer that comes due for it must round alike (else the timer fires, finds nothing expired, and is due again)."""
    now, wall = 0.0, 1000.0
    core = Membership("me", 1 << 32, Timing.local(), random.Random(seed), now, compact=compact)
    probes: list[int] = []
    vias: list[tuple[int, str]] = []
    seqs = {p: 10 for p in OTHERS}
    for op in script:
        match op:
            case ("record", peer, step, ttl, age, cert):
                seqs[peer] += step
                r = Rec(peer, seqs[peer], ttl=ttl, issued=wall - (age or 0.0), cert_expires=wall + cert)
                assert isinstance(core.receive_record(now, r, None if age is None else wall), str)
            case (("suspect" | "dead" | "left") as kind, sender, about, back):
                inc = seqs[about] - back
                core.receive_rumor(now, SimpleNamespace(kind=kind, sender=sender, about=about, incarnation=inc))
            case ("tick", dt):
                now, wall = now + dt, wall + dt
                core.handle_timeout(now)
                if not core.leaving:
                    assert reference_deadline(core) > now, "handle_timeout left something due undone"
            case ("probe", ok, rtt):
                if probes:
                    core.probe_result(now, probes.pop(0), ok, rtt if ok else None)
            case ("via", _, ok):
                if vias:
                    pid, via = vias.pop(0)
                    core.via_result(now, pid, via, ok)
            case ("claims", by, state, back):
                core.merge_sync(now, [], [("me", state, core.seq + back)], by=by)
            case ("lost", peer):
                core.connection_lost(now, peer)
            case ("exclude", peer):
                core.exclude(now, peer, "test")
            case ("readmit", peer):
                core.readmit(peer)
            case ("change",):
                core.local_change(now)
            case ("leave",):
                core.leave(now)
        for a in core.take_actions():
            if isinstance(a, Probe):
                probes.append(a.id)
            elif isinstance(a, ProbeVia):
                vias.append((a.id, a.via))
        assert core.next_deadline() == reference_deadline(core)
        check_indexes(core)


DETERMINISM = """
import hashlib, sys
from sim.swarm import Small
c = Small(["a", "b", "c", "d", "e", "f", "g"], loss=0.05, seed=3)
c.run_for(5); c.kill("c"); c.run_for(10); c.partition({"a", "b"}); c.run_for(20); c.heal(); c.start("c"); c.run_for(30)
log = repr([(round(t, 9), o, ch) for t, o, ch in c.changes]) + repr(sorted((n, x.seq) for n, x in c.nodes.items()))
print(len(c.changes), hashlib.sha256(log.encode()).hexdigest())
"""


def test_the_same_seed_gives_the_same_run_whatever_the_hash_seed():
    """Sets of str iterate in an order that changes with PYTHONHASHSEED: nothing the core does may
    depend on it (the simulator's replay promise)."""
    out = []
    for hashseed in ("1", "2", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        run = subprocess.run([sys.executable, "-c", DETERMINISM], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=120, check=True)
        out.append(run.stdout)
    assert out[0] == out[1] == out[2] and int(out[0].split()[0]) > 10, out


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_heaps_stay_right_and_small_through_many_events(seed, compact):
    """Hundreds of members and thousands of events (rebuilds happen, deadlines move both ways):
    the heaps agree with a full scan and hold a bounded number of stale entries."""
    rng = random.Random(seed)
    peers = [f"q{i}" for i in range(300)]
    seqs = dict.fromkeys(peers, 10)
    now, wall = 0.0, 1000.0
    core = Membership("me", 1 << 32, Timing.local(), random.Random(seed), now, compact=compact)
    probes: list[int] = []
    for step in range(6000):
        x = rng.random()
        peer = rng.choice(peers)
        if x < 0.45:
            seqs[peer] += 1
            ttl = rng.choice([2.0, 30.0, 120.0])
            core.receive_record(now, Rec(peer, seqs[peer], ttl=ttl, issued=wall - rng.uniform(0, 1),
                                         cert_expires=wall + rng.choice([float("inf"), 60.0, 600.0])), wall)
        elif x < 0.55:
            core.receive_rumor(now, SimpleNamespace(kind=rng.choice(["suspect", "dead"]), sender=rng.choice(peers),
                                                    about=peer, incarnation=seqs[peer]))
        elif x < 0.8 and probes:
            core.probe_result(now, probes.pop(rng.randrange(len(probes))), rng.random() < 0.7, 0.01)
        else:
            now, wall = now + rng.expovariate(20), wall + 0.05
            core.handle_timeout(now)
        probes += [a.id for a in core.take_actions() if isinstance(a, Probe)]
        if step % 50 == 0:
            assert core.next_deadline() == reference_deadline(core)
            check_indexes(core)
            assert len(core._timers) <= 2 * len(core.members) + 64 + 1
            assert len(core._events) <= 2 * (len(core._probes) + len(core._suspicions) + len(core.members)) + 64 + 1
    assert core.counters.suspicions and core.counters.records_expired and core.counters.probes_failed
