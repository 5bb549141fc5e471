"""This node's WireGuard key: an X25519 key pair in the state directory.

Rules:
- ``STATE_DIR/wg.key`` holds the private key as ``wg genkey`` prints it: standard base64 of
  32 bytes and a newline. Created on first start, atomically, mode 0600. New keys are
  clamped (RFC 7748 section 5) like ``wg genkey``'s, so the file matches what a device
  reports back.
- A key file readable by group or others, not ours, not a regular file or not a 32-byte
  base64 key stops the start with ``WgKeyError`` naming the file and the fix. It is never
  silently replaced: peers know us by the public key.
- ``rotate`` first copies the current key to ``wg.key.old`` and only then replaces
  ``wg.key``; both writes are atomic, so a crash at any point leaves a valid ``wg.key``
  (the old key or the new one) and the old key recoverable.
- Keys cross the code as 32 raw bytes; text forms are at the edges: base64 for people and
  ``wg`` (``b64``), lowercase hex for UAPI (``to_hex``).
- ``prove``/``verify_proof`` (the XEdDSA proof that a member holds its key) live in
  ``proof.py``, which is pure; they are re-exported here.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from pathlib import Path

from nacl.public import PrivateKey

from ..atomic import write_atomically
from ..keyfile import KeyFileError, read_private
from .proof import KEY_LEN, PROOF_LEN, clamp, prove, verify_proof  # noqa: F401  (callers import them from here)

KEY_FILE = "wg.key"
OLD_KEY_FILE = "wg.key.old"


class WgKeyError(Exception):
    """The WireGuard key file needs a person's attention; the message names it and the fix."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyPair:
    private: bytes = field(repr=False)  # never in a log line or a traceback
    public: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        return cls.from_private(clamp(bytes(PrivateKey.generate())))

    @classmethod
    def from_private(cls, private: bytes) -> KeyPair:
        if len(private) != KEY_LEN:
            raise ValueError(f"a WireGuard private key is {KEY_LEN} bytes, got {len(private)}")
        return cls(private=private, public=bytes(PrivateKey(private).public_key))

    @property
    def private_b64(self) -> str:
        return b64(self.private)

    @property
    def public_b64(self) -> str:
        return b64(self.public)


def b64(key: bytes) -> str:
    """Standard base64, the form ``wg`` prints and reads."""
    return base64.b64encode(key).decode("ascii")


def to_hex(key: bytes) -> str:
    """Lowercase hex, the form UAPI uses."""
    return key.hex()


def public_from_b64(text: str) -> bytes:
    """A public key given as ``wg pubkey`` prints it; ValueError says what is wrong."""
    return _decode(text, "public key")


def load_or_create(state_dir: Path) -> KeyPair:
    """The key pair in ``state_dir``, created on first start."""
    _ensure_dir(state_dir)
    path = state_dir / KEY_FILE
    if path.exists() or path.is_symlink():
        return _load(path)
    pair = KeyPair.generate()
    _write(path, pair)
    return pair


def rotate(state_dir: Path) -> tuple[KeyPair, KeyPair]:
    """Replace the key with a new one; (old, new). The old one stays in ``wg.key.old``."""
    old = load_or_create(state_dir)
    new = KeyPair.generate()
    _write(state_dir / OLD_KEY_FILE, old)
    _write(state_dir / KEY_FILE, new)
    return old, new


def _write(path: Path, pair: KeyPair) -> None:
    try:
        write_atomically(path, (pair.private_b64 + "\n").encode("ascii"), mode=0o600)
    except OSError as exc:
        raise WgKeyError(f"WireGuard key {path}: cannot write: {exc.strerror}") from None


def _ensure_dir(state_dir: Path) -> None:
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise WgKeyError(f"cannot create state directory {state_dir}: {exc.strerror}") from None


def _load(path: Path) -> KeyPair:
    try:
        data = read_private(path, "WireGuard key")
    except KeyFileError as exc:
        raise WgKeyError(str(exc)) from None
    try:
        private = _decode(data.decode("ascii"), "private key")
    except (UnicodeDecodeError, ValueError) as exc:
        why = "not ASCII text" if isinstance(exc, UnicodeDecodeError) else str(exc)
        raise WgKeyError(
            f"WireGuard key {path} is corrupt ({why}): restore it (the previous key, if any, is in "
            f"{path.with_name(OLD_KEY_FILE)}), or move it away to start with a new key") from None
    return KeyPair.from_private(private)


def _decode(text: str, what: str) -> bytes:
    stripped = text.strip()
    try:
        raw = base64.b64decode(stripped, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"a WireGuard {what} must be standard base64 (as `wg genkey` prints), "
                         f"got {stripped[:60]!r}") from None
    if len(raw) != KEY_LEN:
        raise ValueError(f"a WireGuard {what} is {KEY_LEN} bytes (44 base64 characters), "
                         f"got {len(raw)} bytes")
    return raw
