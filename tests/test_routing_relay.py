"""relay.py: who gets a relayed pair, on which port, for how long; and what a hostile member cannot make it do."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.routing.relay import CHANGE_BURST, CHANGE_RATE, LEASE, PENDING, REASONS, End, Grant, Pair, Refused, Relay

ME = "relay"
OURS = ("10.9.1.2", "10.9.2.2")
IPS = {"A": "10.9.1.1", "B": "10.9.2.1", "C": "10.9.1.3", "D": "10.9.2.4", "E": "10.9.1.5"}
MEMBERS = {ME, *IPS, *(f"m{i}" for i in range(40))}


def relay(**kw) -> Relay:
    kw = {"is_member": MEMBERS.__contains__, "addresses": OURS, "exclude": ("10.77.0.0/16",), "ports": (40000, 40009),
          **kw}
    return Relay(ME, **kw)


def end(peer: str, *, ip: str | None = None, wg_port: int = 51820, via_ip: str | None = None,
        pinned: bool = False) -> End:
    # distinct for the names used here
    ip = ip or IPS.get(peer) or f"10.8.{sum(map(ord, peer)) % 250}.{len(peer) % 250 + 1}"
    return End(peer=peer, ip=ip, wg_port=wg_port, via_ip=via_ip or (OURS[0] if ip.startswith("10.9.1") else OURS[1]),
               pinned=pinned)


def ask(r: Relay, now: float, a: str, b: str, **kw) -> Grant | Refused:
    return r.request(now, end(a, **kw), b)


def test_a_pair_is_active_only_once_both_ends_asked_and_both_get_one_port():
    r = relay()
    first = ask(r, 0.0, "A", "B")
    assert first == Grant(40000, False, PENDING) and r.active() == () and r.pairs == 1
    v = r.version
    second = ask(r, 1.0, "B", "A")
    assert second == Grant(40000, True, 1.0 + LEASE)
    assert r.version == v + 1
    (pair,) = r.active()
    assert pair == Pair(40000, end("A"), end("B"))
    assert ask(r, 2.0, "A", "B") == Grant(40000, True, 2.0 + LEASE)  # renewal: same port, later expiry
    assert r.version == v + 1  # nothing the kernel must know changed


def test_leases_expire_one_end_then_the_pair_and_its_port():
    r = relay()
    ask(r, 0.0, "A", "B")
    ask(r, 10.0, "B", "A")
    assert r.next_deadline() == LEASE
    assert r.expire(LEASE - 0.1) is False and len(r.active()) == 1
    assert r.expire(LEASE) is True and r.active() == ()  # A's lease ended: B alone is not relayed
    assert r.pairs == 1 and r.pending == 1 and r.next_deadline() == 10.0 + LEASE  # pending again, B's lease first
    assert r.expire(10.0 + LEASE) is False and r.pairs == 0 and r.next_deadline() is None
    assert r.ports_free == 10


def test_renewal_keeps_a_pair_alive_past_the_first_lease():
    r = relay()
    for t in range(0, 200, 20):
        ask(r, float(t), "A", "B")
        ask(r, float(t), "B", "A")
        assert len(r.active()) == 1
    assert r.expire(200.0) is False


def test_renewal_from_a_new_address_moves_that_end():
    r = relay()
    ask(r, 0.0, "A", "B")
    ask(r, 0.0, "B", "A")
    v = r.version
    ask(r, 5.0, "A", "B", ip="10.9.1.77", wg_port=4000)
    assert r.active()[0].a == End(peer="A", ip="10.9.1.77", wg_port=4000, via_ip=OURS[0])
    assert r.version == v + 1


def test_release_and_end_member():
    r = relay()
    for x, y in (("A", "B"), ("B", "A"), ("A", "C"), ("C", "A"), ("B", "C"), ("C", "B")):
        ask(r, 0.0, x, y)
    assert len(r.active()) == 3
    assert r.release(1.0, "A", "B") is True and len(r.active()) == 2
    assert r.release(1.0, "A", "B") is False  # twice: nothing more
    assert r.release(1.0, "D", "B") is False  # never asked
    assert r.end_member("C") is True and r.active() == ()
    assert r.pairs == 1  # B still holds its side of A-B
    assert r.end_member("C") is False


def test_ports_are_reused_least_recently_used_first():
    r = relay(ports=(40000, 40002))
    assert ask(r, 0.0, "A", "B").port == 40000
    assert ask(r, 0.0, "A", "C").port == 40001
    r.release(0.0, "A", "B")
    assert ask(r, 0.0, "A", "D").port == 40002  # 40000 was just freed: it waits its turn
    r.release(0.0, "A", "C")
    assert ask(r, 0.0, "B", "C").port == 40000
    assert ask(r, 0.0, "B", "D").port == 40001


def test_the_relay_is_full_at_max_pairs_active_or_when_ports_run_out():
    r = relay(max_pairs=2, ports=(40000, 40009))
    for x, y in (("A", "B"), ("B", "A"), ("C", "D"), ("D", "C")):
        assert isinstance(ask(r, 0.0, x, y), Grant)
    assert isinstance(ask(r, 0.0, "E", "A"), Grant)  # pending: not counted towards max_pairs
    assert ask(r, 0.0, "A", "E") == Refused("full", "this relay forwards for 2 pairs, its limit")
    assert isinstance(ask(r, 1.0, "B", "A"), Grant)  # a renewal of an active pair is no new pair
    r.release(1.0, "C", "D")
    assert ask(r, 1.0, "A", "E").active is True
    r2 = relay(ports=(40000, 40000))
    ask(r2, 0.0, "A", "B")
    assert ask(r2, 0.0, "C", "D").reason == "full"


def test_pending_pairs_have_small_caps_of_their_own_and_go_after_15_s():
    """A few members naming arbitrary others cannot fill the relay: a member opens at most 2
    pairs the other end has not asked for, the relay holds at most 16, and each lasts 15 s
    from its first request, renewed or not, unless the other end asks."""
    r = relay(ports=(40000, 40099))
    assert isinstance(ask(r, 0.0, "A", "m0"), Grant) and isinstance(ask(r, 0.0, "A", "m1"), Grant)
    refused = ask(r, 0.0, "A", "m2")
    assert refused.reason == "pending_limit" and "2" in refused.detail
    for i in range(2, 16, 2):  # 7 more members, 2 pending pairs each: 16 in all
        assert isinstance(ask(r, 0.0, f"m{i}", f"m{i + 20}"), Grant)
        assert isinstance(ask(r, 0.0, f"m{i}", f"m{i + 21}"), Grant)
    assert r.pending == 16 and ask(r, 0.0, "B", "C").reason == "full"
    assert isinstance(ask(r, 1.0, "m1", "A"), Grant) and len(r.active()) == 1  # the other end: active
    assert ask(r, 1.0, "B", "C").port  # a pending slot is free again
    grant = ask(r, 10.0, "A", "m0")  # a renewal does not extend the wait
    assert grant == Grant(40000, False, PENDING)
    assert r.expire(PENDING) is False and r.pending == 1  # all but B-C (asked at 1.0) went
    assert ask(r, PENDING, "m0", "A").active is False  # too late: A's side went, m0's is a new pending pair
    # an active pair that falls back to one end waits 15 s from then
    assert r.release(20.0, "m1", "A") is True and r.pending == 2  # with m0-A (B-C went at 16)
    assert r.expire(20.0 + PENDING - 0.1) is False and r.pending == 1  # m0-A went at 30, A-m1 waits
    r.expire(20.0 + PENDING)
    assert r.pending == 0 and r.pairs == 0


def test_a_member_holds_at_most_max_per_member_leases_and_cannot_use_up_anothers():
    r = relay(max_per_member=3, max_pending_per_member=10)
    for i in range(3):
        assert isinstance(ask(r, 0.0, "A", f"m{i}"), Grant)
    refused = ask(r, 0.0, "A", "m3")
    assert refused.reason == "member_limit" and "3" in refused.detail
    assert isinstance(ask(r, 1.0, "A", "m0"), Grant)  # a renewal is not a new lease
    # A named m0..m2, but m0 holds nothing yet: its own share is untouched
    for i in range(4, 7):
        assert isinstance(ask(r, 0.0, "m0", f"m{i}"), Grant)
    assert isinstance(ask(r, 0.0, "m1", "A"), Grant)


@pytest.mark.parametrize(("a", "b", "kw", "reason"), [
    ("A", "A", {}, "self_pair"),
    ("A", ME, {}, "self_pair"),
    (ME, "A", {}, "self_pair"),
    ("A", "stranger", {}, "not_member"),
    ("stranger", "A", {"ip": "10.9.1.9"}, "not_member"),
    ("A", "B", {"via_ip": "10.9.1.1"}, "not_our_address"),  # aim the relay's port at another host
    ("A", "B", {"via_ip": "10.9.3.2"}, "not_our_address"),
    ("A", "B", {"ip": "10.9.1.2"}, "bad_address"),  # the relay itself
    ("A", "B", {"ip": "127.0.0.1"}, "bad_address"),
    ("A", "B", {"ip": "169.254.169.254"}, "bad_address"),
    ("A", "B", {"ip": "224.0.0.1"}, "bad_address"),
    ("A", "B", {"ip": "255.255.255.255"}, "bad_address"),
    ("A", "B", {"ip": "0.1.2.3"}, "bad_address"),
    ("A", "B", {"ip": "240.0.0.1"}, "bad_address"),
    ("A", "B", {"ip": "10.77.0.5"}, "bad_address"),  # inside the overlay
    ("A", "B", {"via_ip": "127.0.0.1"}, "bad_address"),
    ("A", "B", {"ip": "::1"}, "ipv6"),
    ("A", "B", {"ip": "2001:db8::1"}, "ipv6"),
    ("A", "B", {"ip": "fe80::1%eth0"}, "ipv6"),
    ("A", "B", {"ip": "::ffff:127.0.0.1"}, "bad_address"),  # mapped: the IPv4 address's own checks
    ("A", "B", {"ip": "::ffff:10.9.1.2"}, "bad_address"),  # the relay itself, mapped
    ("A", "B", {"ip": "::ffff:10.9.1.1 x"}, "malformed"),
    ("A", "B", {"ip": "10.9.1.1 dnat"}, "malformed"),
    ("A", "B", {"ip": "10.9.1.1; flush ruleset"}, "malformed"),
    ("A", "B", {"via_ip": "10.9.1.2\n"}, "malformed"),
    ("A", "B", {"wg_port": 0}, "malformed"),
    ("A", "B", {"wg_port": 65536}, "malformed"),
    ("A", "B", {"wg_port": True}, "malformed"),
    ("A", "B", {"wg_port": "51820"}, "malformed"),
    ("A", "B", {"pinned": 1}, "malformed"),
    ("", "B", {"ip": "10.9.1.9"}, "malformed"),
    ("A", "x" * 129, {}, "malformed"),
])
def test_hostile_requests_are_refused_with_their_reason(a, b, kw, reason):
    r = relay()
    got = ask(r, 0.0, a, b, **kw)
    assert isinstance(got, Refused) and got.reason == reason, got
    assert got.reason in REASONS and got.detail
    assert r.pairs == 0 and r.version == 0


def test_an_ipv4_mapped_ipv6_address_is_that_ipv4_address():
    """A dual-stack listener shows an IPv4 peer as ::ffff:a.b.c.d: it is served as the IPv4
    address (its rules are IPv4 rules), and two ends at one address are still told apart."""
    r = relay()
    assert ask(r, 0.0, "A", "B", ip="::ffff:10.9.1.1", via_ip=OURS[0]).port == 40000
    assert ask(r, 0.0, "B", "A").active is True
    assert r.active()[0].a == end("A")  # stored as 10.9.1.1
    assert ask(r, 1.0, "A", "B").active is True and r.version == 1  # the same end either way
    r2 = relay()
    ask(r2, 0.0, "A", "B")
    assert ask(r2, 0.0, "B", "A", ip="::ffff:10.9.1.1", via_ip=OURS[1]).reason == "same_address"


def test_two_ends_at_one_address_are_refused():
    r = relay()
    ask(r, 0.0, "A", "B", ip="10.9.1.1")
    assert ask(r, 0.0, "B", "A", ip="10.9.1.1").reason == "same_address"
    assert r.active() == ()


def test_an_address_that_is_no_longer_ours_takes_its_ends_out():
    r = relay()
    ask(r, 0.0, "A", "B")
    ask(r, 0.0, "B", "A")
    assert r.set_addresses([OURS[0]]) is True  # B sent to OURS[1]
    assert r.active() == () and r.rows(0.0)[0]["b_ip"] is None
    with pytest.raises(ValueError):
        r.set_addresses(["127.0.0.1"])


def test_a_member_toggling_its_own_pair_is_rate_limited_and_its_partner_is_not():
    """Two colluding members toggle their pair as fast as they can (each change would be one
    `nft -f` on the relay): the one sending the changes gets CHANGE_BURST at once, then
    CHANGE_RATE a second; its refused changes change nothing, a release included (its lease runs
    on), and its partner's renewals are never refused."""
    r = relay()
    assert isinstance(ask(r, 0.0, "A", "B"), Grant)  # pending: no rule changes, nothing charged
    refused = []
    for _ in range(100):
        for got in (ask(r, 0.0, "B", "A"), r.release(0.0, "B", "A")):
            if isinstance(got, Refused):
                refused.append(got)
    assert r.version == CHANGE_BURST  # 16 activations and 16 releases, then nothing
    assert refused and {x.reason for x in refused} == {"rate_limited"} and "rate_limited" in REASONS
    assert "too often" in refused[0].detail and r.active() == ()
    assert ask(r, 1.0, "B", "A").active is True  # a second later: one more change
    assert r.release(1.0, "B", "A").reason == "rate_limited" and len(r.active()) == 1  # its lease runs on
    assert ask(r, 1.0, "B", "A").active is True  # a renewal that changes nothing is free
    assert ask(r, 1.0, "A", "B").active is True  # the partner renews as it likes
    assert ask(r, 1.0, "B", "A", wg_port=4000).reason == "rate_limited"  # moving its end is a change
    assert r.active()[0].b.wg_port == 51820 and r.version == CHANGE_BURST + 1
    v, now = r.version, 1.0
    while now < 61.0:  # a minute of toggling every 10 ms
        now += 0.01
        for got in (ask(r, now, "B", "A"), r.release(now, "B", "A")):
            assert not isinstance(got, Refused) or got.reason == "rate_limited"
        assert isinstance(ask(r, now, "A", "B"), Grant)
    assert 60 * CHANGE_RATE - 1 <= r.version - v <= 60 * CHANGE_RATE + 1
    # others are not held to B's bucket
    assert ask(r, now, "C", "D").port and ask(r, now, "D", "C").active is True


