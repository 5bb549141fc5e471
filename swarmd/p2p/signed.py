"""Signed msgpack blobs and Ed25519 peer ids: the bottom layer of everything on the wire.

A signed blob is ``msgpack([body, sig])`` where ``body`` is itself msgpack bytes. The
signature covers those exact bytes, so nothing is re-encoded before verifying and no
canonical form is needed. Peer ids are libp2p's: an identity multihash of the protobuf
public key, so the Ed25519 key is inside the id and any node can check a peer's signature
from its id alone. Pure: no clock, no I/O, no libp2p import (it costs a second).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import base58
import msgpack
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

# identity multihash (0x00), length 36, protobuf {KeyType: Ed25519 (1), Data: 32 bytes}
_ED25519_PEER_PREFIX = bytes.fromhex("002408011220")
PEER_ID_LEN = len(_ED25519_PEER_PREFIX) + 32

Signer = Callable[[bytes], bytes]
# Everything signed is small (a record with 64 GPUs is about 8 KiB; wire.MAX_MESSAGE is 64 KiB), and
# msgpack's per-container limits default to the input's length, so a blob of at most this many bytes
# decodes to at most that many objects: a few MB and milliseconds, however it is built.
MAX_SIGNED = 64 * 1024


class Invalid(ValueError):
    """Input from the network that fails a check; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def peer_key(peer: bytes) -> bytes:
    """The Ed25519 public key inside a peer id (only Ed25519 ids are members)."""
    if len(peer) != PEER_ID_LEN or not peer.startswith(_ED25519_PEER_PREFIX):
        raise Invalid("malformed", "peer id is not an Ed25519 libp2p id")
    return peer[len(_ED25519_PEER_PREFIX):]


def peer_from_key(public_key: bytes) -> bytes:
    return _ED25519_PEER_PREFIX + public_key


def peer_str(peer: bytes) -> str:
    return base58.b58encode(peer).decode()


def peer_bytes(peer: str) -> bytes:
    try:
        raw = base58.b58decode(peer)
    except ValueError:
        raise Invalid("malformed", f"{peer!r} is not a base58 peer id") from None
    peer_key(raw)
    return raw


def short(peer: str) -> str:
    """Peer ids all start 12D3KooW: show the distinctive tail, as libp2p tools do."""
    return peer[-8:]


def seal(body: dict[str, Any], sign: Signer) -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb([raw, sign(raw)], use_bin_type=True)


def unseal(blob: Any, public_key: bytes | None = None) -> tuple[dict[str, Any], bytes, bytes]:
    """(body, body bytes, signature); the signature is checked when ``public_key`` is given."""
    if not isinstance(blob, bytes):
        raise Invalid("malformed", "expected signed bytes")
    if len(blob) > MAX_SIGNED:
        raise Invalid("too_large", f"a signed blob of {len(blob)} bytes, the limit is {MAX_SIGNED}")
    try:
        outer = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as exc:
        raise Invalid("malformed", f"not msgpack ({exc.__class__.__name__})") from None
    if not (isinstance(outer, list) and len(outer) == 2 and all(isinstance(x, bytes) for x in outer)):
        raise Invalid("malformed", "expected [body, signature]")
    raw, sig = outer
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:
        raise Invalid("malformed", f"body is not msgpack ({exc.__class__.__name__})") from None
    if not isinstance(body, dict):
        raise Invalid("malformed", "body is not a map")
    if public_key is not None:
        verify(public_key, raw, sig)
    return body, raw, sig


def verify(public_key: bytes, data: bytes, sig: bytes) -> None:
    try:
        VerifyKey(public_key).verify(data, sig)
    except (BadSignatureError, ValueError, TypeError):
        raise Invalid("signature", "signature does not verify") from None


def field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        expected = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise Invalid("malformed", f"{where}.{name}: expected {expected}, got {type(value).__name__}")
    return value
