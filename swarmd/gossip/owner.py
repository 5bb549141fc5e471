"""What the owner's node remembers about admission: invites it issued and members it certified.

Two small registries, each a plain value the driver loads from and saves to the owner's state
directory (``invites.json``, ``members.json``, atomically) around every change:

- ``Invites``: each ticket's nonce, how many nodes it may still admit, who it admitted, and
  when it expires. A ticket the owner has no record of (made elsewhere, or pruned after
  expiry) is refused, as is one used up. A node that joins again with a ticket it already
  used, or that already holds a valid certificate, gets a certificate again without using
  anything up: a join whose reply was lost is simply retried.
- ``Members``: each certified peer's overlay address, certificate expiry and revocation. The
  owner allocates an address once per peer and gives it again on renewal; an address of a
  member revoked or expired is not given to anyone else for ``QUARANTINE`` (a job that still
  names it as MASTER_ADDR must not reach a newcomer).

Pure: ``now`` is passed in; the JSON forms are checked on load (a damaged file is an error
for a person, never silently emptied).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

QUARANTINE = 30 * 86400.0  # an address left behind is not reused for this long
MAX_INVITES = 10_000


class RegistryError(ValueError):
    pass


class Refused(Exception):
    """A join or renewal the owner will not grant; the message is for the asking node."""


@dataclass(slots=True)
class Invite:
    uses: int  # how many nodes it may admit in all
    expires: float
    admitted: list[str] = field(default_factory=list)

    @property
    def left(self) -> int:
        return self.uses - len(self.admitted)


class Invites:
    def __init__(self, items: dict[str, Invite] | None = None) -> None:
        self.items: dict[str, Invite] = dict(items or {})

    def add(self, nonce: str, *, uses: int, expires: float, now: float) -> None:
        self.prune(now)
        if len(self.items) >= MAX_INVITES:
            raise RegistryError(f"{MAX_INVITES} invites are outstanding: let some expire first")
        self.items[nonce] = Invite(uses=uses, expires=expires)

    def use(self, nonce: str, peer: str, now: float) -> bool:
        """Admit ``peer`` on this ticket: True when it used up one of its uses, False when the
        peer was admitted by it before (a retry); ``Refused`` when unknown or used up."""
        invite = self.items.get(nonce)
        if invite is None or invite.expires <= now:
            raise Refused("this invite is unknown to the owner (expired, or not issued by it): "
                          "ask for a new one (swarmctl swarm invite)")
        if peer in invite.admitted:
            return False
        if invite.left <= 0:
            raise Refused(f"this invite has been used {invite.uses} time(s) already: ask for a new one "
                          "(swarmctl swarm invite --uses N admits N nodes)")
        invite.admitted.append(peer)
        return True

    def prune(self, now: float) -> None:
        for nonce in [n for n, i in self.items.items() if i.expires <= now]:
            del self.items[nonce]

    def to_json(self) -> dict[str, Any]:
        return {n: {"uses": i.uses, "expires": i.expires, "admitted": i.admitted} for n, i in self.items.items()}

    @classmethod
    def from_json(cls, data: Any) -> Invites:
        try:
            return cls({str(n): Invite(uses=int(v["uses"]), expires=float(v["expires"]),
                                       admitted=[str(p) for p in v["admitted"]]) for n, v in data.items()})
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise RegistryError(f"invites: {exc.__class__.__name__}: {exc}") from None


@dataclass(slots=True)
class Certified:
    addr4: str | None
    expires: float
    revoked: float | None = None  # when


class Members:
    def __init__(self, items: dict[str, Certified] | None = None) -> None:
        self.items: dict[str, Certified] = dict(items or {})

    def holds_valid(self, peer: str, now: float) -> bool:
        m = self.items.get(peer)
        return m is not None and m.revoked is None and m.expires > now

    def is_revoked(self, peer: str) -> bool:
        m = self.items.get(peer)
        return m is not None and m.revoked is not None

    def taken(self, now: float) -> set[ipaddress.IPv4Address]:
        """Addresses held by a member, or left behind less than ``QUARANTINE`` ago."""
        out = set()
        for m in self.items.values():
            if m.addr4 is None:
                continue
            gone = m.revoked if m.revoked is not None else m.expires
            if gone > now - QUARANTINE:
                out.add(ipaddress.IPv4Address(m.addr4))
        return out

    def address_for(self, peer: str, candidates: Iterable[ipaddress.IPv4Address], *, now: float,
                    in_use: set[ipaddress.IPv4Address], network: ipaddress.IPv4Network) -> str:
        """``peer``'s address: the one it has (if still in ``network``), else the first of its
        candidates nobody holds, claims or left behind recently."""
        m = self.items.get(peer)
        if m is not None and m.addr4 is not None and ipaddress.IPv4Address(m.addr4) in network:
            return m.addr4
        blocked = self.taken(now) | in_use
        for n, addr in enumerate(candidates):  # endless; a full network ends the search
            if addr in network and addr not in blocked:
                return str(addr)
            if n > 4 * network.num_addresses:
                break
        raise Refused(f"the overlay network {network} has no free address")

    def certified(self, peer: str, addr4: str | None, expires: float) -> None:
        m = self.items.get(peer)
        if m is not None and m.revoked is not None:
            raise Refused("this peer is revoked")
        self.items[peer] = Certified(addr4=addr4, expires=max(expires, m.expires if m else 0.0))

    def revoke(self, peer: str, now: float) -> None:
        m = self.items.setdefault(peer, Certified(addr4=None, expires=0.0))
        if m.revoked is None:
            m.revoked = now

    def to_json(self) -> dict[str, Any]:
        return {p: {"addr4": m.addr4, "expires": m.expires, "revoked": m.revoked} for p, m in self.items.items()}

    @classmethod
    def from_json(cls, data: Any) -> Members:
        def addr(v: Any) -> str | None:
            return None if v is None else str(ipaddress.IPv4Address(v))

        try:
            return cls({str(p): Certified(addr4=addr(v["addr4"]), expires=float(v["expires"]),
                                          revoked=None if v.get("revoked") is None else float(v["revoked"]))
                        for p, v in data.items()})
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise RegistryError(f"members: {exc.__class__.__name__}: {exc}") from None

