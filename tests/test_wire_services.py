"""The service registry's share of a record (swarmd/gossip/registry.py): claims by controllers,
replicas by hosts, round trips, and what a misbehaving member's record is refused for."""

import hashlib

import pytest

from swarmd.gossip.registry import (MAX_ASSIGNED, MAX_CLAIMS, MAX_DEMAND, MAX_REPLICAS, DemandEntry, ReplicaEntry,
                                    ServiceClaim, claims_from_wire, demand_from_wire, replicas_from_wire)
from swarmd.p2p.signed import Invalid, peer_str

from test_wire import OTHER_PEER, PEER, decode, record, record_body, sealed

HOST = peer_str(OTHER_PEER)
ME = peer_str(PEER)
CLAIM = ServiceClaim(name="embed", created=1_700_000_000.0, access="token",
                     token_sha256=hashlib.sha256(b"secret").digest(), health="/healthz",
                     assigned=((0, HOST), (1, ME)))
REPLICA = ReplicaEntry(service="embed", index=1, controller=ME, port=31000, healthy=True)
DEMAND = DemandEntry(service="embed", rate=340.5, in_flight=12.25, p99_ms=180.0, p50_ms=41.5)


def test_claims_and_replicas_travel_in_a_record_and_come_back_the_same():
    r = decode(record(services=(CLAIM,), replicas=(REPLICA,), demand=(DEMAND,)))
    assert r.services == (CLAIM,) and r.replicas == (REPLICA,) and r.demand == (DEMAND,)
    plain = decode(record())
    assert plain.services == () and plain.replicas == () and plain.demand == ()
    empty = record()
    assert all(f not in empty for f in (b"services", b"replicas", b"demand")), "no field when there is nothing to say"


def test_entries_are_small():
    import msgpack
    assert len(msgpack.packb(REPLICA.to_wire())) <= 64
    assert len(msgpack.packb(DEMAND.to_wire())) <= 48
    assert len(msgpack.packb(CLAIM.to_wire())) <= 60 + 40 * len(CLAIM.assigned) + 32  # and the token's hash


BAD_CLAIMS = {
    "not a map": ["embed"],
    "name with a slash": {**CLAIM.to_wire(), "n": "a/b"},
    "name upper case": {**CLAIM.to_wire(), "n": "Embed"},
    "name too long": {**CLAIM.to_wire(), "n": "a" * 64},
    "name ends with a dash": {**CLAIM.to_wire(), "n": "embed-"},
    "name with a control character": {**CLAIM.to_wire(), "n": "em\x1bbed"},
    "created not finite": {**CLAIM.to_wire(), "c": float("nan")},
    "created a bool": {**CLAIM.to_wire(), "c": True},
    "unknown access": {**CLAIM.to_wire(), "a": "everyone"},
    "token access without a hash": {**CLAIM.to_wire(), "t": None},
    "a hash without token access": {**CLAIM.to_wire(), "a": "public"},
    "a short hash": {**CLAIM.to_wire(), "t": b"x" * 31},
    "health relative": {**CLAIM.to_wire(), "h": "healthz"},
    "health with a query": {**CLAIM.to_wire(), "h": "/h?x=1"},
    "health with a newline": {**CLAIM.to_wire(), "h": "/h\r\nX: y"},
    "assignment not a list": {**CLAIM.to_wire(), "r": {}},
    "index negative": {**CLAIM.to_wire(), "r": [[-1, OTHER_PEER]]},
    "index too large": {**CLAIM.to_wire(), "r": [[1000, OTHER_PEER]]},
    "index a bool": {**CLAIM.to_wire(), "r": [[True, OTHER_PEER]]},
    "host not a peer id": {**CLAIM.to_wire(), "r": [[0, b"\x00" * 38]]},
    "an index twice": {**CLAIM.to_wire(), "r": [[0, OTHER_PEER], [0, PEER]]},
    "too many assigned": {**CLAIM.to_wire(), "r": [[i, OTHER_PEER] for i in range(MAX_ASSIGNED + 1)]},
}


@pytest.mark.parametrize("data", BAD_CLAIMS.values(), ids=BAD_CLAIMS.keys())
def test_a_malformed_claim_is_refused_naming_what_is_wrong(data):
    with pytest.raises(Invalid) as exc:
        claims_from_wire([data])
    assert exc.value.reason == "malformed" and "record.services" in exc.value.detail


