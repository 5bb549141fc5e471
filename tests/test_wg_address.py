"""Overlay addresses: the derivations (pinned: every member must compute the same), the
collision rule, and convergence of members re-choosing from each other's claims."""

from __future__ import annotations

import itertools
import random
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

import pytest

from swarmd.wg import address
from swarmd.wg.address import DEFAULT_NETWORK, NetworkFull, candidates, choose, conflicts, ula, ula_prefix

KEY = bytes(range(32))
TINY = IPv4Network("10.9.8.0/29")  # 6 hosts: collisions are easy to come by


def _first(swarm, public, network=DEFAULT_NETWORK, n=1):
    return list(itertools.islice(candidates(swarm, public, network), n))


def _key(n: int) -> bytes:
    return bytes([n]) * 32


# -- derivations ----------------------------------------------------------------------------

def test_candidates_are_pinned():
    # A change here changes every member's address: it is a protocol change, not a refactor.
    assert _first("swarm-test", KEY, n=3) == [
        IPv4Address("10.211.107.249"), IPv4Address("10.211.28.7"), IPv4Address("10.211.4.39")]


def test_candidates_are_hosts_of_the_network_and_never_its_ends():
    seen = set(_first("s", KEY, TINY, n=500))
    assert seen == set(TINY.hosts())
    assert all(a in DEFAULT_NETWORK for a in _first("s", KEY, n=500))


@pytest.mark.parametrize("network", ["10.0.0.0/30", "192.168.7.0/24", "10.211.0.0/16", "10.0.0.0/8"])
def test_candidates_follow_the_configured_network(network):
    net = IPv4Network(network)
    hosts = _first("s", KEY, net, n=50)
    assert all(a in net and a not in (net.network_address, net.broadcast_address) for a in hosts)


def test_candidates_depend_on_swarm_and_key():
    base = _first("a", _key(1), n=4)
    assert base == _first("a", _key(1), n=4)
    assert base != _first("b", _key(1), n=4)
    assert base != _first("a", _key(2), n=4)


@pytest.mark.parametrize("network", ["10.0.0.0/31", "10.0.0.1/32"])
def test_networks_without_hosts_are_refused(network):
    with pytest.raises(ValueError, match=f"{network} has no host addresses: use a /30"):
        next(candidates("s", KEY, IPv4Network(network)))


def test_ula_is_pinned_and_rfc4193_shaped():
    addr = ula("swarm-test", KEY)
    assert addr == IPv6Address("fd8b:3d2b:88bf:0:bf82:4cfb:500:13d3")
    assert ula_prefix("swarm-test") == IPv6Network("fd8b:3d2b:88bf::/48")
    assert addr in IPv6Network("fd00::/8")
    assert addr.packed[6:8] == b"\0\0"  # subnet 0
    assert addr.is_private


def test_ula_prefix_is_the_swarms_and_interface_id_the_keys():
    assert ula("a", _key(1)) in ula_prefix("a")
    assert ula("a", _key(2)) in ula_prefix("a")
    assert ula_prefix("a") != ula_prefix("b")
    assert ula("a", _key(1)).packed[8:] == ula("b", _key(1)).packed[8:]
    assert ula("a", _key(1)).packed[8:] != ula("a", _key(2)).packed[8:]


# -- the collision rule ----------------------------------------------------------------------

def test_with_no_claims_a_member_takes_its_first_candidate():
    assert choose("s", KEY, {}) == _first("s", KEY)[0]


def test_own_claim_and_claims_by_higher_keys_are_ignored():
    me = _key(5)
    mine = _first("s", me)[0]
    assert choose("s", me, {me: mine, _key(6): mine, _key(200): mine}) == mine


def test_a_lower_key_claiming_our_candidate_moves_us_to_the_next():
    me = _key(5)
    first, second = _first("s", me, n=2)
    assert first != second
    assert choose("s", me, {_key(4): first}) == second
    assert choose("s", me, {_key(4): first, _key(3): second}) == _first("s", me, n=3)[2]


def test_claims_outside_the_network_or_as_strings():
    me = _key(5)
    first, second = _first("s", me, TINY, n=2)
    assert choose("s", me, {_key(1): IPv4Address("192.0.2.1")}, TINY) == first
    assert choose("s", me, {_key(1): str(first)}, TINY) == second


CONFLICTS = [
    ("lower key claims it", {_key(1): "10.0.0.2"}, True),
    ("higher key claims it", {_key(9): "10.0.0.2"}, False),
    ("our own claim", {_key(5): "10.0.0.2"}, False),
    ("lower key elsewhere", {_key(1): "10.0.0.3"}, False),
    ("nobody", {}, False),
]


