"""The reconciler as tables: view changes, endpoint choice with hysteresis, device resync; and
a fake device that applies its actions, which must always end equal to ``current``."""

from __future__ import annotations

import random

import pytest

from swarmd.wg.endpoint import format_endpoint, split_endpoint
from swarmd.wg.reconciler import (
    Member,
    PeerSpec,
    ProbeEndpoints,
    Reconciler,
    RemovePeer,
    SetPeer,
)

ME = bytes([0xEE]) * 32
IP1, IP2, IP3 = "192.0.2.1", "198.51.100.2", "2001:db8::3"


def K(n: int) -> bytes:
    return bytes([n]) * 32


def member(name: str, key: int, *, addr4: str | None = None, addr6: str | None = "auto", port: int = 51820,
           endpoints: tuple[str, ...] = (IP1,)) -> Member:
    return Member(peer=name, public=K(key), addr4=addr4 or f"10.211.0.{key}",
                  addr6=f"fd00::{key:x}" if addr6 == "auto" else addr6, port=port, endpoints=endpoints)


def summary(actions) -> list[tuple]:
    out = []
    for a in actions:
        match a:
            case SetPeer(s):  # positional, as the driver matches them
                out.append(("set", s.public[0], s.endpoint, s.allowed_ips))
            case RemovePeer(p):
                out.append(("remove", p[0]))
            case ProbeEndpoints(peer, eps):
                out.append(("probe", peer, eps))
            case _:
                raise AssertionError(f"not an action: {a!r}")
    return out


def routes(key: int) -> tuple[str, ...]:
    return (f"10.211.0.{key}/32", f"fd00::{key:x}/128")


# -- the view --------------------------------------------------------------------------------

A, B = member("A", 1), member("B", 2)
VIEW = [
    ("add", [], [A], [("set", 1, f"{IP1}:51820", routes(1))]),
    ("add two, in key order", [], [B, A], [("set", 1, f"{IP1}:51820", routes(1)),
                                           ("set", 2, f"{IP1}:51820", routes(2))]),
    ("remove", [A, B], [A], [("remove", 2)]),
    ("remove all", [A, B], [], [("remove", 1), ("remove", 2)]),
    ("no-op", [A, B], [B, A], []),
    ("changed endpoint", [A], [member("A", 1, endpoints=(IP2,))], [("set", 1, f"{IP2}:51820", routes(1))]),
    ("changed port", [A], [member("A", 1, port=4000)], [("set", 1, f"{IP1}:4000", routes(1))]),
    ("IPv6 endpoint", [], [member("A", 1, endpoints=(IP3,))], [("set", 1, f"[{IP3}]:51820", routes(1))]),
    ("no endpoint", [], [member("A", 1, endpoints=())], [("set", 1, None, routes(1))]),
    ("no IPv6 address", [], [member("A", 1, addr6=None)], [("set", 1, f"{IP1}:51820", ("10.211.0.1/32",))]),
    ("moved address", [A], [member("A", 1, addr4="10.211.9.9")],
     [("set", 1, f"{IP1}:51820", ("10.211.9.9/32", "fd00::1/128"))]),
    ("key rotation", [A, B], [member("A", 9), B], [("remove", 1), ("set", 9, f"{IP1}:51820", routes(9))]),
    ("own key is not a peer", [], [A, Member(peer="me", public=ME, addr4="10.211.0.99", addr6=None, port=1,
                                              endpoints=(IP2,))], [("set", 1, f"{IP1}:51820", routes(1))]),
    ("address collision: the lower key gets the route", [],
     [member("A", 1, addr4="10.211.0.5"), member("B", 2, addr4="10.211.0.5")],
     [("set", 1, f"{IP1}:51820", ("10.211.0.5/32", "fd00::1/128")), ("set", 2, f"{IP1}:51820", ("fd00::2/128",))]),
    ("collision resolved: the route follows the move", [member("A", 1, addr4="10.211.0.5"),
                                                       member("B", 2, addr4="10.211.0.5")], [A, B],
     [("set", 1, f"{IP1}:51820", routes(1)), ("set", 2, f"{IP1}:51820", routes(2))]),
]


@pytest.mark.parametrize("before,after,expected", [v[1:] for v in VIEW], ids=[v[0] for v in VIEW])
def test_view_changes(before, after, expected):
    r = Reconciler(ME)
    r.update_view(0.0, before)
    assert summary(r.update_view(1.0, after)) == expected
    assert summary(r.update_view(2.0, after)) == []


