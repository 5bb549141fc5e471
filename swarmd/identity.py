"""The node's identity: an Ed25519 key in the state directory, and the peer id from it.

Rules:
- Created once, on first start, atomically (temp file, fsync, rename) with mode 0600.
- Stored as a libp2p-serialized private key (protobuf: key type + key), the format the
  libp2p implementations use for their key files.
- A key file that is readable by group or others, not owned by us, or unreadable as a key
  stops the start with IdentityError naming the file and the fix. It is never silently
  replaced: a new key would be a new peer id, and the swarm would see a stranger.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from .atomic import write_atomically
from .keyfile import KeyFileError, read_private

KEY_FILE = "identity.key"


class IdentityError(Exception):
    """Exit status 2: the key file needs a person's attention."""


@dataclass(frozen=True, slots=True)
class Identity:
    key_pair: KeyPair
    peer_id: ID
    path: Path

    def sign(self, data: bytes) -> bytes:
        return self.key_pair.private_key.sign(data)

    @property
    def public_key(self) -> bytes:
        return self.key_pair.public_key.to_bytes()


def ensure_state_dir(state_dir: Path) -> None:
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise IdentityError(f"cannot create state directory {state_dir}: {exc.strerror}") from None


def load_or_create(state_dir: Path) -> tuple[Identity, bool]:
    """The identity in ``state_dir``, creating it on first start; True when created."""
    ensure_state_dir(state_dir)
    path = state_dir / KEY_FILE
    if path.exists() or path.is_symlink():
        return _load(path), False
    key = Ed25519PrivateKey.new()
    write_atomically(path, key.serialize(), mode=0o600)
    return _identity(key, path), True


def _identity(key: Ed25519PrivateKey, path: Path) -> Identity:
    pair = KeyPair(key, key.get_public_key())
    return Identity(pair, ID.from_pubkey(pair.public_key), path)


def _load(path: Path) -> Identity:
    try:
        data = read_private(path, "identity key")
    except KeyFileError as exc:
        raise IdentityError(str(exc)) from None
    try:
        key = deserialize_private_key(data)
        if key.get_type() != KeyType.Ed25519 or len(key.to_bytes()) != 32:
            raise ValueError(f"a {key.get_type().name} key, not Ed25519")
    except Exception as exc:
        raise IdentityError(
            f"identity key {path} is corrupt ({exc}): restore it from a backup, or move it "
            "away to start with a new identity (the node gets a new peer id)") from None
    assert isinstance(key, Ed25519PrivateKey)
    return _identity(key, path)