@pytest.mark.parametrize("claims,expected", [c[1:] for c in CONFLICTS], ids=[c[0] for c in CONFLICTS])
def test_conflicts(claims, expected):
    claims = {k: IPv4Address(v) for k, v in claims.items()}
    assert conflicts(_key(5), IPv4Address("10.0.0.2"), claims) is expected


def test_a_full_network_says_so():
    net = IPv4Network("10.0.0.0/30")  # hosts .1 and .2
    claims = {_key(1): IPv4Address("10.0.0.1"), _key(2): IPv4Address("10.0.0.2")}
    with pytest.raises(NetworkFull, match="10.0.0.0/30 has 2 host addresses.*larger overlay network"):
        choose("s", _key(3), claims, net)
    assert choose("s", _key(0), claims, net) in net  # precedence: the lowest key always fits


# -- convergence -----------------------------------------------------------------------------

def _simulate(swarm, keys, network, max_rounds=20):
    """Everyone starts on its first candidate; each round everyone re-chooses from the claims
    of the round before. Returns (rounds until nobody moved, the final claims)."""
    claims = {k: _first(swarm, k, network)[0] for k in keys}
    for rounds in range(max_rounds):
        nxt = {k: choose(swarm, k, claims, network) for k in keys}
        if nxt == claims:
            return rounds, claims
        claims = nxt
    raise AssertionError(f"no convergence in {max_rounds} rounds: {claims}")


def _three_way_collision():
    """The first swarm id under which three keys all start on one address of TINY."""
    keys = [_key(1), _key(2), _key(3)]
    for i in range(10_000):
        swarm = f"collide-{i}"
        if len({_first(swarm, k, TINY)[0] for k in keys}) == 1:
            return swarm, keys
    raise AssertionError("no colliding swarm id found")


def test_three_members_on_one_address_converge_to_distinct_addresses():
    swarm, keys = _three_way_collision()
    rounds, claims = _simulate(swarm, keys, TINY)
    assert rounds <= 2
    assert len(set(claims.values())) == 3
    assert claims[keys[0]] == _first(swarm, keys[0], TINY)[0]  # the lowest key kept it
    assert _simulate(swarm, keys, TINY) == (rounds, claims)  # deterministic
    for k in keys:
        assert not conflicts(k, claims[k], claims)


def test_worst_case_chain_needs_two_rounds(monkeypatch):
    """A, B, C (keys in that order). B collides with A and moves onto C's address; C, which
    did not collide at first, must then move too: n - 1 rounds for n members."""
    a, b, c = _key(1), _key(2), _key(3)
    ip = {n: IPv4Address(f"10.9.8.{n}") for n in range(1, 7)}
    script = {a: [ip[1], ip[4]], b: [ip[1], ip[2], ip[5]], c: [ip[2], ip[1], ip[3], ip[6]]}
    monkeypatch.setattr(address, "candidates", lambda swarm, public, network: iter(script[public]))
    claims = {k: script[k][0] for k in (a, b, c)}
    history = [claims]
    for _ in range(4):
        claims = {k: choose("s", k, claims, TINY) for k in (a, b, c)}
        history.append(claims)
    assert history[1] == {a: ip[1], b: ip[2], c: ip[2]}  # B moved onto C
    assert history[2] == {a: ip[1], b: ip[2], c: ip[3]}  # C moved on
    assert history[2] == history[3] == history[4]


@pytest.mark.parametrize("seed", range(8))
def test_random_members_in_a_tiny_network_converge_within_n_minus_1_rounds(seed):
    rng = random.Random(seed)
    keys = [rng.randbytes(32) for _ in range(5)]  # 5 members, 6 hosts
    rounds, claims = _simulate(f"swarm-{seed}", keys, TINY)
    assert rounds <= len(keys) - 1
    assert len(set(claims.values())) == len(keys)


# -- addresses named in certificates ------------------------------------------------------------

def test_an_address_a_certificate_names_is_never_chosen_even_by_the_lowest_key():
    me = _key(1)  # no member's key is lower: only a certificate can push it off
    first, second = _first("s", me, n=2)
    assert choose("s", me, {}, bound=[first]) == second
    assert choose("s", me, {_key(9): second}, bound=[first]) == second  # a higher key's claim still ignored


def test_a_certificate_naming_our_derived_address_moves_us():
    me = _key(1)
    mine = _first("s", me)[0]
    assert not conflicts(me, mine, {_key(9): mine})
    assert conflicts(me, mine, {_key(9): mine}, bound=[mine])
    assert not conflicts(me, mine, {}, bound=[IPv4Address("10.211.0.1")])