BAD_REPLICAS = {
    "not a list": {"n": "embed"},
    "too short": ["embed", 0, PEER, 31000],
    "too long": ["embed", 0, PEER, 31000, True, 0],
    "bad name": ["../x", 0, PEER, 31000, True],
    "index out of range": ["embed", 5000, PEER, 31000, True],
    "controller not a peer": ["embed", 0, b"nobody", 31000, True],
    "port zero": ["embed", 0, PEER, 0, True],
    "port too large": ["embed", 0, PEER, 65536, True],
    "port a bool": ["embed", 0, PEER, True, True],
    "healthy not a bool": ["embed", 0, PEER, 31000, 1, 0],
}


@pytest.mark.parametrize("data", BAD_REPLICAS.values(), ids=BAD_REPLICAS.keys())
def test_a_malformed_replica_entry_is_refused_naming_what_is_wrong(data):
    with pytest.raises(Invalid) as exc:
        replicas_from_wire([data])
    assert exc.value.reason == "malformed" and "record.replicas" in exc.value.detail


BAD_DEMAND = {
    "not a list": {"service": "embed"},
    "too short": ["embed", 1.0, 1.0],
    "bad name": ["Embed", 1.0, 1.0, None, None],
    "rate negative": ["embed", -1.0, 1.0, None, None],
    "rate not finite": ["embed", float("inf"), 1.0, None, None],
    "rate NaN": ["embed", float("nan"), 1.0, None, None],
    "rate beyond what one gateway may carry": ["embed", 1e9, 1.0, None, None],
    "in flight beyond the bound": ["embed", 1.0, 1e7, None, None],
    "in flight a bool": ["embed", 1.0, True, None, None],
    "p99 a string": ["embed", 1.0, 1.0, "fast", None],
    "p99 negative": ["embed", 1.0, 1.0, -5.0, None],
    "p50 not finite": ["embed", 1.0, 1.0, None, float("nan")],
    "p50 beyond an hour": ["embed", 1.0, 1.0, None, 4e6],
    "the old four-field form": ["embed", 1.0, 1.0, None],
}


@pytest.mark.parametrize("data", BAD_DEMAND.values(), ids=BAD_DEMAND.keys())
def test_a_malformed_demand_entry_is_refused_naming_what_is_wrong(data):
    with pytest.raises(Invalid) as exc:
        demand_from_wire([data])
    assert exc.value.reason == "malformed" and "record.demand" in exc.value.detail


def test_lists_are_bounded_and_entries_unique():
    with pytest.raises(Invalid, match="at most"):
        demand_from_wire([[f"s{i}", 1.0, 1.0, None, None] for i in range(MAX_DEMAND + 1)])
    with pytest.raises(Invalid, match="twice"):
        demand_from_wire([DEMAND.to_wire(), DEMAND.to_wire()])
    claim = CLAIM.to_wire()
    with pytest.raises(Invalid, match="at most"):
        claims_from_wire([{**claim, "n": f"s{i}"} for i in range(MAX_CLAIMS + 1)])
    with pytest.raises(Invalid, match="claimed twice"):
        claims_from_wire([claim, claim])
    entry = REPLICA.to_wire()
    with pytest.raises(Invalid, match="at most"):
        replicas_from_wire([["embed", i, PEER, 30000 + i, True] for i in range(MAX_REPLICAS + 1)])
    with pytest.raises(Invalid, match="announced twice"):
        replicas_from_wire([entry, [*entry[:3], 31001, True]])
    with pytest.raises(Invalid, match="one port"):
        replicas_from_wire([entry, ["other", 0, PEER, entry[3], True]])


def test_a_record_with_a_malformed_entry_is_refused_whole():
    for field, value in (("services", [{"n": "x"}]), ("replicas", [["x"]]), ("services", "embed"),
                         ("replicas", None), ("demand", [["embed", -1, 0, None, None]]), ("demand", {})):
        with pytest.raises(Invalid) as exc:
            decode(sealed(record_body(**{field: value})))
        assert exc.value.reason == "malformed", (field, value)
