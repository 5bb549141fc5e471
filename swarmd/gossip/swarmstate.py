"""This node's swarm membership on disk, and the record seq that survives restarts.

Files in the state directory, each written atomically:
- ``swarm.json``: swarm id, owner public key, this node's certificate, bootstrap addresses.
- ``owner.key`` (0600): the owner's Ed25519 seed, only on the node that ran `swarm init`.
- ``revoked.json``: the owner's revocations this node holds (every member keeps them), loaded
  at start and re-checked against the owner key.
- ``invites.json``, ``members.json`` (owner only): invites issued and uses left, members
  certified and their overlay addresses (see ``owner.py``; ``certify`` issues every
  certificate, the owner's own included, with an address from it).
- ``labels.json``: labels set or removed at run time (`swarmctl labels`), applied over the
  configured ones at every start, so a change survives a restart.
- ``seq``: the record epoch. Each start takes the next epoch, and seqs are
  ``epoch << 32 | n``, so a restarted node's records always beat its old ones with one small
  write per start rather than one per record.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nacl.signing import SigningKey

from ..atomic import write_atomically
from ..keyfile import KeyFileError, read_private
from ..wg import address
from ..p2p.signed import Invalid, Signer, peer_str
from .cert import MEMBER_ROLES, Cert, check_cert, issue_cert, swarm_id
from .owner import Invites, Members, RegistryError
from .revocation import Revocation, check_revocation

SWARM_FILE = "swarm.json"
OWNER_KEY = "owner.key"
SEQ_FILE = "seq"
LABELS_FILE = "labels.json"
REVOKED_FILE = "revoked.json"
INVITES_FILE = "invites.json"
MEMBERS_FILE = "members.json"
OWNER_ROLES = ("owner", "member")


class SwarmStateError(Exception):
    """The swarm files need a person's attention; the message says which and why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SwarmMembership:
    swarm: str
    owner_public: bytes
    cert: Cert
    bootstrap: tuple[str, ...]
    owner_key: SigningKey | None = None

    @property
    def is_owner(self) -> bool:
        return self.owner_key is not None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def load(state_dir: Path, peer: bytes) -> SwarmMembership | None:
    path = state_dir / SWARM_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        owner_public = base64.b64decode(data["owner_public"])
        cert_blob = base64.b64decode(data["cert"])
        bootstrap = tuple(str(a) for a in data.get("bootstrap", []))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SwarmStateError(f"{path} is damaged ({exc}): move it away and join again") from None
    swarm = swarm_id(owner_public)
    try:  # expiry is judged by the caller, which can say so at run time
        cert = check_cert(cert_blob, owner_public=owner_public, swarm=swarm, peer=peer, now=None)
    except Invalid as exc:
        raise SwarmStateError(f"{path}: {exc.detail}: move it away and join again") from None
    owner_key = None
    key_path = state_dir / OWNER_KEY
    if key_path.exists():
        try:
            seed = read_private(key_path, "owner key")
        except KeyFileError as exc:
            raise SwarmStateError(str(exc)) from None
        try:
            owner_key = SigningKey(seed)
        except ValueError as exc:  # nacl: "The seed must be exactly 32 bytes long"
            raise SwarmStateError(f"owner key {key_path} is damaged ({exc}): restore it from a backup") from None
        if bytes(owner_key.verify_key) != owner_public:
            raise SwarmStateError(f"owner key {key_path} does not belong to swarm {swarm}")
    return SwarmMembership(swarm=swarm, owner_public=owner_public, cert=cert, bootstrap=bootstrap,
                           owner_key=owner_key)


def _save(state_dir: Path, owner_public: bytes, cert: Cert, bootstrap: tuple[str, ...]) -> None:
    data = {"swarm": swarm_id(owner_public), "owner_public": _b64(owner_public), "cert": _b64(cert.blob),
            "bootstrap": list(bootstrap)}
    write_atomically(state_dir / SWARM_FILE, json.dumps(data, indent=2).encode(), mode=0o600)


