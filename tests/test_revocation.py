"""Revocations (revocation.py), the owner's registries (owner.py), and how records meet them
(wire.Verifier: a revoked signer, an address other than the certificate's, a key without proof)."""

import ipaddress

import pytest
from nacl.signing import SigningKey

from swarmd.gossip.capacity import Resources
from swarmd.gossip.cert import issue_cert, swarm_id
from swarmd.gossip.owner import QUARANTINE, Invites, Members, Refused
from swarmd.gossip.revocation import (MAX_REASON, MAX_SYNC, Revocations, check_revocation, make_revocation,
                                      resolve_peer)
from swarmd.p2p.signed import Invalid, peer_from_key, peer_str, seal
from swarmd.gossip.wire import MeshInfo, Verifier, make_record, wg_proof_message
from swarmd.wg import address
from swarmd.wg.keys import KeyPair, prove

OWNER = SigningKey(b"\x0a" * 32)
OWNER_PUBLIC = bytes(OWNER.verify_key)
SWARM = swarm_id(OWNER_PUBLIC)
STRANGER = SigningKey(b"\x0b" * 32)
NODE = SigningKey(b"\x01" * 32)
PEER = peer_str(peer_from_key(bytes(NODE.verify_key)))
OTHER = peer_str(peer_from_key(bytes(SigningKey(b"\x02" * 32).verify_key)))
NOW = 1_700_000_000.0


def owner_sign(data: bytes) -> bytes:
    return OWNER.sign(data).signature


def check(blob, now=NOW + 1):
    return check_revocation(blob, owner_public=OWNER_PUBLIC, swarm=SWARM, now=now)


def test_make_and_check():
    r = make_revocation(owner_sign, SWARM, PEER, now=NOW, reason="stolen key")
    assert check(r.blob) == r
    assert r.to_dict() == {"peer": PEER, "issued": NOW, "reason": "stolen key"}
    assert len(r.blob) < 300


def _body(**changes):
    body = {"v": 1, "k": "revoke", "swarm": SWARM, "peer": peer_from_key(bytes(NODE.verify_key)), "issued": NOW,
            "reason": ""}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


@pytest.mark.parametrize("blob, detail", [
    (make_revocation(lambda d: STRANGER.sign(d).signature, SWARM, PEER, now=NOW).blob,
     "revocation: signature does not verify"),  # a member cannot revoke anyone
    (make_revocation(owner_sign, "0123456789abcdef", PEER, now=NOW).blob, "revocation of another swarm"),
    (seal(_body(v=2), owner_sign), "not a version-1 revocation"),
    (seal(_body(k="cert"), owner_sign), "not a version-1 revocation"),
    (seal(_body(peer=PEER), owner_sign), "revoke.peer: expected bytes, got str"),
    (seal(_body(peer=b"\x00" * 38), owner_sign), "peer id is not an Ed25519 libp2p id"),
    (seal(_body(issued="now"), owner_sign), "revoke.issued: expected int/float, got str"),
    (seal(_body(issued=float("nan")), owner_sign), "revocation issued in the future"),
    (seal(_body(issued=NOW + 86400), owner_sign), "revocation issued in the future"),
    (seal(_body(reason=...), owner_sign), "revoke.reason: expected str, got NoneType"),
    (seal(_body(reason="x" * (MAX_REASON + 1)), owner_sign), "revocation reason longer"),
    (seal(_body(pad=b"x" * 2000), owner_sign), "2"),  # oversize: refused before unsealing
    (None, "revocation: expected signed bytes"),
    (b"\xc1", "revocation: not msgpack"),
])
def test_bad_revocations(blob, detail):
    with pytest.raises(Invalid) as err:
        check(blob)
    assert err.value.reason == "revocation"
    assert err.value.detail.startswith(detail), err.value.detail


def test_list_is_final_and_bounded_in_syncs():
    a = make_revocation(owner_sign, SWARM, PEER, now=NOW, reason="first")
    again = make_revocation(owner_sign, SWARM, PEER, now=NOW + 5, reason="second")
    revs = Revocations([a])
    assert PEER in revs and OTHER not in revs and len(revs) == 1
    assert not revs.add(again) and revs.get(PEER).reason == "first"  # the first word stands
    many = Revocations(make_revocation(owner_sign, SWARM, peer_str(peer_from_key(i.to_bytes(32, "big"))),
                                       now=NOW + i) for i in range(MAX_SYNC + 5))
    sent = many.for_sync()
    assert len(sent) == MAX_SYNC
    assert check(sent[0], now=NOW + 2 * MAX_SYNC).issued == NOW + MAX_SYNC + 4  # newest first


