"""The proof that a member holds the WireGuard key it advertises. Pure: no files, no clock.

A member proves it holds the private half of the key it advertises: ``prove`` signs a
message with the X25519 private key as XEdDSA does (Signal's XEdDSA spec, Perrin 2016: the
Montgomery scalar used as an Ed25519 scalar, negated when its Edwards point's sign bit is
1); ``verify_proof`` is a standard Ed25519 verification against the Edwards point whose
Montgomery u is the public key (y = (u - 1) / (u + 1) mod p, sign bit 0). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import secrets

from nacl import bindings as sodium
from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

KEY_LEN = 32


def clamp(key: bytes) -> bytes:
    """RFC 7748 section 5 clamping, as ``wg genkey`` applies it (X25519 clamps anyway)."""
    k = bytearray(key)
    k[0] &= 248
    k[31] = (k[31] & 127) | 64
    return bytes(k)


P = 2**255 - 19  # the field of Curve25519 and Ed25519
PROOF_LEN = 64


def prove(private: bytes, message: bytes, random: bytes | None = None) -> bytes:
    """An Ed25519 signature of ``message`` by the X25519 ``private`` key (XEdDSA)."""
    a = _scalar(clamp(private))
    point = sodium.crypto_scalarmult_ed25519_base_noclamp(a)
    if point[31] & 0x80:  # the verifier can only know the point with sign bit 0: use -a, whose point that is
        a = sodium.crypto_core_ed25519_scalar_negate(a)
        point = sodium.crypto_scalarmult_ed25519_base_noclamp(a)
    z = secrets.token_bytes(64) if random is None else random
    r = _scalar(hashlib.sha512(b"\xfe" + b"\xff" * 31 + a + message + z).digest())  # XEdDSA's hash_1
    big_r = sodium.crypto_scalarmult_ed25519_base_noclamp(r)
    h = _scalar(hashlib.sha512(big_r + point + message).digest())
    s = sodium.crypto_core_ed25519_scalar_add(r, sodium.crypto_core_ed25519_scalar_mul(h, a))
    return big_r + s


def verify_proof(public: bytes, message: bytes, proof: bytes) -> bool:
    """Whether ``proof`` is ``message`` signed by the holder of X25519 key ``public``."""
    if not (isinstance(public, bytes) and len(public) == KEY_LEN and isinstance(proof, bytes)
            and len(proof) == PROOF_LEN):
        return False
    u = int.from_bytes(public, "little")
    if u >= P or u == P - 1:  # non-canonical, or the point u = -1 that has no Edwards image
        return False
    y = (u - 1) * pow(u + 1, P - 2, P) % P
    try:
        VerifyKey(y.to_bytes(32, "little")).verify(message, proof)
        return True
    except (BadSignatureError, ValueError, TypeError):
        return False


def _scalar(data: bytes) -> bytes:
    """``data`` (32 or 64 bytes, little-endian) reduced mod the group order."""
    return sodium.crypto_core_ed25519_scalar_reduce(data.ljust(64, b"\0"))
