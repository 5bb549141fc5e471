"""Where a service's requests enter and how many (sans-IO): this member's share, as its gateway
counts it, and the swarm's sum, as a controller reads it from the members' records.

Theory of operation.
- **This member's share** (``LocalDemand``). The gateway reports its figures every second
  (``serve.gateway``): per service, the requests it has answered since it started and the
  requests in flight at that moment. Both become figures over the last ``WINDOW_S`` (the
  autoscaler's panic window): the rate from the count's growth (the gateway's own rate is
  over a minute, too slow to scale on; a count that went down is a restarted gateway, and
  its window starts over), the in-flight count averaged (a moment's count would make the
  record change every second). The entries (gossip/registry.py ``DemandEntry``, the busiest
  ``MAX_DEMAND`` services) go into this member's record; ``changed`` says when they moved
  enough to be worth a new record (a gossip round carries every record change to every
  member): a service appearing or going quiet, or a figure moving by more than
  ``CHANGE`` of itself, at most once per ``PUBLISH_S``.
- **The swarm's sum** (``swarm_demand``). A controller sums the entries for its service
  over the members in service, its own included. What a member may say is bounded twice:
  on the wire (MAX_RATE, MAX_IN_FLIGHT: a record beyond them is refused whole) and here,
  where a member's in-flight counts at most what its gateway can hold for the service (the
  gateway caps its requests in flight at ``POOL_PER_REPLICA`` per replica it routes to),
  and its p99 counts only when it carries at least ``P99_SHARE`` of the requests: one
  member's slow link or lie cannot alone push the service over its latency SLO. The members'
  median latencies, weighed by their requests, are a request's typical time, which the
  forecast turns a rate into replicas with (in flight averaged over a few 1 Hz looks is
  too coarse for that at a few requests a second).
- **Demand points.** The same entries, as (member, requests per second), tell placement
  where requests enter (the members' own hosts' RTTs stand for their users'). Each member's
  weight is capped at ``POINT_SHARE`` of the service's total when others report too, so one
  member inflating its figures cannot outweigh everyone else entirely (with the spread rule,
  service.py, it cannot draw every replica to itself); the ``MAX_POINTS`` heaviest are kept.
  (Not yet: checking a member's figures against the requests the replicas' hosts saw come
  from it; until then a member can claim demand up to these caps.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..gossip.registry import MAX_DEMAND, MAX_IN_FLIGHT, MAX_LATENCY_MS, MAX_RATE, DemandEntry, check_name
from ..p2p.signed import Invalid

WINDOW_S = 6.0
PUBLISH_S = 2.0
CHANGE = 0.2  # a figure moving by this share of itself is worth a new record
POOL_PER_REPLICA = 64  # the gateway's in-flight cap per replica (gateway.Limits.pool_per_replica)
P99_SHARE = 0.1
POINT_SHARE = 0.8
MAX_POINTS = 8
QUIET = 0.05  # below this many requests per second and in flight, a service is quiet here


@dataclass(frozen=True, slots=True)
class Demand:
    """A service's demand summed over the swarm."""
    rate: float  # requests per second entering the gateways
    in_flight: float
    p99_ms: float | None
    latency_ms: float | None  # the members' p50, weighed by their requests: a request's typical time
    points: tuple[tuple[str, float], ...]  # (member, weight: its requests per second, capped), heaviest first
    reporters: int  # members reporting it