@pytest.mark.parametrize("text, result", [
    (PEER, PEER),
    (PEER[-8:], PEER),  # as `swarmctl peers` shows it
    (PEER[:20], PEER),
    (OTHER, OTHER),
])
def test_resolve_peer(text, result):
    assert resolve_peer(text, [PEER, OTHER]) == result


def test_resolve_peer_errors():
    with pytest.raises(ValueError, match="give more of the id"):
        resolve_peer("12D3KooW", [PEER, OTHER])
    with pytest.raises(ValueError, match="no member's peer id"):
        resolve_peer("zzzzzz", [PEER, OTHER])
    with pytest.raises(ValueError, match="too short"):
        resolve_peer("ab", [PEER])
    # a well-formed id not in the view can still be revoked (it may come back later)
    assert resolve_peer(OTHER, [PEER]) == OTHER


# --- the owner's registries ---------------------------------------------------------------

def test_invite_single_use_and_retry():
    inv = Invites()
    inv.add("n1", uses=1, expires=NOW + 3600, now=NOW)
    assert inv.use("n1", PEER, NOW) is True
    assert inv.use("n1", PEER, NOW + 1) is False  # the same node again (its reply was lost)
    with pytest.raises(Refused, match="used 1 time"):
        inv.use("n1", OTHER, NOW + 2)
    with pytest.raises(Refused, match="unknown to the owner"):
        inv.use("never-issued", PEER, NOW)
    with pytest.raises(Refused, match="unknown to the owner"):
        inv.use("n1", PEER, NOW + 3600)  # expired
    inv.prune(NOW + 3600)
    assert inv.items == {}


def test_invite_with_uses_survives_json():
    inv = Invites()
    inv.add("n2", uses=3, expires=NOW + 60, now=NOW)
    inv.use("n2", PEER, NOW)
    again = Invites.from_json(inv.to_json())
    again.use("n2", OTHER, NOW)
    assert again.items["n2"].left == 1


NET = ipaddress.IPv4Network("10.211.0.0/24")


def cands(peer: str):
    return address.candidates(SWARM, peer.encode(), NET)


def test_members_allocate_distinct_addresses_and_keep_them():
    m = Members()
    a = m.address_for(PEER, cands(PEER), now=NOW, in_use=set(), network=NET)
    m.certified(PEER, a, NOW + 100)
    b = m.address_for(OTHER, cands(PEER), now=NOW, in_use=set(), network=NET)  # same candidates on purpose
    assert a != b and ipaddress.IPv4Address(b) in NET
    assert m.address_for(PEER, cands(PEER), now=NOW, in_use=set(), network=NET) == a  # renewal: the same
    taken = ipaddress.IPv4Address(next(iter(cands("x"))))
    assert m.address_for("x", cands("x"), now=NOW, in_use={taken}, network=NET) != str(taken)


def test_address_of_a_revoked_or_expired_member_is_quarantined():
    m = Members()
    a = m.address_for(PEER, cands(PEER), now=NOW, in_use=set(), network=NET)
    m.certified(PEER, a, NOW + 100)
    m.revoke(PEER, NOW + 10)
    assert m.is_revoked(PEER) and not m.holds_valid(PEER, NOW + 11)
    with pytest.raises(Refused, match="revoked"):
        m.certified(PEER, a, NOW + 200)
    assert m.address_for(OTHER, cands(PEER), now=NOW + 20, in_use=set(), network=NET) != a
    assert m.address_for(OTHER, cands(PEER), now=NOW + 11 + QUARANTINE, in_use=set(), network=NET) == a
    assert Members.from_json(m.to_json()).to_json() == m.to_json()


# --- records against revocations, certificates' addresses and key proofs --------------------

WG = KeyPair.from_private(bytes(range(1, 33)))
VICTIM_WG = KeyPair.from_private(bytes(range(2, 34)))


