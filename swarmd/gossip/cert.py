"""Swarm admission: the owner key, membership certificates and invite tokens.

A swarm is its owner's Ed25519 key; the swarm id is derived from the public half, so a
certificate names its swarm and carries nothing that could be swapped. The owner signs:

- a **certificate** ``{v, k: "cert", swarm, peer, roles, issued, expires[, addr4]}`` for each
  member. Every record and rumor a member sends carries it; receivers check it before anything
  else. ``addr4``, when present, is the member's overlay IPv4 address, allocated by the owner
  (as Nebula signs a node's IP into its certificate): a record must advertise exactly it.
- an **invite ticket** ``{v, k: "invite", swarm, roles, expires, cert_ttl, nonce, uses}``. The
  token a person copies is the ticket plus the owner's public key and addresses of the
  inviting node. The joining node presents the ticket over a Noise-authenticated libp2p
  stream; the owner's node checks its own signature and the expiry, and its own record of the
  ticket's nonce (uses left; ``admission.Invites``), and issues a certificate for the
  authenticated peer id. A ticket admits ``uses`` nodes (default one) within 24 h by default.
- renewal: a member shows its current, valid certificate and gets a fresh one with the same
  roles and address (``renew_due`` says when to ask).

Pure: ``now`` is always passed in.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import math
import secrets
from dataclasses import dataclass

import msgpack

from ..p2p.signed import Invalid, Signer, field, peer_str, seal, unseal

VERSION = 1
TOKEN_PREFIX = "swarmd1."
MAX_TOKEN = 16 * 1024  # characters; a token with a dozen addresses is under 1,000
CLOCK_SKEW = 300.0  # seconds a certificate may be issued "in the future" by a fast clock
DEFAULT_CERT_TTL = 365 * 86400.0
DEFAULT_INVITE_TTL = 86400.0  # a day: a token pasted into a chat is not a credential for long
DEFAULT_INVITE_USES = 1  # one node per token, unless asked for more
MAX_INVITE_USES = 10_000
RENEW_WINDOW = 30 * 86400.0  # renew when a third of the lifetime or this much is left, whichever is less
EXPIRY_WARNING = 30 * 86400.0  # `swarmctl status` warns this long ahead
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
    addr4: str | None = None  # the overlay IPv4 address the owner gave this member; None on older certs

    def to_dict(self) -> dict:
        return {"swarm": self.swarm, "peer": self.peer, "roles": list(self.roles),
                "issued": self.issued, "expires": self.expires, "addr4": self.addr4}


def issue_cert(owner_sign: Signer, swarm: str, peer: bytes, *, now: float,
               ttl: float = DEFAULT_CERT_TTL, roles: tuple[str, ...] = MEMBER_ROLES,
               addr4: str | None = None) -> Cert:
    body = {"v": VERSION, "k": "cert", "swarm": swarm, "peer": peer, "roles": list(roles),
            "issued": now, "expires": now + ttl}
    if addr4 is not None:
        body["addr4"] = str(ipaddress.IPv4Address(addr4))
    blob = seal(body, owner_sign)
    return Cert(swarm=swarm, peer=peer_str(peer), roles=roles, issued=now, expires=now + ttl, blob=blob,
                addr4=body.get("addr4"))


def renew_due(cert: Cert) -> float:
    """When a member should ask for a fresh certificate: a third of its lifetime, or
    ``RENEW_WINDOW``, before it expires, whichever is less; at once for one without an
    address (from before the owner signed them: until it has one, its holder's address is a
    derived claim, which a member can take by grinding a key)."""
    if cert.addr4 is None:
        return cert.issued
    lifetime = max(0.0, cert.expires - cert.issued)
    return cert.expires - min(lifetime / 3, RENEW_WINDOW)


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
        if not all(isinstance(r, str) and 0 < len(r) <= 32 for r in roles) or len(roles) > 8:
            raise Invalid("malformed", "cert.roles: expected at most 8 role names")
        addr4 = body.get("addr4")
        if addr4 is not None:
            if not isinstance(addr4, str):
                raise Invalid("malformed", f"cert.addr4: expected str, got {type(addr4).__name__}")
            try:
                addr4 = str(ipaddress.IPv4Address(addr4))
            except ValueError:
                raise Invalid("malformed", f"cert.addr4: {addr4[:40]!r} is not an IPv4 address") from None
    except Invalid as exc:
        raise Invalid("cert", exc.detail) from None
    if not (math.isfinite(issued) and math.isfinite(expires)):
        raise Invalid("cert", "certificate times are not times")
    if now is not None and expires <= now:
        raise Invalid("cert", "certificate expired")
    if now is not None and issued > now + CLOCK_SKEW:
        raise Invalid("cert", "certificate issued in the future")
    assert isinstance(blob, bytes)
    return Cert(swarm=swarm, peer=peer_str(peer), roles=tuple(roles),
                issued=issued, expires=expires, blob=blob, addr4=addr4)


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
               expires_in: float, cert_ttl: float = DEFAULT_CERT_TTL, uses: int = DEFAULT_INVITE_USES) -> Token:
    swarm = swarm_id(owner_public)
    ticket = seal({"v": VERSION, "k": "invite", "swarm": swarm, "roles": list(MEMBER_ROLES),
                   "expires": now + expires_in, "cert_ttl": cert_ttl, "nonce": secrets.token_bytes(12),
                   "uses": uses}, owner_sign)
    return Token(owner_public=owner_public, ticket=ticket, addrs=tuple(addrs), expires=now + expires_in)


def parse_token(text: str) -> Token:
    """A token as pasted by a person; errors say what is wrong with it."""
    text = text.strip()
    if not text.startswith(TOKEN_PREFIX):
        raise ValueError(f"not a swarmd invite token (it should start with {TOKEN_PREFIX!r})")
    payload = text[len(TOKEN_PREFIX):]
    if len(payload) > MAX_TOKEN:  # decoded below: bounded first (a token is a few hundred characters)
        raise ValueError(f"the invite token is {len(payload)} characters long; a token is at most {MAX_TOKEN}")
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Ticket:
    """What an invite grants: ``nonce`` (hex) names it in the owner's records."""
    nonce: str
    roles: tuple[str, ...]
    cert_ttl: float
    expires: float
    uses: int


