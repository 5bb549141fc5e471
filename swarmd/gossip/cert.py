"""Swarm admission: the owner key, membership certificates and invite tokens.

A swarm is its owner's Ed25519 key; the swarm id is derived from the public half, so a
certificate names its swarm and carries nothing that could be swapped. The owner signs:

- a **certificate** ``{v, k: "cert", swarm, peer, roles, issued, expires}`` for each member.
  Every record and rumor a member sends carries it; receivers check it before anything else.
- an **invite ticket** ``{v, k: "invite", swarm, roles, expires, cert_ttl, nonce}``. The token
  a person copies is the ticket plus the owner's public key and addresses of the inviting
  node. The joining node presents the ticket over a Noise-authenticated libp2p stream; the
  owner's node checks its own signature and the expiry and issues a certificate for the
  authenticated peer id. Tickets are bearer credentials until they expire (like
  `kubeadm token` or a Docker swarm join token); nothing about them is stored.

Pure: ``now`` is always passed in.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass

import msgpack

from .signed import Invalid, Signer, field, peer_str, seal, unseal

VERSION = 1
TOKEN_PREFIX = "swarmd1."
CLOCK_SKEW = 300.0  # seconds a certificate may be issued "in the future" by a fast clock
DEFAULT_CERT_TTL = 365 * 86400.0
MEMBER_ROLES = ("member",)


def swarm_id(owner_public: bytes) -> str:
    """16 hex digits: short enough to read aloud, 64 bits against accidental clashes."""
    return hashlib.sha256(b"swarmd swarm id\0" + owner_public).hexdigest()[:16]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cert:
    swarm: str
    peer: str
    roles: tuple[str, ...]
    issued: float
    expires: float
    blob: bytes  # the signed form, sent as is

    def to_dict(self) -> dict:
        return {"swarm": self.swarm, "peer": self.peer, "roles": list(self.roles),
                "issued": self.issued, "expires": self.expires}


def issue_cert(owner_sign: Signer, swarm: str, peer: bytes, *, now: float,
               ttl: float = DEFAULT_CERT_TTL, roles: tuple[str, ...] = MEMBER_ROLES) -> Cert:
    blob = seal({"v": VERSION, "k": "cert", "swarm": swarm, "peer": peer, "roles": list(roles),
                 "issued": now, "expires": now + ttl}, owner_sign)
    return Cert(swarm=swarm, peer=peer_str(peer), roles=roles, issued=now, expires=now + ttl, blob=blob)


def check_cert(blob: object, *, owner_public: bytes, swarm: str, peer: bytes, now: float | None) -> Cert:
    """The certificate, if it is the owner's, for ``peer``, in ``swarm`` and current
    (``now=None`` leaves the validity period to the caller)."""
    try:
        body, _, _ = unseal(blob, owner_public)
    except Invalid as exc:
        raise Invalid("cert", f"certificate: {exc.detail}") from None
    if body.get("v") != VERSION or body.get("k") != "cert":
        raise Invalid("cert", "not a version-1 certificate")
    try:
        if field(body, "swarm", str, "cert") != swarm:
            raise Invalid("cert", "certificate of another swarm")
        if field(body, "peer", bytes, "cert") != peer:
            raise Invalid("cert", "certificate of another peer")
        issued = float(field(body, "issued", (int, float), "cert"))
        expires = float(field(body, "expires", (int, float), "cert"))
        roles = field(body, "roles", list, "cert")
    except Invalid as exc:
        raise Invalid("cert", exc.detail) from None
    if now is not None and expires <= now:
        raise Invalid("cert", "certificate expired")
    if now is not None and issued > now + CLOCK_SKEW:
        raise Invalid("cert", "certificate issued in the future")
    assert isinstance(blob, bytes)
    return Cert(swarm=swarm, peer=peer_str(peer), roles=tuple(str(r) for r in roles),
                issued=issued, expires=expires, blob=blob)


@dataclass(frozen=True, slots=True, kw_only=True)
class Token:
    owner_public: bytes
    ticket: bytes  # signed by the owner; shown to the owner's node to get a certificate
    addrs: tuple[str, ...]  # multiaddrs with /p2p/ of the node that issued it
    expires: float

    @property
    def swarm(self) -> str:
        return swarm_id(self.owner_public)

    def encode(self) -> str:
        raw = msgpack.packb({"v": VERSION, "owner": self.owner_public, "ticket": self.ticket,
                             "addrs": list(self.addrs)}, use_bin_type=True)
        return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def make_token(owner_sign: Signer, owner_public: bytes, addrs: list[str], *, now: float,
               expires_in: float, cert_ttl: float = DEFAULT_CERT_TTL) -> Token:
    swarm = swarm_id(owner_public)
    ticket = seal({"v": VERSION, "k": "invite", "swarm": swarm, "roles": list(MEMBER_ROLES),
                   "expires": now + expires_in, "cert_ttl": cert_ttl, "nonce": os.urandom(12)}, owner_sign)
    return Token(owner_public=owner_public, ticket=ticket, addrs=tuple(addrs), expires=now + expires_in)


def parse_token(text: str) -> Token:
    """A token as pasted by a person; errors say what is wrong with it."""
    text = text.strip()
    if not text.startswith(TOKEN_PREFIX):
        raise ValueError(f"not a swarmd invite token (it should start with {TOKEN_PREFIX!r})")
    payload = text[len(TOKEN_PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        data = msgpack.unpackb(raw, raw=False)
        owner, ticket, addrs = data["owner"], data["ticket"], data["addrs"]
        if not (data["v"] == VERSION and isinstance(owner, bytes) and len(owner) == 32 and isinstance(ticket, bytes)
                and isinstance(addrs, list) and all(isinstance(a, str) for a in addrs)):
            raise ValueError  # not assert: `python -O` would drop the check
    except Exception:
        raise ValueError("the invite token is damaged (was it cut short when copied?)") from None
    try:
        body, _, _ = unseal(ticket, owner)
    except Invalid:
        raise ValueError("the invite token's signature does not verify") from None
    return Token(owner_public=owner, ticket=ticket, addrs=tuple(addrs), expires=float(body.get("expires", 0)))


def check_ticket(ticket: object, *, owner_public: bytes, now: float) -> tuple[tuple[str, ...], float]:
    """(roles, certificate ttl) granted by a ticket this owner signed, if not expired."""
    try:
        body, _, _ = unseal(ticket, owner_public)
    except Invalid as exc:
        raise Invalid("ticket", f"invite: {exc.detail}") from None
    if body.get("k") != "invite" or body.get("swarm") != swarm_id(owner_public):
        raise Invalid("ticket", "not an invite to this swarm")
    try:
        expires = float(field(body, "expires", (int, float), "invite"))
        ttl = float(field(body, "cert_ttl", (int, float), "invite"))
        roles = tuple(str(r) for r in field(body, "roles", list, "invite"))
    except Invalid as exc:
        raise Invalid("ticket", exc.detail) from None
    if expires <= now:
        raise Invalid("ticket", "the invite has expired: ask for a new one (swarmctl swarm invite)")
    return roles, ttl
