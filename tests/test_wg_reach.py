"""The reach core: verdicts from observers, attestations a member cannot forge (wg/reach.py)."""

from __future__ import annotations

import msgpack
import pytest
from nacl.signing import SigningKey

from swarmd.gossip.wire import MeshInfo
from swarmd.p2p.signed import Invalid, peer_from_key, peer_str, seal, unseal
from swarmd.wg import reach

SWARM = "s1"
NOW = 1_800_000_000.0
WGPUB = bytes(range(32))


def member(seed: int) -> tuple[str, reach.Signer]:
    key = SigningKey(bytes([seed]) * 32)
    return peer_str(peer_from_key(bytes(key.verify_key))), lambda data: key.sign(data).signature


SUBJECT, SUBJECT_SIGN = member(1)
A, SIGN_A = member(2)
B, SIGN_B = member(3)
C, SIGN_C = member(4)


def seen(observer: str, sign, *, wg: str | None, dial: bool | None = None, ip: str | None = "203.0.113.5",
         at: float = NOW, about: str = SUBJECT, wgpub: bytes = WGPUB) -> reach.Seen:
    blob = reach.seal_seen(sign, swarm=SWARM, observer=observer, about=about, wgpub=wgpub, wg=wg, ip=ip,
                           dial=dial, at=at)
    return reach.open_seen(blob, swarm=SWARM, about=SUBJECT, wgpub=WGPUB, now=NOW)


def verdict(*observations: reach.Seen, local: tuple[str, ...] = ("192.168.1.2",)) -> reach.Verdict:
    core = reach.Reach(wg_port=51820, local_ips=local)
    for s in observations:
        core.observed(s)
    return core.verdict(NOW)


def test_two_observers_dialling_back_make_a_node_public():
    v = verdict(seen(A, SIGN_A, wg="198.51.100.7:51820", dial=True), seen(B, SIGN_B, wg=None, dial=True))
    assert v.kind == "public" and v.label == "public" and set(v.confirmed_by) == {A, B}


def test_one_observer_is_not_enough_for_anything():
    assert verdict(seen(A, SIGN_A, wg="203.0.113.5:40000", dial=True)).kind == "unknown"
    assert verdict(seen(A, SIGN_A, wg="203.0.113.5:40000", dial=False)).kind == "unknown"


def test_the_same_reflexive_endpoint_from_two_observers_is_an_endpoint_independent_nat():
    v = verdict(seen(A, SIGN_A, wg="203.0.113.5:40000", dial=False), seen(B, SIGN_B, wg="203.0.113.5:40000"))
    assert v.kind == "eim" and v.reflexive == "203.0.113.5:40000"
    assert v.label == "behind NAT (endpoint-independent)" and len(v.seen) == 2


def test_different_ports_at_one_address_are_a_symmetric_nat():
    v = verdict(seen(A, SIGN_A, wg="203.0.113.5:40000", at=NOW - 5), seen(B, SIGN_B, wg="203.0.113.5:51111"))
    assert v.kind == "edm" and v.label == "behind NAT (symmetric)"
    assert v.reflexive == "203.0.113.5:51111"  # the newest: a hint for address-restricted peers


def test_a_rebound_nats_new_port_outvotes_the_old_ones_still_in_the_window():
    old = [seen(o, sign, wg="203.0.113.5:40000", at=NOW - 60) for o, sign in ((A, SIGN_A), (B, SIGN_B), (C, SIGN_C))]
    d, sign_d = member(5)
    e, sign_e = member(6)
    fresh = [seen(d, sign_d, wg="203.0.113.5:2222", at=NOW - 2), seen(e, sign_e, wg="203.0.113.5:2222")]
    v = verdict(*old, *fresh)
    assert v.kind == "eim" and v.reflexive == "203.0.113.5:2222" and set(v.confirmed_by) == {d, e}
    v = verdict(*old, fresh[1])  # one fresh observation: the old mapping stands until a second agrees
    assert v.kind == "eim" and v.reflexive == "203.0.113.5:40000"