def read_ticket(ticket: object, *, owner_public: bytes, now: float) -> Ticket:
    """An invite this owner signed, if not expired; exact format (reason ``ticket``)."""
    try:
        body, _, _ = unseal(ticket, owner_public)
    except Invalid as exc:
        raise Invalid("ticket", f"invite: {exc.detail}") from None
    if body.get("k") != "invite" or body.get("swarm") != swarm_id(owner_public):
        raise Invalid("ticket", "not an invite to this swarm")
    try:
        expires = float(field(body, "expires", (int, float), "invite"))
        ttl = float(field(body, "cert_ttl", (int, float), "invite"))
        roles = field(body, "roles", list, "invite")
        nonce = field(body, "nonce", bytes, "invite")
        uses = body.get("uses", DEFAULT_INVITE_USES)  # tickets made before uses were counted: one
        if not all(isinstance(r, str) and 0 < len(r) <= 32 for r in roles) or len(roles) > 8:
            raise Invalid("malformed", "invite.roles: expected at most 8 role names")
        if not 8 <= len(nonce) <= 32:
            raise Invalid("malformed", "invite.nonce: expected 8-32 bytes")
        if isinstance(uses, bool) or not isinstance(uses, int) or not 1 <= uses <= MAX_INVITE_USES:
            raise Invalid("malformed", f"invite.uses: expected 1-{MAX_INVITE_USES}")
    except Invalid as exc:
        raise Invalid("ticket", exc.detail) from None
    if not (math.isfinite(expires) and math.isfinite(ttl) and 0 < ttl <= 100 * 365 * 86400.0):
        raise Invalid("ticket", "invite: times out of range")
    if expires <= now:
        raise Invalid("ticket", "the invite has expired: ask for a new one (swarmctl swarm invite)")
    return Ticket(nonce=nonce.hex(), roles=tuple(roles), cert_ttl=ttl, expires=expires, uses=uses)


def check_ticket(ticket: object, *, owner_public: bytes, now: float) -> tuple[tuple[str, ...], float]:
    """(roles, certificate ttl) granted by a ticket this owner signed, if not expired."""
    t = read_ticket(ticket, owner_public=owner_public, now=now)
    return t.roles, t.cert_ttl