def test_key_rotation_removes_before_it_adds():
    r = Reconciler(ME)
    r.update_view(0.0, [A])
    actions = r.update_view(1.0, [member("A", 9)])
    assert actions == [RemovePeer(public=K(1)), SetPeer(spec=r.current[K(9)])]
    assert set(r.current) == {K(9)}


def test_two_members_with_one_key_the_lower_peer_id_wins():
    r = Reconciler(ME)
    actions = r.update_view(0.0, [member("Z", 1, endpoints=(IP2,)), member("M", 1)])
    assert summary(actions) == [("set", 1, f"{IP1}:51820", routes(1))]
    assert r.ignored == ("Z",)


def test_our_own_record_is_never_a_peer_even_after_rotation():
    r = Reconciler(K(1))
    assert summary(r.update_view(0.0, [member("me", 1), B])) == [("set", 2, f"{IP1}:51820", routes(2))]
    r.me_public = K(5)  # what the driver does after rotating our key
    assert r.update_view(1.0, [member("me", 5), B]) == []


# -- probing ---------------------------------------------------------------------------------

TWO = (IP1, IP2)


def test_several_endpoints_are_probed_once_until_the_interval():
    r = Reconciler(ME, probe_interval=60.0)
    m = member("A", 1, endpoints=TWO)
    assert summary(r.update_view(0.0, [m])) == [("set", 1, f"{IP1}:51820", routes(1)), ("probe", "A", TWO)]
    assert r.update_view(1.0, [m]) == []
    r.endpoint_rtt(2.0, "A", IP1, 0.010)
    assert r.update_view(59.9, [m]) == []
    assert summary(r.update_view(60.0, [m])) == [("probe", "A", TWO)]


def test_a_changed_candidate_list_waits_for_the_probe_interval():
    # review finding 10: a member publishing a new endpoint list in every record made every host
    # connect to addresses of its choosing at once, each time
    r = Reconciler(ME, probe_interval=60.0)
    clock = 0.0
    r.update_view(clock, [member("A", 1, endpoints=TWO)])
    probes = []
    for i in range(1, 600):  # a new list every 0.1 s for a minute
        clock = i * 0.1
        lists = (IP1, f"192.0.2.{i % 200 + 10}")
        probes += [(clock, a) for a in summary(r.update_view(clock, [member("A", 1, endpoints=lists)]))
                   if a[0] == "probe"]
    assert probes == []
    probed = summary(r.update_view(60.0, [member("A", 1, endpoints=(IP1, IP3))]))
    assert probed == [("probe", "A", (IP1, IP3))]  # the interval over: the current list is probed
    assert all(a[0] != "probe" for a in summary(r.update_view(61.0, [member("A", 1, endpoints=TWO)])))


def test_each_member_has_its_own_probe_interval():
    r = Reconciler(ME, probe_interval=60.0)
    r.update_view(0.0, [member("A", 1, endpoints=TWO)])
    got = summary(r.update_view(5.0, [member("A", 1, endpoints=TWO), member("B", 2, endpoints=TWO)]))
    assert [a for a in got if a[0] == "probe"] == [("probe", "B", TWO)]  # a new member is probed at once


def test_a_single_endpoint_is_not_probed():
    r = Reconciler(ME)
    assert [a for a in r.update_view(0.0, [A]) if isinstance(a, ProbeEndpoints)] == []


def test_a_member_that_left_and_came_back_is_probed_again_after_the_interval():
    r = Reconciler(ME, probe_interval=60.0)
    m = member("A", 1, endpoints=TWO)
    r.update_view(0.0, [m])
    r.update_view(1.0, [])
    assert ("probe", "A", TWO) not in summary(r.update_view(2.0, [m]))  # no shortcut around the interval
    r.update_view(3.0, [])
    assert ("probe", "A", TWO) in summary(r.update_view(61.0, [m]))


# -- endpoint choice -------------------------------------------------------------------------

