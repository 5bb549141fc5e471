import base58
import msgpack
import pytest
from nacl.signing import SigningKey

from swarmd.p2p.signed import (PEER_ID_LEN, Invalid, field, peer_bytes, peer_from_key, peer_key, peer_str, seal,
                                  short, unseal, verify)

KEY = SigningKey(b"\x01" * 32)
OTHER = SigningKey(b"\x02" * 32)
PUBLIC = bytes(KEY.verify_key)


def sign(data: bytes) -> bytes:
    return KEY.sign(data).signature


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


BODY = {"v": 1, "k": "record", "msg": "hello", "n": 7, "b": b"\x00\xff", "l": [1, 2.5], "m": {"x": None}}


def test_seal_unseal_round_trip():
    blob = seal(BODY, sign)
    body, raw, sig = unseal(blob, PUBLIC)
    assert body == BODY
    assert raw == pack(BODY)
    assert KEY.verify_key.verify(raw, sig) == raw


def test_unseal_without_a_key_does_not_verify():
    blob = seal(BODY, lambda raw: b"\x00" * 64)
    body, _, _ = unseal(blob)
    assert body == BODY
    with pytest.raises(Invalid) as err:
        unseal(blob, PUBLIC)
    assert err.value.reason == "signature"


def test_signature_covers_the_exact_body_bytes():
    # a map with the same content in another key order is other bytes: nothing is re-encoded
    blob = seal({"a": 1, "b": 2}, sign)
    raw, sig = msgpack.unpackb(blob)
    reordered = pack({"b": 2, "a": 1})
    assert reordered != raw
    with pytest.raises(Invalid, match="^signature"):
        unseal(pack([reordered, sig]), PUBLIC)


def test_flipped_byte_in_body_fails_the_signature():
    blob = seal(BODY, sign)
    tampered = blob.replace(b"hello", b"hellp")
    assert tampered != blob
    assert unseal(tampered)[0]["msg"] == "hellp"  # still a well-formed message
    with pytest.raises(Invalid) as err:
        unseal(tampered, PUBLIC)
    assert err.value.reason == "signature"
    assert str(err.value) == "signature: signature does not verify"


@pytest.mark.parametrize("sig", [
    pytest.param(lambda s: bytes([s[0] ^ 1]) + s[1:], id="flipped"),
    pytest.param(lambda s: s[:63], id="short"),
    pytest.param(lambda s: s + b"\x00", id="long"),
    pytest.param(lambda s: b"", id="empty"),
])
def test_bad_signature(sig):
    raw = pack(BODY)
    with pytest.raises(Invalid) as err:
        unseal(pack([raw, sig(sign(raw))]), PUBLIC)
    assert err.value.reason == "signature"


def test_another_key_fails_the_signature():
    with pytest.raises(Invalid) as err:
        unseal(seal(BODY, lambda raw: OTHER.sign(raw).signature), PUBLIC)
    assert err.value.reason == "signature"


@pytest.mark.parametrize("key", [b"", b"\x01" * 31, b"\x01" * 33])
def test_bad_public_key_fails_the_signature_not_the_process(key):
    with pytest.raises(Invalid) as err:
        verify(key, b"data", sign(b"data"))
    assert err.value.reason == "signature"


@pytest.mark.parametrize("blob, detail", [
    ("text", "expected signed bytes"),
    (None, "expected signed bytes"),
    (bytearray(seal(BODY, sign)), "expected signed bytes"),
    (b"", "not msgpack"),
    (b"\xc1", "not msgpack"),  # a byte msgpack never uses
    (seal(BODY, sign)[:-5], "not msgpack"),  # cut short
    (seal(BODY, sign) + b"\x00", "not msgpack"),  # trailing bytes
    (pack({"body": b"x", "sig": b"y"}), "expected [body, signature]"),
    (pack([b"x"]), "expected [body, signature]"),
    (pack([b"x", b"y", b"z"]), "expected [body, signature]"),
    (pack([b"x", "signature"]), "expected [body, signature]"),
    (pack(["body", b"sig"]), "expected [body, signature]"),
    (pack([b"\xc1", b"sig"]), "body is not msgpack"),
    (pack([pack({1: "int key"}), b"sig"]), "body is not msgpack"),  # map keys must be str or bytes
    (pack([pack([1, 2]), b"sig"]), "body is not a map"),
    (pack([pack("text"), b"sig"]), "body is not a map"),
])
def test_malformed(blob, detail):
    with pytest.raises(Invalid) as err:
        unseal(blob, PUBLIC)
    assert err.value.reason == "malformed"
    assert detail in err.value.detail