class LocalDemand:
    def __init__(self) -> None:
        self._window: dict[str, deque[tuple[float, int, float]]] = {}  # service -> (time, requests, in flight)
        self._latency: dict[str, tuple[float | None, float | None]] = {}  # service -> (p99, p50)
        self._published: dict[str, DemandEntry] = {}
        self._published_at = float("-inf")

    def observe(self, now: float, stats: Any) -> None:
        """The gateway's statistics (its ``services`` map); anything malformed in them is skipped."""
        services = stats.get("services") if isinstance(stats, Mapping) else None
        if not isinstance(services, Mapping):
            return
        seen = set()
        for name, figures in list(services.items())[:4096]:
            try:
                check_name(name)
            except Invalid:
                continue
            if not isinstance(figures, Mapping):
                continue
            requests, in_flight = figures.get("requests"), _figure(figures.get("in_flight"), MAX_IN_FLIGHT)
            if isinstance(requests, bool) or not isinstance(requests, int) or requests < 0 or in_flight is None:
                continue
            seen.add(name)
            window = self._window.setdefault(name, deque())
            if window and (requests < window[-1][1] or now <= window[-1][0]):
                window.clear()  # the gateway restarted (its count began again), or the clock stepped back
            window.append((now, requests, in_flight))
            while len(window) > 1 and window[0][0] < now - WINDOW_S:
                window.popleft()
            self._latency[name] = (_figure(figures.get("p99_ms"), MAX_LATENCY_MS),
                                   _figure(figures.get("p50_ms"), MAX_LATENCY_MS))
        for name in set(self._window) - seen:  # gone from the gateway's table
            del self._window[name]
            self._latency.pop(name, None)

    def entries(self) -> tuple[DemandEntry, ...]:
        """This member's demand entries now: the busiest services that are not quiet, by name."""
        out = []
        for name, window in self._window.items():
            span = window[-1][0] - window[0][0]
            rate = min((window[-1][1] - window[0][1]) / span, MAX_RATE) if span > 0 else 0.0
            in_flight = sum(v for _, _, v in window) / len(window)
            p99, p50 = self._latency.get(name, (None, None))
            if rate >= QUIET or in_flight >= QUIET:
                out.append(DemandEntry(service=name, rate=round(rate, 2), in_flight=round(in_flight, 2),
                                       p99_ms=None if p99 is None else round(p99, 1),
                                       p50_ms=None if p50 is None else round(p50, 1)))
        out.sort(key=lambda e: (-e.rate, -e.in_flight, e.service))
        return tuple(sorted(out[:MAX_DEMAND], key=lambda e: e.service))

    def changed(self, now: float) -> tuple[DemandEntry, ...] | None:
        """The entries, when they moved enough since the last ones returned to be published."""
        if now - self._published_at < PUBLISH_S:
            return None
        entries = self.entries()
        now_by = {e.service: e for e in entries}
        if set(now_by) == set(self._published) and all(
                not _moved(e.rate, self._published[n].rate) and not _moved(e.in_flight, self._published[n].in_flight)
                for n, e in now_by.items()):
            return None
        self._published, self._published_at = now_by, now
        return entries


def swarm_demand(name: str, members: Iterable[Any], replicas: int) -> Demand:
    """``name``'s demand over ``members`` (objects with ``peer``, ``in_service`` and a record
    with ``demand``) for a service routed to ``replicas`` replicas."""
    cap = POOL_PER_REPLICA * max(replicas, 1)
    reports: list[tuple[str, DemandEntry]] = []
    for m in members:
        if not getattr(m, "in_service", False):
            continue
        for entry in getattr(m.record, "demand", ()):
            if entry.service == name:
                reports.append((m.peer, entry))
                break
    rate = sum(e.rate for _, e in reports)
    in_flight = sum(min(e.in_flight, cap) for _, e in reports)
    p99s = [e.p99_ms for _, e in reports if e.p99_ms is not None and rate > 0 and e.rate >= P99_SHARE * rate]
    timed = [(e.rate, e.p50_ms) for _, e in reports if e.p50_ms is not None and e.rate > 0]
    timed_rate = sum(r for r, _ in timed)
    points = []
    for peer, e in reports:
        others = rate - e.rate
        weight = e.rate if others <= 0 else min(e.rate, max(others, 0.0) * POINT_SHARE / (1 - POINT_SHARE))
        if weight > 0:
            points.append((peer, weight))
    points.sort(key=lambda p: (-p[1], p[0]))
    return Demand(rate=rate, in_flight=in_flight, p99_ms=max(p99s) if p99s else None,
                  latency_ms=sum(r * ms for r, ms in timed) / timed_rate if timed_rate > 0 else None,
                  points=tuple(points[:MAX_POINTS]), reporters=len(reports))


def _figure(value: Any, most: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= most:
        return None
    return float(value)


def _moved(now: float, before: float) -> bool:
    return abs(now - before) > CHANGE * max(before, 1.0)