def create(state_dir: Path, peer: bytes, *, now: float | None = None,
           network: ipaddress.IPv4Network = address.DEFAULT_NETWORK) -> SwarmMembership:
    """`swarm init`: a new owner key, and this node its first member, with an overlay address
    from ``network`` (the node's ``mesh_network``, which later joins are allocated from too)
    recorded in a new ``members.json``, so no member is ever given it."""
    if (state_dir / SWARM_FILE).exists():
        raise SwarmStateError("this node is already in a swarm (see `swarmctl status`)")
    owner = SigningKey.generate()
    owner_public = bytes(owner.verify_key)
    # a new registry: entries left by an earlier swarm in this directory name nobody in this one
    cert = certify(state_dir, owner, peer, now=time.time() if now is None else now, network=network,
                   roles=OWNER_ROLES, ttl=100 * 365 * 86400.0, members=Members())
    write_atomically(state_dir / OWNER_KEY, bytes(owner), mode=0o600)
    _save(state_dir, owner_public, cert, ())
    return SwarmMembership(swarm=cert.swarm, owner_public=owner_public, cert=cert, bootstrap=(), owner_key=owner)


def certify(state_dir: Path | None, owner: SigningKey, peer: bytes, *, now: float,
            network: ipaddress.IPv4Network, roles: tuple[str, ...] = MEMBER_ROLES, ttl: float,
            addr4: str | None = None, in_use: Iterable[ipaddress.IPv4Address] = (),
            members: Members | None = None) -> Cert:
    """Owner: a certificate for ``peer`` that names its overlay address, recorded in
    ``members.json``. Every certificate the owner issues is made here (`swarm init`, joins,
    renewals, the lab's swarms), so none lacks an address and no two share one.

    The address is ``addr4`` when given (a renewal keeps its own), else the registry's: the
    peer's earlier one if still in ``network``, else the first of its candidates in ``network``
    that no member holds, claims (``in_use``) or left behind recently (``owner.Members``).
    ``members`` is the registry already loaded by the caller (read from disk otherwise);
    ``state_dir=None`` keeps it in memory only (tests). ``Refused``: the peer is revoked, or
    the network is full."""
    if members is None:
        members = load_members(state_dir) if state_dir is not None else Members()
    name = peer_str(peer)
    swarm = swarm_id(bytes(owner.verify_key))
    if addr4 is None:
        addr4 = members.address_for(name, address.candidates(swarm, peer, network), now=now,
                                    in_use=set(in_use), network=network)
    cert = issue_cert(_signer(owner), swarm, peer, now=now, ttl=ttl, roles=roles, addr4=addr4)
    members.certified(name, addr4, cert.expires)
    if state_dir is not None:
        save_members(state_dir, members)
    return cert


def save_joined(state_dir: Path, owner_public: bytes, cert: Cert, bootstrap: tuple[str, ...]) -> SwarmMembership:
    if (state_dir / SWARM_FILE).exists():
        raise SwarmStateError("this node is already in a swarm (see `swarmctl status`)")
    _save(state_dir, owner_public, cert, bootstrap)
    return SwarmMembership(swarm=swarm_id(owner_public), owner_public=owner_public, cert=cert, bootstrap=bootstrap)


def save_cert(state_dir: Path, m: SwarmMembership, cert: Cert) -> SwarmMembership:
    """A renewed certificate replaces the old one in ``swarm.json``."""
    _save(state_dir, m.owner_public, cert, m.bootstrap)
    return SwarmMembership(swarm=m.swarm, owner_public=m.owner_public, cert=cert, bootstrap=m.bootstrap,
                           owner_key=m.owner_key)


def load_revocations(state_dir: Path, m: SwarmMembership, now: float) -> list[Revocation]:
    """The revocations kept in ``revoked.json``; each is checked again (the file is not trusted
    more than the network)."""
    path = state_dir / REVOKED_FILE
    try:
        blobs = [base64.b64decode(b) for b in json.loads(path.read_text())["revocations"]]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SwarmStateError(f"{path} is damaged ({exc}): move it away (members will send the "
                              "revocations again)") from None
    out = []
    for blob in blobs:
        try:
            out.append(check_revocation(blob, owner_public=m.owner_public, swarm=m.swarm, now=now))
        except Invalid:
            continue
    return out