def test_malformed_is_a_value_error():
    with pytest.raises(ValueError):
        unseal(b"\xc1")


def test_peer_id_round_trip():
    peer = peer_from_key(PUBLIC)
    assert len(peer) == PEER_ID_LEN
    text = peer_str(peer)
    assert text.startswith("12D3KooW")
    assert peer_bytes(text) == peer
    assert peer_key(peer_bytes(text)) == PUBLIC
    assert short(text) == text[-8:]


def test_peer_id_is_libp2ps(tmp_path):
    from swarmd.identity import load_or_create  # imports libp2p: only here

    ident, _ = load_or_create(tmp_path)
    peer = peer_from_key(ident.public_key)
    assert peer == ident.peer_id.to_bytes()
    assert peer_str(peer) == str(ident.peer_id)
    # a node's signature checks out against the key inside its peer id alone
    blob = seal(BODY, ident.sign)
    assert unseal(blob, peer_key(peer_bytes(str(ident.peer_id))))[0] == BODY


@pytest.mark.parametrize("text", [
    "",
    "not-base58!",
    "0OIl",  # letters base58 leaves out
    "12D3KooW",
    base58.b58encode(b"\x00" * PEER_ID_LEN).decode(),
    base58.b58encode(peer_from_key(PUBLIC) + b"\x00").decode(),
    base58.b58encode(peer_from_key(PUBLIC)[:-1]).decode(),
    # a secp256k1 peer id (identity multihash of KeyType 2, 33 bytes): not Ed25519
    base58.b58encode(bytes.fromhex("002508021221") + b"\x02" * 33).decode(),
    # an RSA-style sha256 multihash id: the key is not inside
    "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
])
def test_bad_peer_ids(text):
    with pytest.raises(Invalid) as err:
        peer_bytes(text)
    assert err.value.reason == "malformed"


@pytest.mark.parametrize("peer", [b"", b"\x00" * PEER_ID_LEN, peer_from_key(PUBLIC)[:-1], peer_from_key(PUBLIC) + b"\x00"])
def test_peer_key_wants_an_ed25519_id(peer):
    with pytest.raises(Invalid, match="^malformed: peer id is not an Ed25519 libp2p id$"):
        peer_key(peer)


@pytest.mark.parametrize("body, kind, value", [
    ({"n": 7}, int, 7),
    ({"n": 7}, (int, float), 7),
    ({"n": 7.5}, (int, float), 7.5),
    ({"n": "s"}, str, "s"),
    ({"n": b"b"}, bytes, b"b"),
    ({"n": [1]}, list, [1]),
    ({"n": True}, bool, True),
])
def test_field_accepts(body, kind, value):
    assert field(body, "n", kind, "rec") == value


@pytest.mark.parametrize("body, kind, detail", [
    ({"n": "7"}, int, "rec.n: expected int, got str"),
    ({}, int, "rec.n: expected int, got NoneType"),
    ({"n": None}, str, "rec.n: expected str, got NoneType"),
    ({"n": True}, int, "rec.n: expected int, got bool"),  # bool is an int to isinstance, not to the wire
    ({"n": False}, (int, float), "rec.n: expected int/float, got bool"),
    ({"n": "x"}, (int, float), "rec.n: expected int/float, got str"),
    ({"n": 1.0}, int, "rec.n: expected int, got float"),
    ({"n": "b"}, bytes, "rec.n: expected bytes, got str"),
])
def test_field_type_errors_name_the_field(body, kind, detail):
    with pytest.raises(Invalid) as err:
        field(body, "n", kind, "rec")
    assert err.value.reason == "malformed"
    assert err.value.detail == detail


def test_a_blob_larger_than_anything_signed_is_refused_before_decoding():
    # 64 KiB bounds what msgpack builds from it: a larger blob (a "revocation" in a sync) of empty
    # arrays would otherwise cost a Python object per byte
    from swarmd.p2p.signed import MAX_SIGNED
    blob = b"\xdd" + (10**6).to_bytes(4, "big") + b"\x90" * 10**6
    with pytest.raises(Invalid, match="too_large") as exc:
        unseal(blob)
    assert exc.value.reason == "too_large" and len(blob) > MAX_SIGNED