# Each measurement is (candidate IP, RTT in seconds or None for failed); endpoint before any
# measurement is the first candidate, IP1.
HYSTERESIS = [
    ("10 ms vs 9.5 ms: stay", [(IP1, 0.010), (IP2, 0.0095)], IP1),
    ("9.5 ms vs 10 ms: stay", [(IP1, 0.0095), (IP2, 0.010)], IP1),
    ("50 ms -> 20 ms: switch", [(IP1, 0.050), (IP2, 0.020)], IP2),
    ("ratio met but gain under 5 ms: stay", [(IP1, 0.004), (IP2, 0.001)], IP1),
    ("gain met but ratio not: stay", [(IP1, 0.100), (IP2, 0.090)], IP1),
    ("current fails: switch to the live one", [(IP2, 0.080), (IP1, None)], IP2),
    ("current fails, other untried: try it", [(IP1, None)], IP2),
    ("both fail: stay on the last one tried", [(IP1, None), (IP2, None)], IP2),
    ("current unmeasured: wait for it", [(IP2, 0.001)], IP1),
    ("out of order: faster current arrives later", [(IP2, 0.020), (IP1, 0.005)], IP1),
    ("current slows down: switch", [(IP1, 0.010), (IP2, 0.012), (IP1, 0.060)], IP2),
    ("switched path recovers slightly: no switch back", [(IP1, 0.050), (IP2, 0.020), (IP1, 0.019)], IP2),
    ("port in the measurement is accepted", [(f"{IP1}:51820", 0.050), (f"{IP2}:51820", 0.020)], IP2),
]


@pytest.mark.parametrize("measurements,expected", [h[1:] for h in HYSTERESIS], ids=[h[0] for h in HYSTERESIS])
def test_endpoint_choice(measurements, expected):
    r = Reconciler(ME)
    r.update_view(0.0, [member("A", 1, endpoints=TWO)])
    for t, (endpoint, rtt) in enumerate(measurements, start=1):
        r.endpoint_rtt(float(t), "A", endpoint, rtt)
    assert r.current[K(1)].endpoint == f"{expected}:51820"


def test_no_flapping_between_near_equal_paths():
    r = Reconciler(ME)
    r.update_view(0.0, [member("A", 1, endpoints=TWO)])
    rng = random.Random(7)
    sets = []
    for t in range(200):
        one, two = (0.010, 0.0095) if t % 2 else (0.0095, 0.010)
        sets += r.endpoint_rtt(float(t), "A", IP1, one + rng.uniform(-0.0005, 0.0005))
        sets += r.endpoint_rtt(float(t), "A", IP2, two + rng.uniform(-0.0005, 0.0005))
    assert sets == []
    assert r.current[K(1)].endpoint == f"{IP1}:51820"


def test_a_switch_is_one_set_peer_with_the_new_endpoint_only():
    r = Reconciler(ME)
    r.update_view(0.0, [member("A", 1, endpoints=TWO)])
    assert r.endpoint_rtt(1.0, "A", IP1, 0.050) == []
    actions = r.endpoint_rtt(2.0, "A", IP2, 0.020)
    assert summary(actions) == [("set", 1, f"{IP2}:51820", routes(1))]
    assert r.update_view(3.0, [member("A", 1, endpoints=TWO)]) == []  # the view does not undo it


def test_a_view_without_the_chosen_endpoint_falls_back_to_the_fastest_left():
    r = Reconciler(ME)
    r.update_view(0.0, [member("A", 1, endpoints=(IP1, IP2, IP3))])
    for ip, rtt in ((IP1, 0.050), (IP2, 0.030), (IP3, 0.010)):
        r.endpoint_rtt(1.0, "A", ip, rtt)
    assert r.current[K(1)].endpoint == f"[{IP3}]:51820"
    actions = r.update_view(2.0, [member("A", 1, endpoints=(IP1, IP2))])
    assert summary(actions)[0] == ("set", 1, f"{IP2}:51820", routes(1))


IGNORED_SAMPLES = [
    ("unknown member", "Z", IP1, 0.01, 0),
    ("not a candidate", "A", "203.0.113.9", 0.01, 0),
    ("NaN", "A", IP2, float("nan"), 1),
    ("infinite", "A", IP2, float("inf"), 1),
    ("negative", "A", IP2, -0.001, 1),
]


@pytest.mark.parametrize("peer,endpoint,rtt,rejected", [s[1:] for s in IGNORED_SAMPLES],
                         ids=[s[0] for s in IGNORED_SAMPLES])
def test_samples_that_are_ignored(peer, endpoint, rtt, rejected):
    r = Reconciler(ME)
    r.update_view(0.0, [member("A", 1, endpoints=TWO)])
    r.endpoint_rtt(1.0, "A", IP1, 0.050)
    assert r.endpoint_rtt(2.0, peer, endpoint, rtt) == []
    assert r.rejected_samples == rejected
    assert r.current[K(1)].endpoint == f"{IP1}:51820"