def test_honest_use_never_hits_the_rate_limit():
    """A node with the most pairs a member may hold here (16) moves all of them onto the relay at
    once, renews every 20 s, moves one pair off and back every 30 s, and at 300 s moves all of
    them off and back on: never refused."""
    r = relay(ports=(40000, 40099))
    partners = [f"m{i}" for i in range(16)]
    got = [ask(r, 0.0, m, "A") for m in partners] + [ask(r, 0.5, "A", m) for m in partners]
    assert len(r.active()) == 16
    for t in range(1, 600):
        now = float(t)
        if t % 20 == 0:
            got += [ask(r, now, m, "A") for m in partners] + [ask(r, now, "A", m) for m in partners]
        if t % 30 == 10:
            got.append(r.release(now, "A", "m0"))
        if t % 30 == 15:
            got.append(ask(r, now, "A", "m0"))
        if t == 300:
            got += [r.release(now, "A", m) for m in partners]
        if t == 301:
            got += [ask(r, now, "A", m) for m in partners]
    assert not [x for x in got if isinstance(x, Refused)]
    assert len(r.active()) == 16


def test_the_rate_limits_state_is_bounded(monkeypatch):
    """Members come and go: at most MAX_LIMITED members' buckets are kept (the least recently
    used go, and come back full)."""
    from swarmd.routing import relay as relay_module

    monkeypatch.setattr(relay_module, "MAX_LIMITED", 4)
    r = relay(change_burst=1, ports=(40000, 40099))
    for i in range(0, 20, 2):
        ask(r, 0.0, f"m{i}", f"m{i + 1}")
        assert ask(r, 0.0, f"m{i + 1}", f"m{i}").active is True
    assert len(r._changes) == 4
    assert r.release(0.0, "m19", "m18").reason == "rate_limited"  # a recent one is still held to its bucket
    assert r.release(0.0, "m1", "m0") is True  # a forgotten one comes back full