@pytest.mark.parametrize("stale_last", [True, False])
def test_observers_that_never_see_the_rebound_port_do_not_outvote_two_that_did(stale_last):
    """What the reach lab showed: after h4's NAT rebound, the public observers saw its new port,
    while members behind port-filtering NATs kept naming the old one in fresh answers (each
    round asks one of them): three of those outnumbered the two that saw the move, and the
    verdict went back and forth with the order the answers came in, for minutes."""
    core = reach.Reach(wg_port=51820)
    public, filtered = [(A, SIGN_A), (B, SIGN_B)], [(C, SIGN_C), member(5), member(6)]
    for o, sign in public + filtered:
        core.observed(seen(o, sign, wg="203.0.113.5:40000", at=NOW - 100))
    assert core.verdict(NOW).reflexive == "203.0.113.5:40000"
    for round_, (o, sign) in enumerate(filtered):  # a round: both public observers and one filtered one
        at = NOW - 30 + 10 * round_
        moved = [seen(p, psign, wg="203.0.113.5:2222", at=at + i) for i, (p, psign) in enumerate(public)]
        stale = seen(o, sign, wg="203.0.113.5:40000", at=at + (5 if stale_last else -5))
        for s in ([*moved, stale] if stale_last else [stale, *moved]):
            core.observed(s)
        v = core.verdict(at + 5)
        assert v.kind == "eim" and v.reflexive == "203.0.113.5:2222" and set(v.confirmed_by) == {A, B}, round_
    core.observed(seen(C, SIGN_C, wg="203.0.113.5:2222", at=NOW))  # and one that moved late agrees
    assert core.verdict(NOW).reflexive == "203.0.113.5:2222"


def test_one_liar_naming_another_port_of_the_nat_is_outvoted():
    v = verdict(seen(A, SIGN_A, wg="203.0.113.5:40000", at=NOW - 2), seen(B, SIGN_B, wg="203.0.113.5:40000",
                                                                           at=NOW - 1),
                seen(C, SIGN_C, wg="203.0.113.5:9999"))
    assert v.kind == "eim" and v.reflexive == "203.0.113.5:40000" and C not in v.confirmed_by


def test_own_address_seen_and_no_dial_back_is_a_firewall():
    local = ("198.51.100.9",)
    v = verdict(seen(A, SIGN_A, wg="198.51.100.9:51820", dial=False), seen(B, SIGN_B, wg="198.51.100.9:51820",
                                                                          dial=False), local=local)
    assert v.kind == "firewall" and v.reflexive == "198.51.100.9:51820"


def test_a_lying_observer_is_outvoted():
    v = verdict(seen(A, SIGN_A, wg="203.0.113.5:40000"), seen(B, SIGN_B, wg="203.0.113.5:40000"),
                seen(C, SIGN_C, wg="192.0.2.66:9999", at=NOW + 1))
    assert v.kind == "eim" and v.reflexive == "203.0.113.5:40000" and C not in v.confirmed_by


def test_a_rationed_dial_back_carries_over_and_old_observations_expire():
    core = reach.Reach(wg_port=51820, window=60)
    core.observed(seen(A, SIGN_A, wg=None, dial=True, at=NOW - 10))
    core.observed(seen(A, SIGN_A, wg=None, dial=None, at=NOW - 5))
    core.observed(seen(B, SIGN_B, wg=None, dial=True, at=NOW - 1))
    assert core.verdict(NOW).kind == "public"
    assert core.verdict(NOW + 100).kind == "unknown"


def blobs(*pairs) -> list[bytes]:
    return [reach.seal_seen(sign, swarm=SWARM, observer=obs, about=SUBJECT, wgpub=WGPUB, wg=wg, ip=None, dial=None,
                            at=NOW) for obs, sign, wg in pairs]


def confirmed(seen_blobs, reflexive="203.0.113.5:40000", members=(A, B, C, SUBJECT), **kw) -> bool:
    return reach.confirmed(seen_blobs, reflexive, swarm=SWARM, about=SUBJECT, wgpub=WGPUB, now=kw.get("now", NOW),
                           is_member=set(members).__contains__)


def test_a_reflexive_endpoint_needs_two_members_attesting_it():
    good = blobs((A, SIGN_A, "203.0.113.5:40000"), (B, SIGN_B, "203.0.113.5:40000"))
    assert confirmed(good)
    assert not confirmed(good[:1])
    assert not confirmed(good, members=(A, SUBJECT))  # B is no member (any more)
    assert not confirmed(good, now=NOW + reach.SEEN_TTL + 1)  # stale


