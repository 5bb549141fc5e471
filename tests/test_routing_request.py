"""routing/request.py: every way a member's relay request is refused, and a valid one.

The sender is a certified member and may be hostile: it signs whatever it likes, so each
field is checked where it enters, and each refusal names its reason (the metric label)."""

from __future__ import annotations

import msgpack
import pytest
from nacl.signing import SigningKey

from swarmd.gossip.cert import swarm_id
from swarmd.p2p.signed import Invalid, peer_from_key, peer_str, seal
from swarmd.routing import request as rq

SWARM = swarm_id(bytes(SigningKey(b"\x0a" * 32).verify_key))
KEYS = {name: SigningKey(bytes([n]) * 32) for n, name in enumerate(("a", "b", "relay", "stranger"), start=1)}
RAW = {name: peer_from_key(bytes(k.verify_key)) for name, k in KEYS.items()}
ID = {name: peer_str(raw) for name, raw in RAW.items()}
A, B, RELAY = ID["a"], ID["b"], ID["relay"]
NOW = 1_700_000_000.0


def signer(name: str):
    return lambda data: KEYS[name].sign(data).signature


def body(**changes):
    """A request's body as make() writes it (A asks RELAY for the pair A-B); ... removes a field."""
    out = {"v": 1, "k": "relay", "swarm": SWARM, "peer": RAW["a"], "relay": RAW["relay"], "other": RAW["b"],
           "via_ip": "192.0.2.7", "op": "relay", "issued": NOW}
    out.update(changes)
    return {k: v for k, v in out.items() if v is not ...}


def check(blob, *, sender=A, me=RELAY, now=NOW, swarm=SWARM):
    return rq.check(blob, swarm=swarm, me=me, sender=sender, now=now)


def refused(blob, **kw) -> Invalid:
    with pytest.raises(Invalid) as err:
        check(blob, **kw)
    return err.value


@pytest.mark.parametrize("op", rq.OPS)
def test_a_valid_request_round_trips(op):
    blob = rq.make(signer("a"), swarm=SWARM, peer=A, relay=RELAY, other=B, via_ip="192.0.2.7", op=op,
                   issued=NOW - 3)
    assert check(blob) == rq.Request(peer=A, relay=RELAY, other=B, via_ip="192.0.2.7", op=op, issued=NOW - 3)
    assert isinstance(check(blob).issued, float)


def test_an_integer_issued_time_is_a_time():
    assert check(seal(body(issued=int(NOW)), signer("a"))).issued == NOW


def test_another_swarm():
    assert refused(seal(body(swarm="another"), signer("a"))).reason == "swarm"
    blob = seal(body(), signer("a"))
    assert refused(blob, swarm=swarm_id(bytes(SigningKey(b"\x0c" * 32).verify_key))).reason == "swarm"


def test_signed_by_someone_other_than_the_sender():
    # B's own valid request, relayed by A as if it were A's: the connection's peer decides
    blob = seal(body(peer=RAW["b"], other=RAW["a"]), signer("b"))
    assert check(blob, sender=B).peer == B
    err = refused(blob, sender=A)
    assert err.reason == "malformed" and "another peer" in err.detail


def test_a_forged_signature():
    # A signs a request in B's name (B is the stream's peer, as if A had B's connection)
    assert refused(seal(body(peer=RAW["b"], other=RAW["a"]), signer("a")), sender=B).reason == "signature"
    raw = msgpack.packb(body(), use_bin_type=True)
    sig = KEYS["a"].sign(raw).signature
    tampered = msgpack.packb([raw.replace(b"192.0.2.7", b"192.0.2.8"), sig], use_bin_type=True)
    assert refused(tampered).reason == "signature"
    assert refused(msgpack.packb([raw, sig[:-1] + bytes([sig[-1] ^ 1])], use_bin_type=True)).reason == "signature"


def test_addressed_to_another_relay():
    # a request A made for relay S, replayed to us, must not make us relay
    blob = seal(body(relay=RAW["stranger"]), signer("a"))
    err = refused(blob)
    assert err.reason == "malformed" and "another relay" in err.detail
    assert check(blob, me=ID["stranger"]).relay == ID["stranger"]


@pytest.mark.parametrize("other", ["a", "relay"])
def test_a_pair_with_itself_or_with_the_relay(other):
    err = refused(seal(body(other=RAW[other]), signer("a")))
    assert err.reason == "malformed" and "itself or with the relay" in err.detail