def test_a_malformed_endpoint_is_a_value_error():
    r = Reconciler(ME)
    r.update_view(0.0, [member("A", 1, endpoints=TWO)])
    with pytest.raises(ValueError, match="IPv4:port or \\[IPv6\\]:port"):
        r.endpoint_rtt(1.0, "A", "not-an-ip:51820", 0.01)


# -- relayed paths (routing) -------------------------------------------------------------------

RELAY_EP = "203.0.113.9:51821"


def test_a_relayed_peer_is_sent_to_the_relay_and_back_to_its_own_endpoint():
    r = Reconciler(ME)
    r.update_view(0.0, [A, B])
    assert summary(r.set_relayed({"A": RELAY_EP})) == [("set", 1, RELAY_EP, routes(1))]
    assert r.current[K(2)].endpoint == f"{IP1}:51820"  # B untouched
    assert r.direct_ip("A") == IP1  # never the relay's
    assert r.set_relayed({"A": RELAY_EP}) == []  # the same again is nothing
    assert summary(r.set_relayed({})) == [("set", 1, f"{IP1}:51820", routes(1))]
    assert r.set_relayed({}) == []


def test_a_relay_endpoint_survives_view_updates_and_endpoint_switches_underneath():
    r = Reconciler(ME)
    r.update_view(0.0, [member("A", 1, endpoints=TWO), B])
    r.set_relayed({"A": RELAY_EP})
    assert r.update_view(1.0, [member("A", 1, endpoints=TWO), B]) == []
    moved = member("A", 1, endpoints=TWO, addr4="10.211.9.9")
    assert summary(r.update_view(2.0, [moved, B])) == [("set", 1, RELAY_EP, ("10.211.9.9/32", "fd00::1/128"))]
    # a measurement makes IP2 the better direct endpoint: the device keeps the relay, direct_ip follows
    r.endpoint_rtt(3.0, "A", IP1, 0.100)
    assert r.endpoint_rtt(3.0, "A", IP2, 0.010) == []
    assert r.direct_ip("A") == IP2 and r.current[K(1)].endpoint == RELAY_EP
    assert summary(r.set_relayed({})) == [("set", 1, f"{IP2}:51820", ("10.211.9.9/32", "fd00::1/128"))]


def test_a_relayed_peer_that_leaves_the_view_comes_back_direct():
    # its relay session is stale by then (the relay drops a member that left): routing must name it again
    r = Reconciler(ME)
    r.update_view(0.0, [A, B])
    r.set_relayed({"A": RELAY_EP, "B": "203.0.113.9:51822"})
    assert summary(r.update_view(1.0, [B])) == [("remove", 1)]
    assert summary(r.update_view(2.0, [A, B])) == [("set", 1, f"{IP1}:51820", routes(1))]
    assert r.current[K(2)].endpoint == "203.0.113.9:51822"


def test_a_relay_named_for_a_peer_not_in_the_view_waits_for_it():
    r = Reconciler(ME)
    r.update_view(0.0, [B])
    assert r.set_relayed({"A": RELAY_EP}) == []
    assert summary(r.update_view(1.0, [A, B])) == [("set", 1, RELAY_EP, routes(1))]


def test_relay_endpoints_are_canonical():
    r = Reconciler(ME)
    r.update_view(0.0, [A])
    assert summary(r.set_relayed({"A": "[2001:db8:0:0::9]:51821"})) == [("set", 1, "[2001:db8::9]:51821", routes(1))]


def test_direct_ip_of_a_version_for_a_relay_that_is_reached_over_ipv6():
    # routing's relays are IPv4 only: a relay reached over IPv6 must still give its IPv4 address
    v6_first = member("A", 1, endpoints=(IP3, IP1, IP2))
    r = Reconciler(ME)
    r.update_view(0.0, [v6_first])
    assert r.direct_ip("A") == IP3 and r.direct_ip("A", 6) == IP3
    assert r.direct_ip("A", 4) == IP1  # none measured: the first IPv4 candidate
    r.endpoint_rtt(1.0, "A", IP3, 0.010)
    r.endpoint_rtt(1.0, "A", IP1, None)  # failed
    r.endpoint_rtt(1.0, "A", IP2, 0.080)
    assert r.direct_ip("A") == IP3 and r.direct_ip("A", 4) == IP2
    r.endpoint_rtt(2.0, "A", IP2, None)
    assert r.direct_ip("A", 4) is None  # every IPv4 candidate failed
    assert r.direct_ip("B", 4) is None and r.direct_ip("B") is None
    v4_first = Reconciler(ME)
    v4_first.update_view(0.0, [member("A", 1, endpoints=(IP1, IP3))])
    assert v4_first.direct_ip("A", 4) == v4_first.direct_ip("A") == IP1  # the one in use, when it is IPv4