def test_a_member_cannot_aim_the_swarm_at_a_victim():
    # its own attestations, and attestations of its real endpoint, do not vouch for another address
    own = blobs((SUBJECT, SUBJECT_SIGN, "192.0.2.66:53"), (A, SIGN_A, "203.0.113.5:40000"))
    assert not confirmed(own, reflexive="192.0.2.66:53")
    real = blobs((A, SIGN_A, "203.0.113.5:40000"), (B, SIGN_B, "203.0.113.5:40000"))
    assert not confirmed(real, reflexive="192.0.2.66:53")
    assert not confirmed(real, reflexive="203.0.113.5:53")  # the address, but a port nobody saw


def test_an_attestation_for_another_member_or_key_or_forged_is_refused():
    other = reach.seal_seen(SIGN_A, swarm=SWARM, observer=A, about=B, wgpub=WGPUB, wg="203.0.113.5:1", ip=None,
                            dial=None, at=NOW)
    with pytest.raises(Invalid, match="another member"):
        reach.open_seen(other, swarm=SWARM, about=SUBJECT, now=NOW)
    key = reach.seal_seen(SIGN_A, swarm=SWARM, observer=A, about=SUBJECT, wgpub=b"\1" * 32, wg="203.0.113.5:1",
                          ip=None, dial=None, at=NOW)
    with pytest.raises(Invalid, match="WireGuard key"):
        reach.open_seen(key, swarm=SWARM, about=SUBJECT, wgpub=WGPUB, now=NOW)
    forged = reach.seal_seen(SIGN_B, swarm=SWARM, observer=A, about=SUBJECT, wgpub=WGPUB, wg="203.0.113.5:1",
                             ip=None, dial=None, at=NOW)  # signed by B, in A's name
    with pytest.raises(Invalid):
        reach.open_seen(forged, swarm=SWARM, about=SUBJECT, now=NOW)


@pytest.mark.parametrize("field, value, reason", [
    ("wg", "not an endpoint", "malformed"), ("wg", 7, "malformed"), ("ip", "999.1.1.1", "malformed"),
    ("dial", "yes", "malformed"), ("at", float("nan"), "stale"), ("at", NOW + 3600, "stale"),
    # what else a hostile observer can put in a body it signs itself
    ("at", NOW - reach.SEEN_TTL - 1, "stale"), ("at", 2**64 - 1, "stale"), ("at", -2**63, "stale"),
    ("at", "now", "malformed"), ("at", True, "malformed"), ("at", None, "malformed"),
    ("peer", 7, "malformed"), ("peer", b"\0" * 38, "malformed"), ("peer", A, "malformed"),
    ("about", SUBJECT, "malformed"), ("about", {"about": {}}, "malformed"), ("wgpub", None, "malformed"),
    ("wg", "203.0.113.5:0", "malformed"), ("wg", "203.0.113.5:65536", "malformed"),
    ("wg", "203.0.113.5:-1", "malformed"),
    ("wg", "[::1]:" + "9" * 20, "malformed"), ("wg", "::1:51820", "malformed"), ("wg", "9" * 70, "malformed"),
    ("wg", ["203.0.113.5:1"], "malformed"), ("wg", {"wg": {"wg": {}}}, "malformed"), ("ip", 2**64 - 1, "malformed"),
    ("ip", ["192.0.2.1"], "malformed"), ("dial", 1, "malformed"), ("k", "cert", "malformed"),
    ("swarm", "0123456789abcdef", "malformed"), ("swarm", 5, "malformed"),
], ids=lambda v: repr(v)[:24])
def test_a_malformed_attestation_is_refused(field, value, reason):
    from nacl.signing import SigningKey as Key

    key = Key(bytes([2]) * 32)
    body = {"k": "seen", "swarm": SWARM, "peer": peer_from_key(bytes(key.verify_key)),
            "about": peer_from_key(bytes(SigningKey(bytes([1]) * 32).verify_key)), "wgpub": WGPUB,
            "wg": "203.0.113.5:1", "ip": None, "dial": None, "at": NOW, field: value}
    blob = seal(body, lambda data: key.sign(data).signature)
    with pytest.raises(Invalid) as refused:
        reach.open_seen(blob, swarm=SWARM, about=SUBJECT, now=NOW)
    assert refused.value.reason == reason
    with pytest.raises(Invalid, match="at most"):
        reach.open_seen(b"x" * (reach.MAX_SEEN_BYTES + 1), swarm=SWARM, about=SUBJECT, now=NOW)


