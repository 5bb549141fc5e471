"""The service registry as every member reads it (sans-IO): which services exist, who controls
each, and where its replicas answer, from the membership view.

Theory of operation. Controllers claim services in their records and hosts announce the
replicas they run (gossip/registry.py). ``Registry.update(now, view)`` joins the two into a
``Table``: a service's replicas are the entries of in-service hosts (alive or suspect, record
current) that name the service, its controller and an index the controller's claim assigns to
that very host. An entry that no claim backs is not routed to and is counted
(``unassigned``): a member cannot make itself a replica of a service it was not given.

A name belongs to the first controller this node saw claim it (``owner``), for as long as
that claim is in the view or, when the controller itself is gone (crashed, restarting), while
hosts still announce replicas under its assignment and for ``ORPHAN_S`` after its claim was
last seen: the replicas go on serving without their controller, and a member that claims the
name meanwhile gets no traffic (``taken``: shown in `serve ls` as a conflict). Between claims
first seen together (a node that just joined), the oldest ``created`` wins, then the smaller
peer id. (A member can backdate a claim to a name nobody uses yet; it cannot take a name away
from a service that this node already routes to.)

Bounded by the wire's limits (16 claims and 32 replicas a record) and by ``MAX_SERVICES``:
claims beyond it are ignored and counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..gossip.registry import ServiceClaim

ORPHAN_S = 600.0  # a controller's last claim keeps its name this long after it left the view
MAX_SERVICES = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Replica:
    service: str
    index: int
    host: str  # peer id
    address: str | None  # the host's overlay IPv4 address (None: its mesh is down; only its own gateway reaches it)
    port: int
    healthy: bool

    @property
    def key(self) -> str:
        return f"{self.host}/{self.service}/{self.index}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Service:
    name: str
    controller: str
    claim: ServiceClaim
    replicas: tuple[Replica, ...]  # by index
    orphaned: bool = False  # its controller is not in the view: its last claim stands in
    contenders: tuple[str, ...] = ()  # other members claiming the name (no traffic for them)

    def row(self) -> dict[str, Any]:
        c = self.claim
        return {"name": self.name, "controller": self.controller, "created": c.created, "access": c.access,
                "health": c.health, "assigned": [[i, h] for i, h in c.assigned], "orphaned": self.orphaned,
                "contenders": list(self.contenders),
                "replicas": [{"index": r.index, "host": r.host, "address": r.address, "port": r.port,
                              "healthy": r.healthy} for r in self.replicas]}


@dataclass(frozen=True, slots=True)
class Table:
    services: dict[str, Service] = field(default_factory=dict)
    unassigned: int = 0  # replica entries no claim backs, in this view
    ignored: int = 0  # claims beyond MAX_SERVICES

    def get(self, name: str) -> Service | None:
        return self.services.get(name)


@dataclass(slots=True)
class _Owner:
    controller: str
    claim: ServiceClaim
    seen: float  # when its claim was last in the view


class Registry:
    def __init__(self) -> None:
        self._owners: dict[str, _Owner] = {}
        self.table = Table()

    def update(self, now: float, view: Iterable[Any]) -> Table:
        """The table from ``view`` (gossip's membership View, or any iterable of its members)."""
        members = [m for m in view if m.in_service]
        claims: dict[str, list[tuple[str, ServiceClaim]]] = {}
        for m in members:
            for claim in getattr(m.record, "services", ()):
                claims.setdefault(claim.name, []).append((m.peer, claim))
        ignored = 0
        if len(claims) > MAX_SERVICES:
            kept = sorted(claims)[:MAX_SERVICES]
            ignored = len(claims) - len(kept)
            claims = {name: claims[name] for name in kept}
        announced: dict[tuple[str, str], list[tuple[Any, Any]]] = {}  # (service, controller) -> (member, entry)
        for m in members:
            for entry in getattr(m.record, "replicas", ()):
                announced.setdefault((entry.service, entry.controller), []).append((m, entry))

        services: dict[str, Service] = {}
        for name in set(claims) | set(self._owners):
            owner = self._owners.get(name)
            here = dict(claims.get(name, ()))
            if owner is not None and owner.controller in here:
                owner.claim, owner.seen = here[owner.controller], now
            elif owner is not None and ((name, owner.controller) in announced and now - owner.seen <= ORPHAN_S):
                pass  # its controller is gone; its replicas still serve under its last claim
            elif here:
                controller, claim = min(here.items(), key=lambda kv: (kv[1].created, kv[0]))
                owner = self._owners[name] = _Owner(controller, claim, now)
            else:
                del self._owners[name]
                continue
            assigned = dict(owner.claim.assigned)
            replicas = []
            for m, entry in announced.get((name, owner.controller), ()):
                wg = getattr(m.record, "wg", None)
                if assigned.get(entry.index) != m.peer:
                    continue
                replicas.append(Replica(service=name, index=entry.index, host=m.peer,
                                        address=wg.addr4 if wg is not None else None,
                                        port=entry.port, healthy=entry.healthy))
            services[name] = Service(name=name, controller=owner.controller, claim=owner.claim,
                                     replicas=tuple(sorted(replicas, key=lambda r: r.index)),
                                     orphaned=owner.controller not in here,
                                     contenders=tuple(sorted(p for p in here if p != owner.controller)))
        routed = {(r.service, s.controller, r.index, r.host) for s in services.values() for r in s.replicas}
        unassigned = sum(1 for (service, controller), pairs in announced.items() for m, e in pairs
                         if (service, controller, e.index, m.peer) not in routed)
        self.table = Table(services=services, unassigned=unassigned, ignored=ignored)
        return self.table