@pytest.mark.parametrize("endpoint", ["203.0.113.9", "203.0.113.9:0", "203.0.113.9:65536", "203.0.113.9:x",
                                      "2001:db8::9:51821", "[203.0.113.9]:51821", "relay.example:51821", "",
                                      "203.0.113.9:-1", "203.0.113.9:51821 "])
def test_a_malformed_relay_endpoint_raises_and_changes_nothing(endpoint):
    r = Reconciler(ME)
    r.update_view(0.0, [A, B])
    r.set_relayed({"B": RELAY_EP})
    before = dict(r.current)
    with pytest.raises(ValueError, match="IPv4:port or \\[IPv6\\]:port"):
        r.set_relayed({"A": endpoint, "B": RELAY_EP})
    assert r.current == before
    assert r.update_view(1.0, [A, B]) == []  # B still relayed, A still direct


# -- resync ----------------------------------------------------------------------------------

def _spec(key: int, endpoint: str | None = f"{IP1}:51820", allowed=None, keepalive: int = 25) -> PeerSpec:
    return PeerSpec(public=K(key), endpoint=endpoint, allowed_ips=allowed or routes(key), keepalive=keepalive)


RESYNC = [
    ("device restarted, empty", {}, [("set", 1, f"{IP1}:51820", routes(1)), ("set", 2, f"{IP1}:51820", routes(2))]),
    ("in step", {K(1): _spec(1), K(2): _spec(2)}, []),
    ("in step, allowed IPs in another order and form",
     {K(1): _spec(1, allowed=("fd00:0::1/128", "10.211.0.1/32")), K(2): _spec(2)}, []),
    ("one peer lost", {K(2): _spec(2)}, [("set", 1, f"{IP1}:51820", routes(1))]),
    ("a stranger", {K(1): _spec(1), K(2): _spec(2), K(7): _spec(7)}, [("remove", 7)]),
    ("wrong allowed IPs", {K(1): _spec(1, allowed=("10.211.0.1/32",)), K(2): _spec(2)},
     [("set", 1, f"{IP1}:51820", routes(1))]),
    ("keepalive off", {K(1): _spec(1, keepalive=0), K(2): _spec(2)}, [("set", 1, f"{IP1}:51820", routes(1))]),
    ("endpoint forgotten", {K(1): _spec(1, endpoint=None), K(2): _spec(2)}, [("set", 1, f"{IP1}:51820", routes(1))]),
    ("endpoint roamed: left to WireGuard", {K(1): _spec(1, endpoint="203.0.113.7:40000"), K(2): _spec(2)}, []),
]


@pytest.mark.parametrize("device,expected", [c[1:] for c in RESYNC], ids=[c[0] for c in RESYNC])
def test_resync(device, expected):
    r = Reconciler(ME)
    r.update_view(0.0, [A, B])
    before = dict(r.current)
    assert summary(r.resync(device)) == expected
    assert r.current == before
    assert r.update_view(1.0, [A, B]) == []  # a resync does not make the next view re-send


# -- values ----------------------------------------------------------------------------------

def test_peer_spec_is_canonical():
    a = PeerSpec(public=K(1), endpoint="[2001:0db8::0003]:51820", allowed_ips=("fd00::1/128", "10.0.0.1"))
    b = PeerSpec(public=K(1), endpoint=f"[{IP3}]:51820", allowed_ips=("10.0.0.1/32", "fd00:0:0::1/128"))
    assert a == b
    assert a.allowed_ips == ("10.0.0.1/32", "fd00::1/128")