def test_a_replayed_attestation_expires_and_a_touched_one_does_not_verify():
    (blob,) = blobs((A, SIGN_A, "203.0.113.5:40000"))
    assert reach.open_seen(blob, swarm=SWARM, about=SUBJECT, wgpub=WGPUB, now=NOW + reach.SEEN_TTL).observer == A
    with pytest.raises(Invalid) as stale:
        reach.open_seen(blob, swarm=SWARM, about=SUBJECT, wgpub=WGPUB, now=NOW + reach.SEEN_TTL + 1)
    assert stale.value.reason == "stale"
    body, raw, sig = unseal(blob)
    for touched in (msgpack.packb([raw, bytes([sig[0] ^ 1]) + sig[1:]]),  # the signature
                    msgpack.packb([raw.replace(b"203.0.113.5", b"203.0.113.6"), sig])):  # the endpoint
        with pytest.raises(Invalid) as forged:
            reach.open_seen(touched, swarm=SWARM, about=SUBJECT, wgpub=WGPUB, now=NOW)
        assert forged.value.reason == "signature"


@pytest.mark.parametrize("blob", [None, 5, 2**64 - 1, "seen", [b"", b""], {"seen": b""}, bytearray(b"x"), b"",
                                  b"\xc1", msgpack.packb([b"x", b"y", b"z"]), msgpack.packb([b"\xc1", b"sig"]),
                                  msgpack.packb([msgpack.packb([1, 2]), b"sig"])], ids=repr)
def test_anything_but_a_signed_attestation_is_refused_not_raised(blob):
    with pytest.raises(Invalid) as refused:
        reach.open_seen(blob, swarm=SWARM, about=SUBJECT, wgpub=WGPUB, now=NOW)
    assert refused.value.reason == "malformed"
    good = blobs((A, SIGN_A, "203.0.113.5:40000"), (B, SIGN_B, "203.0.113.5:40000"))
    assert not confirmed([blob] * 3) and not confirmed([blob, good[0]]) and confirmed([blob, *good])


@pytest.mark.parametrize("reflexive", ["", "203.0.113.5", "203.0.113.5:0", "203.0.113.5:65536", "::1:40000",
                                       "x" * 10_000 + ":40000"])
def test_a_reflexive_endpoint_that_is_none_is_never_confirmed(reflexive):
    assert not confirmed(blobs((A, SIGN_A, "203.0.113.5:40000"), (B, SIGN_B, "203.0.113.5:40000")), reflexive=reflexive)


def test_a_record_carries_how_it_is_reached_and_refuses_nonsense():
    info = MeshInfo(public=WGPUB, addr4="10.211.0.5", addr6=None, port=51820, endpoints=(), nat="eim",
                    reflexive="203.0.113.5:40000", seen=(b"a", b"b"), tcp=4001)
    assert MeshInfo.from_wire(msgpack.unpackb(msgpack.packb(info.to_wire()))) == info
    wire = info.to_wire()
    for name, bad in (("nat", "cone"), ("reflexive", "203.0.113.5"), ("reflexive", 5), ("tcp", 0), ("tcp", True),
                      ("seen", [b"x"] * (reach.MAX_SEEN + 1)), ("seen", [b"x" * 600])):
        with pytest.raises(Invalid, match=f"record.wg.{name}"):
            MeshInfo.from_wire({**wire, name: bad})


def test_an_observer_that_cannot_prove_our_endpoint_this_time_does_not_unmake_the_verdict():
    core = reach.Reach(wg_port=51820)
    core.observed(seen(A, SIGN_A, wg="203.0.113.5:40000", at=NOW - 30))
    core.observed(seen(B, SIGN_B, wg="203.0.113.5:40000", at=NOW - 30))
    core.observed(seen(A, SIGN_A, wg=None, dial=False, at=NOW))
    v = core.verdict(NOW)
    assert v.kind == "eim" and v.reflexive == "203.0.113.5:40000" and len(v.seen) == 2
    assert core.verdict(NOW + reach.WINDOW).kind == "unknown"  # until the window ends