def test_rows_show_each_pair_and_its_leases():
    r = relay()
    ask(r, 0.0, "A", "B")
    assert r.rows(10.0) == [{"port": 40000, "a": "A", "b": "B", "active": False, "a_ip": "10.9.1.1",
                             "a_expires_in": LEASE - 10.0, "b_ip": None, "b_expires_in": None}]


def test_bad_settings_are_refused():
    for kw in ({"ports": (0, 10)}, {"ports": (50000, 40000)}, {"max_pairs": 0}, {"lease": 0}, {"change_burst": 0},
               {"change_rate": 0}):
        with pytest.raises(ValueError):
            relay(**kw)


OPS = st.lists(st.tuples(st.sampled_from(["ask", "release", "end", "expire"]),
                         st.sampled_from(sorted(IPS) + ["m1", "m2", ME, "stranger"]),
                         st.sampled_from(sorted(IPS) + ["m1", "m2"]),
                         st.floats(0, 5)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_invariants_hold_whatever_members_ask(ops):
    """Active pairs are always of two distinct members with distinct addresses, on distinct ports of the
    range, with both leases unexpired; caps hold; ports are never lost."""
    r = relay(max_pairs=4, max_per_member=2, ports=(40000, 40005), lease=10.0, max_pending=3, pending=4.0)
    now = 0.0
    for op, x, y, dt in ops:
        now += dt
        if op == "ask":
            ask(r, now, x, y)
        elif op == "release":
            r.release(now, x, y)
        elif op == "end":
            r.end_member(x)
        else:
            r.expire(now)
        active = r.active()
        assert len({p.port for p in active}) == len(active)
        for p in active:
            assert 40000 <= p.port <= 40005 and p.a.peer < p.b.peer and p.a.ip != p.b.ip
            assert ME not in (p.a.peer, p.b.peer)
        assert len(active) <= 4 and r.pending <= 3 and r.pairs + r.ports_free == 6
        held = {}
        for row in r.rows(now):
            for side in ("a", "b"):
                if row[f"{side}_ip"] is not None:
                    held[row[side]] = held.get(row[side], 0) + 1
                    assert row[f"{side}_expires_in"] > -10.0
        assert all(n <= 2 for n in held.values())