BAD = [
    (lambda: PeerSpec(public=b"short", endpoint=None, allowed_ips=()), "peer public key must be 32 bytes"),
    (lambda: PeerSpec(public=K(1), endpoint="10.0.0.1", allowed_ips=()), "endpoint must be IPv4:port"),
    (lambda: PeerSpec(public=K(1), endpoint="fd00::1:80", allowed_ips=()), "endpoint must be IPv4:port"),
    (lambda: PeerSpec(public=K(1), endpoint=None, allowed_ips=("10.0.0.300/32",)), "allowed IPs"),
    (lambda: PeerSpec(public=K(1), endpoint=None, allowed_ips=(), keepalive=70000), "keepalive must be 0..65535"),
    (lambda: member("A", 1, port=0), "member A port must be 1..65535"),
    (lambda: member("A", 1, addr4="fd00::1"), "member A addr4: expected an IPv4 address, got 'fd00::1'"),
    (lambda: member("A", 1, addr6="10.0.0.1"), "member A addr6: expected an IPv6 address"),
    (lambda: member("A", 1, endpoints=("example.com",)),
     "member A endpoints: expected IP addresses, got 'example.com'"),
]


@pytest.mark.parametrize("make,error", BAD)
def test_bad_values_name_what_is_wrong(make, error):
    with pytest.raises(ValueError, match=error):
        make()


def test_member_endpoints_are_canonical_and_deduplicated():
    m = member("A", 1, endpoints=("2001:0db8::3", IP3, IP1))
    assert m.endpoints == (IP3, IP1)


@pytest.mark.parametrize("endpoint,parts", [("10.0.0.1:1", ("10.0.0.1", 1)), ("[::1]:65535", ("::1", 65535))])
def test_endpoint_round_trip(endpoint, parts):
    assert split_endpoint(endpoint) == parts
    assert format_endpoint(*parts) == endpoint


# -- a fake device ---------------------------------------------------------------------------

class FakeDevice:
    """Applies actions as the backend would: SetPeer replaces a peer's config, RemovePeer
    deletes it; a restart forgets everything."""

    def __init__(self) -> None:
        self.peers: dict[bytes, PeerSpec] = {}

    def apply(self, actions) -> None:
        for a in actions:
            match a:
                case SetPeer(spec=s):
                    self.peers[s.public] = s
                case RemovePeer(public=p):
                    assert p in self.peers, "removing a peer the device does not have"
                    del self.peers[p]


@pytest.mark.parametrize("seed", range(5))
def test_device_follows_a_random_history(seed):
    rng = random.Random(seed)
    r, dev = Reconciler(ME), FakeDevice()
    pool = [IP1, IP2, IP3, "203.0.113.4"]
    for t in range(300):
        event = rng.random()
        if event < 0.6:
            view = [member(f"P{n}", n + rng.choice([0, 0, 0, 100]), addr4=f"10.211.0.{rng.choice([n, 1])}",
                           endpoints=tuple(rng.sample(pool, rng.randint(0, 3))))
                    for n in range(1, 8) if rng.random() < 0.7]
            dev.apply(r.update_view(float(t), view))
        elif event < 0.85 and r._members:
            peer = rng.choice(sorted(r._members))
            ip = rng.choice(r._members[peer].endpoints or (IP1,))
            dev.apply(r.endpoint_rtt(float(t), peer, ip, rng.choice([None, rng.uniform(0.001, 0.2)])))
        elif event < 0.92:  # routing moves paths to relays and back, members or not
            relayed = {f"P{n}": f"203.0.113.9:{51821 + n}" for n in range(1, 10) if rng.random() < 0.3}
            dev.apply(r.set_relayed(relayed))
            for peer, endpoint in relayed.items():
                m = r._members.get(peer)
                assert m is None or r.current[m.public].endpoint == endpoint
        else:
            dev.peers.clear()  # wireguard-go restarted
            dev.apply(r.resync(dev.peers))
        assert dev.peers == r.current
        claimed = [ip for spec in dev.peers.values() for ip in spec.allowed_ips]
        assert len(claimed) == len(set(claimed)), "one allowed IP routed to two peers"


def test_a_member_behind_a_nat_is_sent_to_at_its_reflexive_endpoint():
    from dataclasses import replace

    r = Reconciler(K(1))
    natted = replace(member("b", 2, endpoints=()), reflexive="203.0.113.5:40000")
    [action] = r.update_view(0.0, [natted])
    assert isinstance(action, SetPeer) and action.spec.endpoint == "203.0.113.5:40000"
    assert r.direct_ip("b") == "203.0.113.5" and r.direct_ip("b", 6) is None
    r.set_relayed({"b": "198.51.100.1:51821"})  # a relay still takes precedence
    assert r.current[K(2)].endpoint == "198.51.100.1:51821"
    with pytest.raises(ValueError):
        replace(natted, reflexive="203.0.113.5")
