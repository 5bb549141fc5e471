"""Which replica serves a request: the nearest ones first, the least busy of two among them, sans-IO.

Theory of operation. The gateway (``gateway.py``) hands the balancer the table of replicas
it got from the daemon, once a second (``update``); for each request it asks for a replica
(``pick``), says when the request went out (``started``) and how it ended (``finished``:
ok or not, and its time to the response headers). The balancer keeps, per replica, the
requests in flight, the failure streak and ejections, and the latency samples; it never
reads a clock (``now`` is given: the driver's monotonic seconds), never does I/O, and draws
its randomness from the ``random.Random`` it was given, so a seeded test is exact.

Rules:
- Candidates. A replica can be picked when its host's health check says so (``healthy``),
  it is not ejected, and the caller did not ``exclude`` it (the gateway's retries exclude the
  replicas already tried).
- Nearest tier first. Candidates are grouped by the RTT of the path from this node (the
  routing layer's estimate, given in the table): a tier starts at the nearest remaining
  replica and holds every one within ``max(TIER_MIN_MS, TIER_RATIO x`` its RTT ``)`` of it;
  replicas of unknown RTT form the last tier, worse than any known. A request goes to the
  first tier with a replica under ``max_in_flight_per_replica``; only when every replica of
  a tier is at the cap does traffic spill over to the next (Envoy's locality priorities, with
  RTT standing in for the zone). With every tier at the cap ``pick`` returns None
  (``saturated``): a replica with that many requests queued serves none of them well.
- Spill by expected time. The tier's choice is kept unless a replica of a later tier should
  answer sooner: its RTT plus its requests in flight times its typical latency (an EWMA of
  its answers' times), against the same for the choice (``spilled`` counts them). A local
  replica taking 250 ms a request therefore hands the next request to one 40 ms away as soon
  as it has one in flight, while one answering in 1 ms keeps its requests until 40 are queued:
  a replica placed where the demand enters (the autoscaler's placement) takes what it answers
  fastest, not everything.
- Least busy of two within a tier (Mitzenmacher, "The Power of Two Choices in Randomized
  Load Balancing", IEEE TPDS 2001): two distinct members drawn at random, the one with fewer
  requests in flight wins, a tie goes to the nearer. It needs no global ordering of load,
  which is stale anyway between gateways, and its herd behaviour is mild: a replica that just
  freed up is not hit by every request at once.
- Outlier ejection (Envoy's ``outlier_detection``, whose defaults these are):
  ``consecutive_failures`` failed requests in a row (connect error, a 5xx from the replica,
  a timeout: the gateway decides) eject a replica for ``base_ejection_s`` x the number of
  times it was ejected, at most ``max_ejection_s``. Once that time is up it returns on
  probation: its next failure ejects it again at once, its next success ends the probation.
  The ejection count goes back to zero after a success ``max_ejection_s`` after the last
  ejection ended. The gateway checks ejected replicas itself (``ejected``, an HTTP GET of
  their health path) and ``readmit``s one whose check passed, also on probation. Failures of
  requests that were already in flight when their replica was ejected are counted in the
  statistics but do not extend the ejection.
- Panic mode (Envoy's panic threshold, at 100 %): when every candidate is ejected, the
  balancer picks among the ejected ones rather than fail the request: a service whose
  replicas all failed a few times is more likely to answer than a 503 is.
- Bounds. The table is built from peers' announcements, so ``update`` keeps at most
  ``MAX_SERVICES`` services (those already known first, then by name) and ``MAX_REPLICAS``
  replicas per service (healthy first, then nearest, then by key); the rest, and repeated
  keys, are dropped and counted in ``stats()['dropped']`` (for the last update). An RTT that
  is not a finite non-negative number is taken as unknown and counted.
- Statistics (``stats``): per service and per replica, requests and failures (since the key
  entered the table), in flight, the rate over the last ``RATE_WINDOW_S`` seconds (a ring of
  per-second counts) and the p50/p99 latency over the last ``REPLICA_SAMPLES`` (per replica)
  or ``SERVICE_SAMPLES`` (per service) samples, kept in fixed-size arrays allocated at a
  replica's first sample. Memory is bounded whatever the traffic: at most 1 KiB of samples per
  replica and 8 KiB per service.

Costs: ``update`` is O(R log R) in the table's size; ``pick`` O(r) in the service's replicas
(at most 256), ``started``/``finished`` O(1); ``stats`` sorts each window, O(r x 128 log 128)
per service. State per replica is a few counters and its sample arrays.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

MAX_SERVICES: Final = 1024
MAX_REPLICAS: Final = 256  # per service
TIER_RATIO: Final = 0.25  # a replica 25 % farther than the nearest is still "as near": estimates jitter that much
TIER_MIN_MS: Final = 1.0  # below a few ms (one data centre) RTT differences are noise, not distance
LATENCY_EWMA: Final = 0.2  # weight of a replica's newest answer time in its typical latency
RATE_WINDOW_S: Final = 60
REPLICA_SAMPLES: Final = 128  # 1 KiB of doubles; p99 of 128 samples is the second largest: a rough figure, as meant
SERVICE_SAMPLES: Final = 1024

# Envoy's outlier detection defaults (consecutive_5xx, base_ejection_time, max_ejection_time).
CONSECUTIVE_FAILURES: Final = 5
BASE_EJECTION_S: Final = 30.0
MAX_EJECTION_S: Final = 300.0
MAX_IN_FLIGHT_PER_REPLICA: Final = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class Replica:
    """One replica of a service as the table describes it."""

    key: str  # unique in the table, e.g. "PEERID/3"
    service: str
    host: str  # the peer id of the member that runs it
    address: str  # its overlay IP
    port: int
    rtt_ms: float | None  # the path's RTT from this node; None: unknown, worse than any known
    healthy: bool  # its host's health check says so


class _Window:
    """Latency samples (a ring of ``size`` doubles) and completions per second over the last
    ``RATE_WINDOW_S`` seconds (a ring of counts stamped with their second)."""

    __slots__ = ("_samples", "_size", "_next", "_filled", "_counts", "_stamps")

    def __init__(self, size: int) -> None:
        self._size = size
        self._samples: array[float] | None = None  # allocated at the first sample
        self._next = 0
        self._filled = 0
        self._counts: array[int] | None = None
        self._stamps: array[int] | None = None

    def record(self, now: float, latency_s: float | None) -> None:
        if self._counts is None or self._stamps is None:
            self._counts = array("q", bytes(8 * RATE_WINDOW_S))
            self._stamps = array("q", [-1]) * RATE_WINDOW_S
        second = math.floor(now)
        slot = second % RATE_WINDOW_S
        if self._stamps[slot] != second:
            self._stamps[slot] = second
            self._counts[slot] = 0
        self._counts[slot] += 1
        if latency_s is None:
            return
        if self._samples is None:
            self._samples = array("d", bytes(8 * self._size))
        self._samples[self._next] = latency_s
        self._next = (self._next + 1) % self._size
        self._filled = min(self._filled + 1, self._size)

    def rate(self, now: float) -> float:
        """Completions per second over the last ``RATE_WINDOW_S`` whole seconds (this one included)."""
        if self._counts is None or self._stamps is None:
            return 0.0
        second = math.floor(now)
        total = sum(count for count, stamp in zip(self._counts, self._stamps, strict=True)
                    if second - RATE_WINDOW_S < stamp <= second)
        return total / RATE_WINDOW_S

    def quantiles(self) -> tuple[float | None, float | None]:
        """(p50, p99) in ms by the nearest-rank method, None without samples."""
        if self._samples is None or not self._filled:
            return None, None
        ordered = sorted(self._samples[: self._filled])
        return _rank(ordered, 0.50) * 1000.0, _rank(ordered, 0.99) * 1000.0


def _rank(ordered: Sequence[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class _ReplicaState:
    __slots__ = ("replica", "in_flight", "streak", "ejections", "until", "last_until", "probation", "requests",
                 "failures", "window", "typical_ms")

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.in_flight = 0
        self.streak = 0  # failures in a row
        self.ejections = 0
        self.until: float | None = None  # ejected until then
        self.last_until = -math.inf  # when the last ejection ended (or was to end)
        self.probation = False
        self.requests = 0
        self.failures = 0
        self.window = _Window(REPLICA_SAMPLES)
        self.typical_ms: float | None = None  # its latency, an EWMA (LATENCY_EWMA) of its answers' times

    def expected_ms(self) -> float:
        """When a request sent now should get its answer: the path's RTT plus the requests ahead
        of it, each taking the replica's typical time (pessimistic for a server that answers many
        at once; an unknown RTT is worse than any)."""
        rtt = self.replica.rtt_ms
        if rtt is None:
            return math.inf
        return rtt + self.in_flight * (self.typical_ms or 0.0)


class _ServiceState:
    __slots__ = ("order", "requests", "failures", "panics", "saturated", "spilled", "window")

    def __init__(self) -> None:
        self.order: list[_ReplicaState] = []  # by RTT (unknown last), then key: tiers are runs of it
        self.requests = 0
        self.failures = 0
        self.panics = 0
        self.saturated = 0
        self.spilled = 0  # requests sent past their tier to a replica expected to answer sooner
        self.window = _Window(SERVICE_SAMPLES)


def _rtt_rank(rtt: float | None) -> tuple[bool, float]:
    return (rtt is None, 0.0 if rtt is None else rtt)


def _tiers(ordered: list[_ReplicaState]) -> Iterator[list[_ReplicaState]]:
    """Runs of ``ordered`` (sorted by RTT, unknown last) within the tier width of their first."""
    i, n = 0, len(ordered)
    while i < n:
        base = ordered[i].replica.rtt_ms
        if base is None:
            yield ordered[i:]
            return
        limit = base + max(TIER_MIN_MS, TIER_RATIO * base)
        j = i + 1
        while j < n and (rtt := ordered[j].replica.rtt_ms) is not None and rtt <= limit:
            j += 1
        yield ordered[i:j]
        i = j


class Balancer:
    """The routing table of the gateway and the bookkeeping of its requests (see the module)."""

    def __init__(self, rng: random.Random | None = None, *,
                 max_in_flight_per_replica: int = MAX_IN_FLIGHT_PER_REPLICA,
                 consecutive_failures: int = CONSECUTIVE_FAILURES, base_ejection_s: float = BASE_EJECTION_S,
                 max_ejection_s: float = MAX_EJECTION_S) -> None:
        if max_in_flight_per_replica < 1 or consecutive_failures < 1:
            raise ValueError("max_in_flight_per_replica and consecutive_failures must be at least 1")
        if not 0 < base_ejection_s <= max_ejection_s:
            raise ValueError("need 0 < base_ejection_s <= max_ejection_s")
        self._rng = rng if rng is not None else random.Random()
        self._max_in_flight = max_in_flight_per_replica
        self._consecutive = consecutive_failures
        self._base_ejection = base_ejection_s
        self._max_ejection = max_ejection_s
        self._services: dict[str, _ServiceState] = {}
        self._replicas: dict[str, _ReplicaState] = {}
        self._dropped = {"services": 0, "replicas": 0, "duplicates": 0, "bad_rtt": 0}

    # -- the table --------------------------------------------------------------------------

    def update(self, now: float, replicas: Iterable[Replica]) -> None:
        """Replace the table. State of keys that stay (same service) is kept."""
        del now  # nothing in the table ages; the parameter keeps the core's shape
        dropped = {"services": 0, "replicas": 0, "duplicates": 0, "bad_rtt": 0}
        seen: set[str] = set()
        by_service: dict[str, list[Replica]] = {}
        for replica in replicas:
            if replica.key in seen:
                dropped["duplicates"] += 1
                continue
            seen.add(replica.key)
            rtt = replica.rtt_ms
            if rtt is not None and (isinstance(rtt, bool) or not isinstance(rtt, int | float)
                                    or not math.isfinite(rtt) or rtt < 0):
                dropped["bad_rtt"] += 1
                replica = Replica(key=replica.key, service=replica.service, host=replica.host,
                                  address=replica.address, port=replica.port, rtt_ms=None, healthy=replica.healthy)
            by_service.setdefault(replica.service, []).append(replica)
        names = sorted(by_service, key=lambda name: (name not in self._services, name))
        dropped["services"] = max(0, len(names) - MAX_SERVICES)
        services: dict[str, _ServiceState] = {}
        states: dict[str, _ReplicaState] = {}
        for name in names[:MAX_SERVICES]:
            listed = sorted(by_service[name], key=lambda r: (not r.healthy, _rtt_rank(r.rtt_ms), r.key))
            dropped["replicas"] += max(0, len(listed) - MAX_REPLICAS)
            service = self._services.get(name) or _ServiceState()
            order = []
            for replica in listed[:MAX_REPLICAS]:
                state = self._replicas.get(replica.key)
                if state is None or state.replica.service != name:
                    state = _ReplicaState(replica)
                else:
                    state.replica = replica
                states[replica.key] = state
                order.append(state)
            order.sort(key=lambda s: (_rtt_rank(s.replica.rtt_ms), s.replica.key))
            service.order = order
            services[name] = service
        self._services = services
        self._replicas = states
        self._dropped = dropped

    def services(self) -> list[str]:
        return list(self._services)

    def replica(self, key: str) -> Replica | None:
        state = self._replicas.get(key)
        return None if state is None else state.replica

    # -- choosing ---------------------------------------------------------------------------

    def pick(self, service: str, now: float, *, exclude: frozenset[str] | set[str] = frozenset()) -> Replica | None:
        """A replica for one request of ``service``, or None: no candidate, or all at the cap."""
        state = self._services.get(service)
        if state is None:
            return None
        pool: list[_ReplicaState] = []
        live: list[_ReplicaState] = []
        for rs in state.order:
            if not rs.replica.healthy or rs.replica.key in exclude:
                continue
            pool.append(rs)
            if not self._is_ejected(rs, now):
                live.append(rs)
        if not live:
            if not pool:
                return None
            live = pool
            state.panics += 1
        tiers = list(_tiers(live))
        for i, tier in enumerate(tiers):
            free = [rs for rs in tier if rs.in_flight < self._max_in_flight]
            if not free:
                continue
            chosen = self._two_choices(free)
            if chosen.in_flight and chosen.typical_ms:
                later = [rs for t in tiers[i + 1:] for rs in t if rs.in_flight < self._max_in_flight]
                sooner = min(later, key=lambda rs: (rs.expected_ms(), rs.replica.key), default=None)
                if sooner is not None and sooner.expected_ms() < chosen.expected_ms():
                    state.spilled += 1
                    return sooner.replica
            return chosen.replica
        state.saturated += 1
        return None

    def _two_choices(self, free: list[_ReplicaState]) -> _ReplicaState:
        if len(free) == 1:
            return free[0]
        a, b = self._rng.sample(free, 2)
        if (a.in_flight, _rtt_rank(a.replica.rtt_ms)) <= (b.in_flight, _rtt_rank(b.replica.rtt_ms)):
            return a
        return b

    def known(self, service: str) -> bool:
        return service in self._services

    # -- bookkeeping ------------------------------------------------------------------------

    def started(self, key: str) -> None:
        state = self._replicas.get(key)
        if state is not None:
            state.in_flight += 1

    def finished(self, key: str, now: float, *, ok: bool, latency_s: float | None) -> None:
        """A request ``started`` on ``key`` ended. ``latency_s``: to its response headers, None
        when it has none (it failed first). A key no longer in the table is ignored."""
        state = self._replicas.get(key)
        if state is None:
            return
        state.in_flight = max(0, state.in_flight - 1)
        if latency_s is not None and not (isinstance(latency_s, int | float) and math.isfinite(latency_s)
                                          and latency_s >= 0):
            latency_s = None
        service = self._services[state.replica.service]
        state.requests += 1
        service.requests += 1
        state.window.record(now, latency_s)
        service.window.record(now, latency_s)
        if latency_s is not None:
            ms = latency_s * 1000.0
            state.typical_ms = ms if state.typical_ms is None else \
                state.typical_ms + LATENCY_EWMA * (ms - state.typical_ms)
        if ok:
            state.streak = 0
            if state.probation:
                state.probation = False
            elif state.ejections and now - state.last_until >= self._max_ejection:
                state.ejections = 0
            return
        state.failures += 1
        service.failures += 1
        if self._is_ejected(state, now):
            return  # in flight when it was ejected: the ejection already stands for it
        state.streak += 1
        if state.probation or state.streak >= self._consecutive:
            state.ejections += 1
            state.until = now + min(self._base_ejection * state.ejections, self._max_ejection)
            state.last_until = state.until
            state.streak = 0
            state.probation = False

    def _is_ejected(self, state: _ReplicaState, now: float) -> bool:
        if state.until is None:
            return False
        if now < state.until:
            return True
        state.until = None  # its time is up: back, on probation
        state.probation = True
        return False

    def ejected(self, now: float) -> set[str]:
        """Keys ejected now (for the gateway's active health checks)."""
        return {key for key, state in self._replicas.items() if self._is_ejected(state, now)}

    def readmit(self, key: str) -> None:
        """An active health check of ``key`` passed: back now, on probation."""
        state = self._replicas.get(key)
        if state is not None and state.until is not None:
            state.until = None
            state.probation = True
            state.streak = 0

    # -- statistics -------------------------------------------------------------------------

    def stats(self, now: float) -> dict[str, Any]:
        """Plain data for ``serve show`` (see the module's Statistics rule)."""
        services: dict[str, Any] = {}
        for name, service in self._services.items():
            replicas: dict[str, Any] = {}
            for rs in service.order:
                ejected = self._is_ejected(rs, now)
                p50, p99 = rs.window.quantiles()
                replicas[rs.replica.key] = {
                    "host": rs.replica.host, "address": rs.replica.address, "port": rs.replica.port,
                    "rtt_ms": rs.replica.rtt_ms, "healthy": rs.replica.healthy,
                    "ejected": ejected,
                    "ejected_for_s": _round(rs.until - now) if ejected and rs.until is not None else None,
                    "probation": rs.probation, "ejections": rs.ejections,
                    "requests": rs.requests, "failures": rs.failures, "in_flight": rs.in_flight,
                    "rate_per_s": _round(rs.window.rate(now)), "p50_ms": _round(p50), "p99_ms": _round(p99),
                    "typical_ms": _round(rs.typical_ms),
                }
            p50, p99 = service.window.quantiles()
            services[name] = {
                "requests": service.requests, "failures": service.failures,
                "in_flight": sum(rs.in_flight for rs in service.order),
                "rate_per_s": _round(service.window.rate(now)), "p50_ms": _round(p50), "p99_ms": _round(p99),
                "panics": service.panics, "saturated": service.saturated, "spilled": service.spilled,
                "replicas": replicas,
            }
        return {"services": services, "dropped": dict(self._dropped)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
