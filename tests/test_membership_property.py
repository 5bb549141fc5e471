"""Property: no sequence of well-signed messages from certified members breaks the membership core.

Random records (any seq, the 2^64 edge included), rumors of every kind about anyone at any
incarnation, and sync claims, signed by real member keys and checked by the real Verifier,
are thrown at a core driven by a fake clock. Whatever comes: no exception escapes, every
action the core emits encodes on the wire (the crash of issue 11 was a refutation at
2^64), and no counter goes negative."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nacl.signing import SigningKey

from swarmd.gossip.capacity import Resources
from swarmd.gossip.cert import issue_cert, swarm_id
from swarmd.gossip.membership import (Changed, Membership, Probe, ProbeVia, PublishRecord, PublishRumor, State,
                                      Sync, Timing)
from swarmd.gossip.signed import Invalid, peer_from_key, peer_str
from swarmd.gossip.wire import MAX_SEQ, Record, Verifier, make_record, make_rumor

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
                    assert why is None or result == why
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
    for t in (31.0, 62.0):  # refreshes, where the daemon died
        core.handle_timeout(t)
        encodes(core, wall + t)
    assert core.seq == FIRST_SEQ + 3
