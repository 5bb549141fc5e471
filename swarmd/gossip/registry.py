"""The service registry's share of a record (issue 27): what a member says of services, checked
as it enters (sans-IO; wire.py calls ``claims_from_wire`` and ``replicas_from_wire``).

Two kinds of entry, each small (serf caps a node's metadata at 512 B for a reason: a record
travels to every member on every change):

- A **claim**, in the record of a service's controller (the member whose daemon keeps its
  replicas): the service's name, when it was created, who may use it through a gateway
  (``members``: requests from a member's own machine; ``token``: anyone holding the token whose
  SHA-256 is ``token_sha256``; ``public``: anyone), its health path, and its assignment: which
  replica index runs on which host. About 60 B plus 40 B a replica.
- A **replica**, in the record of the host that runs it: the service's name, the replica's
  index, the controller whose assignment it follows, the TCP port it listens on at the host's
  overlay address, and whether the host's health check passes. About 55 B. (No load: each
  gateway balances on the requests it has in flight itself, as Ray Serve's routers do with
  their own queue lengths; a host's word on load would be stale by a gossip round.)
- A **demand** entry, in the record of a member whose gateway carries a service's requests:
  the service's name, the requests per second entering there, the requests in flight there
  (both averaged over a few seconds) and their p99 and p50 latency in ms (or nil). About 35 B. The
  service's controller sums them to scale it (serve/scaler.py), and weighs where requests
  enter to place its replicas; each figure is bounded here (``MAX_RATE``, ``MAX_IN_FLIGHT``)
  and again where it is summed.

A gateway (serve/registry.py) routes to a replica only where both agree: the controller's
claim assigns (name, index) to that host, and that host announces it. A member therefore
cannot announce a replica of a service whose controller did not assign it one (its entry
matches no claim), nor can a member that claims a name already taken take its traffic
(serve/registry.py keeps the first claim while it lives). Everything here is bounded and
checked for exact format; a record with one malformed entry is refused whole, as any
malformed record is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from ..p2p.signed import Invalid, peer_bytes, peer_key, peer_str

MAX_CLAIMS = 16  # services one controller announces in its record
MAX_ASSIGNED = 64  # replicas one claim assigns
MAX_REPLICAS = 32  # replicas one host announces
MAX_INDEX = 999  # a replica's index: 0..999
MAX_HEALTH_PATH = 128
MAX_DEMAND = 16  # services one member reports demand for (the busiest)
MAX_RATE = 100_000.0  # requests per second one member's gateway may report for a service
MAX_IN_FLIGHT = 10_000.0  # requests in flight one member's gateway may report for a service
MAX_LATENCY_MS = 3_600_000.0
ACCESS = ("members", "token", "public")
NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # a DNS label: a URL's first path segment
HEALTH = re.compile(r"^/[A-Za-z0-9._~/%-]{0,127}$")  # an absolute path, no query, nothing to escape


def check_name(name: Any, where: str = "service") -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise Invalid("malformed", f"{where}: {name!r:.80} is not a service name (1-63 of a-z 0-9 -, "
                                   "starting and ending with a letter or digit)")
    return name


def check_health(path: Any, where: str = "health") -> str:
    if not isinstance(path, str) or not HEALTH.match(path):
        raise Invalid("malformed", f"{where}: {path!r:.80} is not an absolute path of at most "
                                   f"{MAX_HEALTH_PATH} characters (letters, digits, . _ ~ / % -)")
    return path


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceClaim:
    name: str
    created: float  # wall clock, seconds since the epoch
    access: str  # members | token | public
    token_sha256: bytes | None  # with access "token"
    health: str  # the path a host's health check GETs
    assigned: tuple[tuple[int, str], ...]  # (replica index, host peer id), by index

    def to_wire(self) -> dict[str, Any]:
        return {"n": self.name, "c": self.created, "a": self.access, "t": self.token_sha256, "h": self.health,
                "r": [[index, peer_bytes(host)] for index, host in self.assigned]}

    @classmethod
    def from_wire(cls, data: Any) -> ServiceClaim:
        where = "record.services"
        if not isinstance(data, dict):
            raise Invalid("malformed", f"{where}: each claim is a map")
        name = check_name(data.get("n"), f"{where}.n")
        created = data.get("c")
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created) \
                or not 0 <= created < 2**40:
            raise Invalid("malformed", f"{where}.{name}.c: expected a time, got {created!r:.40}")
        access = data.get("a")
        if access not in ACCESS:
            raise Invalid("malformed", f"{where}.{name}.a: expected one of {', '.join(ACCESS)}, got {access!r:.40}")
        token = data.get("t")
        if (access == "token") != (token is not None) or not (token is None or isinstance(token, bytes)
                                                            and len(token) == 32):
            raise Invalid("malformed", f"{where}.{name}.t: a token's SHA-256 (32 bytes) with access token, "
                                       "nothing otherwise")
        health = check_health(data.get("h"), f"{where}.{name}.h")
        assigned = data.get("r")
        if not isinstance(assigned, list) or len(assigned) > MAX_ASSIGNED:
            raise Invalid("malformed", f"{where}.{name}.r: expected a list of at most {MAX_ASSIGNED} "
                                       "[index, host] pairs")
        pairs: list[tuple[int, str]] = []
        for item in assigned:
            if not (isinstance(item, list) and len(item) == 2 and _index(item[0]) and isinstance(item[1], bytes)):
                raise Invalid("malformed", f"{where}.{name}.r: each entry is [index 0-{MAX_INDEX}, host peer id]")
            pairs.append((item[0], _peer(item[1], f"{where}.{name}.r")))
        indexes = [index for index, _ in pairs]
        if indexes != sorted(set(indexes)):
            raise Invalid("malformed", f"{where}.{name}.r: indexes must be ascending, each once")
        return cls(name=name, created=float(created), access=access, token_sha256=token, health=health,
                   assigned=tuple(pairs))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaEntry:
    service: str
    index: int
    controller: str  # the peer id whose claim assigned it
    port: int  # TCP, at the host's overlay address
    healthy: bool

    def to_wire(self) -> list[Any]:
        return [self.service, self.index, peer_bytes(self.controller), self.port, self.healthy]

    @classmethod
    def from_wire(cls, data: Any) -> ReplicaEntry:
        where = "record.replicas"
        if not isinstance(data, list) or len(data) != 5:
            raise Invalid("malformed", f"{where}: each entry is [service, index, controller, port, healthy]")
        service, index, controller, port, healthy = data
        check_name(service, f"{where}.service")
        if not _index(index):
            raise Invalid("malformed", f"{where}.{service}: index must be 0-{MAX_INDEX}, got {index!r:.40}")
        controller = _peer(controller, f"{where}.{service}.controller")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65_535:
            raise Invalid("malformed", f"{where}.{service}: port must be 1-65535, got {port!r:.40}")
        if not isinstance(healthy, bool):
            raise Invalid("malformed", f"{where}.{service}: healthy must be true or false")
        return cls(service=service, index=index, controller=controller, port=port, healthy=healthy)


@dataclass(frozen=True, slots=True, kw_only=True)
class DemandEntry:
    service: str
    rate: float  # requests per second entering this member's gateway
    in_flight: float  # requests in flight there (averaged)
    p99_ms: float | None = None
    p50_ms: float | None = None  # the median latency there: what the forecast plans a request's time with

    def to_wire(self) -> list[Any]:
        return [self.service, round(self.rate, 2), round(self.in_flight, 2),
                None if self.p99_ms is None else round(self.p99_ms, 1),
                None if self.p50_ms is None else round(self.p50_ms, 1)]

    @classmethod
    def from_wire(cls, data: Any) -> DemandEntry:
        where = "record.demand"
        if not isinstance(data, list) or len(data) != 5:
            raise Invalid("malformed", f"{where}: each entry is [service, rate, in_flight, p99_ms, p50_ms]")
        service, rate, in_flight, p99, p50 = data
        check_name(service, f"{where}.service")
        for label, value, most in (("rate", rate, MAX_RATE), ("in_flight", in_flight, MAX_IN_FLIGHT),
                                   ("p99_ms", p99, MAX_LATENCY_MS), ("p50_ms", p50, MAX_LATENCY_MS)):
            if label.startswith("p") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= most:
                raise Invalid("malformed", f"{where}.{service}.{label}: expected 0-{most:g}, got {value!r:.40}")
        return cls(service=service, rate=float(rate), in_flight=float(in_flight),
                   p99_ms=None if p99 is None else float(p99), p50_ms=None if p50 is None else float(p50))


def claims_from_wire(data: Any) -> tuple[ServiceClaim, ...]:
    if not isinstance(data, list) or len(data) > MAX_CLAIMS:
        raise Invalid("malformed", f"record.services: expected a list of at most {MAX_CLAIMS} claims")
    claims = tuple(ServiceClaim.from_wire(item) for item in data)
    if len({c.name for c in claims}) != len(claims):
        raise Invalid("malformed", "record.services: a service is claimed twice")
    return claims


def replicas_from_wire(data: Any) -> tuple[ReplicaEntry, ...]:
    if not isinstance(data, list) or len(data) > MAX_REPLICAS:
        raise Invalid("malformed", f"record.replicas: expected a list of at most {MAX_REPLICAS} entries")
    entries = tuple(ReplicaEntry.from_wire(item) for item in data)
    keys = [(e.service, e.controller, e.index) for e in entries]
    if len(set(keys)) != len(keys):
        raise Invalid("malformed", "record.replicas: a replica is announced twice")
    if len({(e.port) for e in entries}) != len(entries):
        raise Invalid("malformed", "record.replicas: two replicas on one port")
    return entries


def demand_from_wire(data: Any) -> tuple[DemandEntry, ...]:
    if not isinstance(data, list) or len(data) > MAX_DEMAND:
        raise Invalid("malformed", f"record.demand: expected a list of at most {MAX_DEMAND} entries")
    entries = tuple(DemandEntry.from_wire(item) for item in data)
    if len({e.service for e in entries}) != len(entries):
        raise Invalid("malformed", "record.demand: a service is reported twice")
    return entries


def _peer(raw: Any, where: str) -> str:
    try:
        if not isinstance(raw, bytes):
            raise Invalid("malformed", "not bytes")
        peer_key(raw)
    except Invalid:
        raise Invalid("malformed", f"{where}: not an Ed25519 peer id") from None
    return peer_str(raw)


def _index(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= MAX_INDEX