def save_revocations(state_dir: Path, revocations: list[Revocation]) -> None:
    data = {"revocations": [_b64(r.blob) for r in revocations],
            "peers": {r.peer: r.reason for r in revocations}}  # for a person reading the file
    write_atomically(state_dir / REVOKED_FILE, json.dumps(data, indent=2).encode(), mode=0o600)


def load_invites(state_dir: Path) -> Invites:
    try:
        return Invites.from_json(_registry(state_dir / INVITES_FILE))
    except RegistryError as exc:
        raise SwarmStateError(f"{state_dir / INVITES_FILE} is damaged ({exc}): restore it from a backup") from None


def save_invites(state_dir: Path, invites: Invites) -> None:
    write_atomically(state_dir / INVITES_FILE, json.dumps(invites.to_json(), indent=2).encode(), mode=0o600)


def load_members(state_dir: Path) -> Members:
    try:
        return Members.from_json(_registry(state_dir / MEMBERS_FILE))
    except RegistryError as exc:
        raise SwarmStateError(f"{state_dir / MEMBERS_FILE} is damaged ({exc}): restore it from a backup") from None


def save_members(state_dir: Path, members: Members) -> None:
    write_atomically(state_dir / MEMBERS_FILE, json.dumps(members.to_json(), indent=2).encode(), mode=0o600)


def _registry(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise SwarmStateError(f"{path} is damaged ({exc}): restore it from a backup") from None


def _signer(key: SigningKey) -> Signer:
    return lambda data: key.sign(data).signature


def owner_signer(m: SwarmMembership) -> Signer:
    assert m.owner_key is not None
    return _signer(m.owner_key)


def next_epoch(state_dir: Path) -> int:
    path = state_dir / SEQ_FILE
    try:
        epoch = int(path.read_text().strip()) + 1
    except FileNotFoundError:
        epoch = 1
    except ValueError:
        raise SwarmStateError(f"{path} is damaged: it must hold one integer") from None
    write_atomically(path, f"{epoch}\n".encode(), mode=0o600)
    return epoch


def first_seq(epoch: int) -> int:
    return epoch << 32


def effective_labels(state_dir: Path, configured: dict[str, str]) -> dict[str, str]:
    overlay = _label_overlay(state_dir)
    labels = {k: v for k, v in configured.items() if k not in overlay["removed"]}
    labels.update(overlay["set"])
    return labels


def change_labels(state_dir: Path, set_: dict[str, str], remove: list[str]) -> None:
    overlay = _label_overlay(state_dir)
    for k in remove:
        overlay["set"].pop(k, None)
        if k not in overlay["removed"]:
            overlay["removed"].append(k)
    for k, v in set_.items():
        overlay["set"][k] = v
        if k in overlay["removed"]:
            overlay["removed"].remove(k)
    write_atomically(state_dir / LABELS_FILE, json.dumps(overlay, indent=2, sort_keys=True).encode(), mode=0o600)


def _label_overlay(state_dir: Path) -> dict:
    path = state_dir / LABELS_FILE
    try:
        data = json.loads(path.read_text())
        labels = {str(k): str(v) for k, v in data.get("set", {}).items()}
        return {"set": {k: v for k, v in labels.items() if _valid_label(k, v, path)},
                "removed": [str(k) for k in data.get("removed", [])]}
    except FileNotFoundError:
        return {"set": {}, "removed": []}
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise SwarmStateError(f"{path} is damaged ({exc}): fix or remove it") from None


def _valid_label(key: str, value: str, path: Path) -> bool:
    """A label an older version let in that members now refuse (a control character in its
    value) is left out and logged: the node still starts and publishes the rest."""
    from .wire import check_labels

    try:
        check_labels({key: value}, "labels")
    except Invalid as exc:
        import structlog

        structlog.get_logger("swarmd.gossip").warning("a label in the state dir is left out", file=str(path),
                                                      error=exc.detail)
        return False
    return True