@pytest.mark.parametrize("name, value", [
    ("peer", b"\x00\x24" + b"x" * 36),  # not an Ed25519 id
    ("relay", b"not a peer id"), ("other", b"not a peer id"), ("other", peer_str(RAW["b"])), ("other", None),
    ("relay", ...), ("other", ...), ("other", [RAW["b"]]),
])
def test_peer_ids_that_are_not_ed25519_ids_are_malformed(name, value):
    assert refused(seal(body(**{name: value}), signer("a"))).reason == "malformed"


@pytest.mark.parametrize("op", ["RELAY", "", None, 1, True, ["relay"], "relay ", "releasee", ...])
def test_an_unknown_op(op):
    err = refused(seal(body(op=op), signer("a")))
    assert err.reason == "malformed" and "op must be one of relay, release" in err.detail


@pytest.mark.parametrize("issued, reason", [
    (NOW - rq.FRESH - 0.5, "stale"), (NOW + rq.FRESH + 0.5, "stale"),  # a replay, or made to be one later
    (0, "stale"), (2**63, "stale"), (-(2**63), "stale"),
    (float("nan"), "stale"), (float("inf"), "stale"), (float("-inf"), "stale"),
    (True, "malformed"), (False, "malformed"), ("1700000000", "malformed"), (None, "malformed"), (..., "malformed"),
])
def test_issued_outside_the_window_or_not_a_time(issued, reason):
    assert refused(seal(body(issued=issued), signer("a"))).reason == reason


@pytest.mark.parametrize("issued", [NOW - rq.FRESH, NOW + rq.FRESH])
def test_issued_at_the_edges_of_the_window(issued):
    assert check(seal(body(issued=issued), signer("a"))).issued == issued


@pytest.mark.parametrize("via_ip", [
    "127.0.0.1", "127.1.2.3", "224.0.0.1", "239.255.255.250", "0.0.0.0", "0.1.2.3", "255.255.255.255",
    "240.0.0.1", "169.254.169.254", "::1", "2001:db8::1", "::ffff:192.0.2.7", "192.0.2.7:51820",
    "192.0.2.7/32", "192.0.2.07", " 192.0.2.7", "192.0.2.7" + " " * 100, "1" * 1000, "", "example.com",
    None, 3221225991, b"192.0.2.7", ["192.0.2.7"], ...,
])
def test_via_ip_must_be_a_unicast_ipv4_host(via_ip):
    err = refused(seal(body(via_ip=via_ip), signer("a")))
    assert err.reason == "bad_address" and "via_ip" in err.detail
    assert len(err.detail) < 200  # a long value is not echoed whole into the log and the answer


@pytest.mark.parametrize("via_ip", ["10.0.0.1", "192.168.1.2", "100.64.0.1", "198.51.100.9"])
def test_private_and_public_via_ips_are_taken(via_ip):
    assert check(seal(body(via_ip=via_ip), signer("a"))).via_ip == via_ip


@pytest.mark.parametrize("blob", [
    None, "a string", 12, [b"x", b"y"], bytearray(b"xx"), {"req": b"x"},
    b"", b"\xc1", b"\x92\x01\x02", msgpack.packb([b"\x90", b"sig"]),  # not a signed map
])
def test_not_a_signed_blob_is_malformed(blob):
    assert refused(blob).reason == "malformed"


def test_an_oversize_blob_is_refused_before_it_is_decoded():
    blob = seal(body(pad=b"x" * rq.MAX_REQUEST), signer("a"))
    assert len(blob) > rq.MAX_REQUEST
    err = refused(blob)
    assert err.reason == "malformed" and str(rq.MAX_REQUEST) in err.detail
    # the same body a little smaller is fine: unknown fields are ignored
    assert check(seal(body(pad=b"x" * 100), signer("a"))).peer == A


@pytest.mark.parametrize("changes", [{"v": 2}, {"v": "1"}, {"v": ...}, {"k": "record"}, {"k": ...}])
def test_another_version_or_kind(changes):
    assert refused(seal(body(**changes), signer("a"))).reason == "malformed"



# --- whatever a member signs, check answers a Request or Invalid, nothing else ---

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40) | st.sampled_from([RAW["a"], RAW["b"], RAW["relay"], "192.0.2.7", "relay", "release"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(sorted(body())), _values | st.just(...), max_size=4))
def test_any_signed_body_is_a_request_or_invalid(changes):
    try:
        got = check(seal(body(**changes), signer("a")))
    except Invalid as exc:
        assert exc.reason in ("malformed", "swarm", "signature", "stale", "bad_address")
        return
    # what passed is exactly what the rules allow
    assert got.peer == A and got.relay == RELAY and got.other not in (A, RELAY)
    assert got.op in rq.OPS and abs(got.issued - NOW) <= rq.FRESH
    assert rq.ipv4_host(got.via_ip, "via_ip") == got.via_ip