def record(*, cert_addr=None, addr4="10.211.0.9", wg=WG, proof_key=None, peer=PEER):
    cert = issue_cert(owner_sign, SWARM, peer_from_key(bytes(NODE.verify_key)), now=NOW - 10, addr4=cert_addr)
    proof = prove((proof_key or wg).private, wg_proof_message(SWARM, peer, wg.public))
    mesh = MeshInfo(public=wg.public, addr4=addr4, addr6=None, port=51820, endpoints=(), proof=proof)
    return make_record(lambda d: NODE.sign(d).signature, swarm=SWARM, peer=peer, seq=5, issued=NOW - 1, ttl=120.0,
                       addrs=[], resources=Resources(cpu_count=1, cpu_free=1.0, memory_total_mb=1, memory_free_mb=1),
                       labels={}, wg=mesh, cert=cert)


def test_record_with_its_certificates_address_and_a_proof():
    rec = Verifier(SWARM, OWNER_PUBLIC).decode(record(cert_addr="10.211.0.9"), NOW)
    assert rec.cert.addr4 == "10.211.0.9" and rec.wg.addr4 == "10.211.0.9"
    assert Verifier(SWARM, OWNER_PUBLIC).decode(record(), NOW).cert.addr4 is None  # older certificates


@pytest.mark.parametrize("kw, reason", [
    ({"cert_addr": "10.211.0.9", "addr4": "10.211.0.10"}, "addr_mismatch"),  # an address hijack
    ({"wg": VICTIM_WG, "proof_key": WG}, "wg_proof"),  # the victim's key, signed with our own
])
def test_record_refused(kw, reason):
    with pytest.raises(Invalid) as err:
        Verifier(SWARM, OWNER_PUBLIC).decode(record(**kw), NOW)
    assert err.value.reason == reason


def test_proof_is_bound_to_swarm_and_peer():
    """A proof lifted from another member's record does not verify for us."""
    proof = prove(WG.private, wg_proof_message(SWARM, OTHER, WG.public))
    cert = issue_cert(owner_sign, SWARM, peer_from_key(bytes(NODE.verify_key)), now=NOW - 10)
    mesh = MeshInfo(public=WG.public, addr4="10.211.0.9", addr6=None, port=1, endpoints=(), proof=proof)
    blob = make_record(lambda d: NODE.sign(d).signature, swarm=SWARM, peer=PEER, seq=5, issued=NOW - 1, ttl=120.0,
                       addrs=[], resources=Resources(cpu_count=1, cpu_free=1.0, memory_total_mb=1, memory_free_mb=1),
                       labels={}, wg=mesh, cert=cert)
    with pytest.raises(Invalid, match="wg_proof"):
        Verifier(SWARM, OWNER_PUBLIC).decode(blob, NOW)


def test_revoked_signer_and_revocations_on_the_topic():
    v = Verifier(SWARM, OWNER_PUBLIC)
    r = make_revocation(owner_sign, SWARM, PEER, now=NOW)
    assert v.decode(r.blob, NOW) == r  # a revocation takes its own path: the owner's signature
    v.revoked.add(PEER)
    with pytest.raises(Invalid) as err:
        v.decode(record(), NOW)
    assert err.value.reason == "revoked"
    forged = make_revocation(lambda d: NODE.sign(d).signature, SWARM, OTHER, now=NOW)  # a member's
    with pytest.raises(Invalid) as err:
        v.decode(forged.blob, NOW)
    assert err.value.reason == "revocation"


# --- any well-signed body: refused with Invalid or accepted, never anything else ----------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VALUES = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**64 - 1),
                   st.floats(allow_nan=True), st.text(max_size=300), st.binary(max_size=64),
                   st.lists(st.integers(min_value=-2**63, max_value=2**63), max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={"v": VALUES, "k": st.sampled_from(["revoke", "cert", 1]),
                                           "swarm": st.one_of(st.just(SWARM), VALUES),
                                           "peer": st.one_of(st.just(peer_from_key(bytes(NODE.verify_key))), VALUES),
                                           "issued": VALUES, "reason": VALUES}))
def test_random_owner_signed_bodies_never_raise_anything_but_invalid(body):
    blob = seal(body, owner_sign)
    for decode in (lambda: check(blob), lambda: Verifier(SWARM, OWNER_PUBLIC).decode(blob, NOW)):
        try:
            r = decode()
        except Invalid:
            continue
        assert r.peer and r.swarm == SWARM
