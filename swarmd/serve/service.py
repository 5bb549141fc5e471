"""Services on this node (issue 27): the controllers of the services deployed here, the host
side of the replicas running here, the registry as this node reads it, and its gateway.

Theory of operation.
- **Controller.** `serve up` stores a service (``ServiceSpec``, one JSON file per service
  under STATE_DIR/services, written atomically) and keeps its replicas with control.py's
  decisions, every ``STEP_S``: each replica is a one-node job of this node's job service
  (spec ``serve``: placed apart from its siblings, restarted elsewhere when its host dies).
  The service's claim (which index runs on which host) goes into this node's record.
- **Host side.** A replica running here (compute's ``Worker.serving``) is checked every
  ``HEALTH_S``: an HTTP GET of its health path at 127.0.0.1:PORT, answered 2xx or 3xx within
  ``HEALTH_TIMEOUT_S``; its entry (service, index, controller, port, healthy) goes into this
  node's record, which is re-advertised when an entry changes.
- **Registry and gateway.** The registry (registry.py) is read from the membership view; the
  gateway (gateway.py, its own asyncio process, supervised here and restarted after a crash)
  polls ``serve.gateway`` for the routes: each service's replicas with the RTT of this node's
  path to their host (routing's), its own at 127.0.0.1, and sends its statistics back.
- **Demand and autoscaling** (issue 28). The gateway's figures become this node's demand
  entries (demand.py), published in its record. A service deployed with a replica range
  (``autoscale``) is sized every round by its scaler (scaler.py) from the swarm's demand
  for it, with the replicas' measured start time as the forecast's lead; each change is
  logged with its reason and kept for `serve show`. A new replica is placed where the
  requests enter (the demand points, weighed), except that the lowest-index replica of a
  service of several is placed for spread (the least-loaded host), so never are all of them
  where the demand is. Every ``MOVE_S`` a replica far from the demand moves (a surge
  replica near it first, the far one drained once that is healthy) when a free host would
  cut its demand-weighted RTT by more than ``MOVE_GAIN`` and ``MOVE_MIN_MS``, twice in a
  row (hysteresis): one move at a time.

A service belongs to the local user who deployed it (their uid, as jobs are); the replicas'
jobs are that user's jobs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio

from ..atomic import write_atomically
from ..compute.coordinator.placement import demand_rtt
from ..compute.spec import MAX_NEAR, MAX_NEAR_WEIGHT, MAX_RESTARTS, JobSpec, Serve, SpecError
from ..gossip.registry import (ACCESS, MAX_ASSIGNED, MAX_CLAIMS, MAX_REPLICAS, DemandEntry, ReplicaEntry,
                               ServiceClaim, check_health, check_name)
from ..p2p.signed import Invalid
from .control import Controller, Observed, Slot, StartReplica, StopReplica
from .demand import Demand, LocalDemand, swarm_demand
from .registry import Registry, Table
from .scaler import Decision, Policy, Sample, Scaler

log = structlog.get_logger("swarmd.serve")

STEP_S = 0.5  # controllers' period
HEALTH_S = 2.0  # replicas' health checks
HEALTH_TIMEOUT_S = 2.0
GATEWAY_RESTART_S = 2.0  # after the gateway process exits, before it is started again
REPLICA_WAIT_S = 86_400.0  # a replica waits this long for a host that fits before its job fails
TEMPLATE_FIELDS = ("cmd", "env", "cpus", "mem", "gpus_per_node", "labels", "hosts", "python")
# a service's autoscaling as `serve up` gives it: its field -> scaler.Policy's
AUTOSCALE_FIELDS = {"min": "min_replicas", "max": "max_replicas", "target_inflight": "target_inflight",
                    "slo_p99_ms": "slo_p99_ms", "predictive": "predictive", "season_s": "season_s",
                    "stable_s": "stable_s", "panic_s": "panic_s", "down_delay_s": "down_delay_s",
                    "idle_s": "idle_s", "move_s": None}
MOVE_S = 120.0  # a service's placement is weighed against its demand this often (autoscale's move_s)
MOVE_GAIN, MOVE_MIN_MS = 0.3, 5.0  # a move must cut the replica's demand-weighted RTT by both
SCALER_SAVE_S = 30.0  # a scaler's learned state is written this often
MAX_EVENTS = 20  # scaling events kept per service for `serve show`


class ServeError(ValueError):
    """A request about services that cannot be carried out; the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceSpec:
    name: str
    replicas: int
    template: dict[str, Any]  # a job spec's fields (TEMPLATE_FIELDS) every replica runs
    workdir: str | None  # an uploaded workdir's digest
    health: str
    access: str
    token_sha256: str | None  # hex
    owner: int  # the deploying user's uid
    created: float
    generation: int = 1
    autoscale: dict[str, Any] | None = None  # AUTOSCALE_FIELDS; None: a fixed count

    def job_spec(self, index: int, near: tuple[tuple[str, int], ...] = ()) -> JobSpec:
        serve = {"service": self.name, "replica": index, "health": self.health,
                 **({"near": [list(p) for p in near]} if near else {})}
        fields = {**self.template, "name": f"{self.name}-{index}", "nodes": 1, "max_restarts": MAX_RESTARTS,
                  "wait": REPLICA_WAIT_S, "serve": serve}
        return JobSpec.from_wire(fields)

    def policy(self) -> Policy | None:
        if self.autoscale is None:
            return None
        return Policy(**{AUTOSCALE_FIELDS[k]: v for k, v in self.autoscale.items() if AUTOSCALE_FIELDS[k]})

    @property
    def move_s(self) -> float:
        return float((self.autoscale or {}).get("move_s", MOVE_S))

    def claim(self, assigned: tuple[tuple[int, str], ...]) -> ServiceClaim:
        return ServiceClaim(name=self.name, created=self.created, access=self.access,
                            token_sha256=bytes.fromhex(self.token_sha256) if self.token_sha256 else None,
                            health=self.health, assigned=assigned)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "replicas": self.replicas, "template": self.template, "workdir": self.workdir,
                "health": self.health, "access": self.access, "token_sha256": self.token_sha256,
                "owner": self.owner, "created": self.created, "generation": self.generation,
                "autoscale": self.autoscale}


def check_spec(params: Mapping[str, Any], *, owner: int, now: float) -> ServiceSpec:
    """A service spec from `serve.up`'s parameters (or a file on disk): every field checked."""
    try:
        name = check_name(params.get("name"), "name")
        health = check_health(params.get("health") or "/", "health")
    except Invalid as exc:
        raise ServeError(exc.detail) from None
    replicas = params.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= MAX_ASSIGNED:
        raise ServeError(f"replicas: must be 0-{MAX_ASSIGNED}, got {replicas!r:.40}")
    template = params.get("template")
    if not isinstance(template, Mapping) or set(template) - set(TEMPLATE_FIELDS):
        raise ServeError(f"template: a map of {', '.join(TEMPLATE_FIELDS)}")
    access = params.get("access", "members")
    if access not in ACCESS:
        raise ServeError(f"access: one of {', '.join(ACCESS)}, got {access!r:.40}")
    token = params.get("token_sha256")
    if (access == "token") != (token is not None) or (token is not None and not (
            isinstance(token, str) and len(token) == 64 and all(c in "0123456789abcdef" for c in token))):
        raise ServeError("token_sha256: a token's SHA-256 (64 hex digits) with access token, nothing otherwise")
    workdir = params.get("workdir")
    if workdir is not None and not (isinstance(workdir, str) and len(workdir) == 64
                                    and all(c in "0123456789abcdef" for c in workdir)):
        raise ServeError("workdir: an uploaded workdir's digest")
    created, generation = params.get("created", now), params.get("generation", 1)
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise ServeError("created: a time")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise ServeError("generation: a positive integer")
    autoscale = check_autoscale(params.get("autoscale"))
    if autoscale is not None:
        replicas = min(max(replicas if "replicas" in params else autoscale["min"], autoscale["min"]),
                       autoscale["max"])
    spec = ServiceSpec(name=name, replicas=replicas, template=dict(template), workdir=workdir, health=health,
                       access=access, token_sha256=token, owner=owner, created=float(created), generation=generation,
                       autoscale=autoscale)
    try:
        spec.job_spec(0)
    except SpecError as exc:
        raise ServeError(str(exc).removeprefix("spec: ")) from None
    return spec


def check_autoscale(value: Any) -> dict[str, Any] | None:
    """A replica range and the scaler's settings (AUTOSCALE_FIELDS), each checked; None: none."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) - set(AUTOSCALE_FIELDS) or not {"min", "max"} <= set(value):
        raise ServeError(f"autoscale: a map with min and max, and any of {', '.join(AUTOSCALE_FIELDS)}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key == "predictive":
            if not isinstance(v, bool):
                raise ServeError(f"autoscale.predictive: true or false, got {v!r:.40}")
        elif key == "slo_p99_ms" and v is None:
            pass
        elif key in ("min", "max"):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ServeError(f"autoscale.{key}: an integer, got {v!r:.40}")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ServeError(f"autoscale.{key}: a positive number, got {v!r:.40}")
        elif key == "move_s" and not 10 <= v <= 86_400:
            raise ServeError(f"autoscale.move_s: 10-86400 seconds, got {v!r:.40}")
        out[key] = v
    spec = ServiceSpec(name="x", replicas=0, template={}, workdir=None, health="/", access="members",
                       token_sha256=None, owner=0, created=0.0, autoscale=out)
    try:
        policy = spec.policy()
        assert policy is not None
        policy.check()
    except (ValueError, TypeError) as exc:
        names = {v: k for k, v in AUTOSCALE_FIELDS.items() if v}
        message = str(exc)
        for field_name, key in names.items():
            message = message.replace(field_name, key)
        raise ServeError(f"autoscale: {message}") from None
    return out


@dataclass(slots=True)
class _Own:
    """The own record as a member of the view: the registry reads it like any other."""
    peer: str
    record: Any
    in_service: bool = True


class Services:
    def __init__(self, *, jobs: Any, gossip: Any, state_dir: Path, rtt: Callable[[str], float | None],
                 path: Callable[[str], str | None], gateway_listen: str | None, socket_path: Path,
                 pair_rtt: Callable[[str, str], float | None] | None = None) -> None:
        self.jobs, self.gossip = jobs, gossip
        self.rtt, self.path = rtt, path  # routing's RTT and path kind from this node to a host
        self.pair_rtt = pair_rtt or (lambda a, b: None)  # between any two members (routing's estimate)
        self.dir = state_dir / "services"
        self.gateway_listen, self.socket_path = gateway_listen, socket_path
        self.specs: dict[str, ServiceSpec] = {}
        self.controllers: dict[str, Controller] = {}
        self.registry = Registry()
        self.health: dict[tuple[str, str], bool] = {}  # (origin, job) of a replica here -> its last check
        self.gateway: dict[str, Any] = {"state": "off" if gateway_listen is None else "starting", "pid": None,
                                        "stats": {}, "seen": None, "restarts": 0}
        self._claims: tuple[ServiceClaim, ...] = ()
        self._entries: tuple[ReplicaEntry, ...] = ()
        self.local_demand = LocalDemand()
        self._demand: tuple[DemandEntry, ...] = ()
        self.scalers: dict[str, Scaler] = {}
        self.decisions: dict[str, Decision] = {}
        self.events: dict[str, list[dict[str, Any]]] = {}
        self.demand: dict[str, Demand] = {}  # the swarm's demand for each service controlled here
        self._saved_scalers = 0.0
        self._moves: dict[str, tuple[float, int | None]] = {}  # service -> (last weighed, the slot found far)
        self._load()

    # --- what goes into this node's record ----------------------------------------------

    def serve_info(self) -> dict[str, Any]:
        return {"services": self._claims, "replicas": self._entries, "demand": self._demand}

    def _publish(self) -> None:
        """This node's claims and replica entries as they are now; re-advertised on a change."""
        observed = self._observed()
        claims = tuple(spec.claim(self.controllers[name].assigned(observed))
                       for name, spec in sorted(self.specs.items()) if spec.replicas or self.controllers[name].slots)
        serving = getattr(self.jobs.worker, "serving", {})
        entries = tuple(ReplicaEntry(service=s.serve.service, index=s.serve.replica, controller=s.origin,
                                     port=s.port, healthy=self.health.get(key, False))
                        for key, s in sorted(serving.items()))
        claims, entries = claims[:MAX_CLAIMS], entries[:MAX_REPLICAS]
        demand = self.local_demand.changed(time.time())
        if (claims, entries) != (self._claims, self._entries) or (demand is not None and demand != self._demand):
            self._claims, self._entries = claims, entries
            self._demand = self._demand if demand is None else demand
            self.gossip.readvertise()

    # --- the controllers ------------------------------------------------------------------

    def _observed(self) -> dict[str, Observed]:
        """Each replica job's state and host, and its health as the registry shows it."""
        table = self.registry.table
        healthy = {(r.service, r.index, r.host) for s in table.services.values()
                   if s.controller == self.gossip.me for r in s.replicas if r.healthy}
        out = {}
        for name, c in self.controllers.items():
            for slot in c.slots.values():
                if slot.job is None:
                    continue
                row = self.jobs.store.get(slot.job)
                if row is None:
                    out[slot.job] = Observed(state="failed")
                    continue
                host = row.nodes[0] if row.state == "running" and row.nodes else None
                out[slot.job] = Observed(state=row.state, host=host,
                                         healthy=host is not None and (name, slot.index, host) in healthy)
        return out

    def step(self, now: float) -> None:
        """One round of every controller, then the record. Each service's round stands alone: one
        that fails (its file cannot be written, a job gone from the store) is logged and tried
        again next round, the others go on."""
        members = self._members()
        self.registry.update(now, members)
        observed = self._observed()
        for name in list(self.controllers):
            try:
                self._scale(name, now, members, observed)
                self._step_one(name, now, observed)
            except Exception:
                log.exception("a service's control round failed", service=name)
        if now - self._saved_scalers >= SCALER_SAVE_S:
            self._saved_scalers = now
            for name in list(self.scalers):
                self._save(name)
        self._publish()

    def _scale(self, name: str, now: float, members: list[Any], observed: Mapping[str, Observed]) -> None:
        """The service's demand summed; with a replica range, its scaler's decision; every
        ``move_s``, whether a replica should move nearer the demand."""
        c, spec = self.controllers[name], self.specs[name]
        assigned = c.assigned(observed)
        demand = self.demand[name] = swarm_demand(name, members, replicas=len(assigned))
        scaler = self.scalers.get(name)
        if scaler is not None and spec.replicas > 0:
            scaler.observe(Sample(at=now, rate=demand.rate, in_flight=demand.in_flight, p99_ms=demand.p99_ms,
                                  latency_s=None if demand.latency_ms is None else demand.latency_ms / 1000))
            ready = sum(1 for slot in c.slots.values() if slot.draining_since is None and slot.job is not None
                        and (seen := observed.get(slot.job)) is not None and seen.healthy)
            decision = self.decisions[name] = scaler.decide(now, current=c.replicas, ready=ready, start_s=c.start_s)
            if decision.replicas != c.replicas:
                log.info("service scaled", service=name, replicas=decision.replicas, before=c.replicas,
                         reason=decision.reason, mode=decision.mode)
                self._event(name, now, c.replicas, decision.replicas, decision.mode, decision.reason)
                c.replicas = decision.replicas
                self.specs[name] = spec = dataclasses.replace(spec, replicas=decision.replicas)
        self._weigh_placement(name, now, assigned, members)

    def _event(self, name: str, now: float, before: int, after: int, mode: str, reason: str) -> None:
        """A scaling event kept for `serve show` (the last MAX_EVENTS)."""
        events = self.events.setdefault(name, [])
        events.append({"at": now, "from": before, "to": after, "mode": mode, "reason": reason})
        del events[:-MAX_EVENTS]

    def _weigh_placement(self, name: str, now: float, assigned: tuple[tuple[int, str], ...],
                         members: list[Any]) -> None:
        """Every move_s: the replica whose host is farthest from the demand moves when a free
        member would be much nearer, found so twice in a row (module docstring)."""
        spec, c, demand = self.specs[name], self.controllers[name], self.demand[name]
        last, far = self._moves.get(name, (now, None))
        if name not in self._moves:
            self._moves[name] = (now, None)
        if now - last < spec.move_s:
            return
        self._moves[name] = (now, None)
        if not demand.points or not assigned or any(s.moving or s.generation != c.generation
                                                    for s in c.slots.values() if s.draining_since is None):
            return  # no demand, or a move or a roll-out under way
        hosts = {host for _, host in assigned}
        movable = [(index, host) for index, host in assigned if not (index == min(i for i, _ in assigned)
                                                                      and len(assigned) > 1)]
        if not movable:
            return
        cost = {host: self._demand_rtt(host, demand.points) for _, host in assigned}
        index, host = max(movable, key=lambda pair: (cost[pair[1]], pair[0]))
        free = [m.peer for m in members if m.in_service and m.peer not in hosts and _has_slot(m)]
        if not free:
            return
        best = min(self._demand_rtt(peer, demand.points) for peer in free)
        if cost[host] - best > max(MOVE_MIN_MS, MOVE_GAIN * cost[host]):
            if far == index:
                log.info("replica moves nearer its demand", service=name, index=index, host=host,
                         demand_rtt_ms=round(cost[host], 1), could_be_ms=round(best, 1))
                c.relocate(index)
                self._event(name, now, c.replicas, c.replicas, "move", f"replica {index} moves nearer its demand "
                            f"({cost[host]:.0f} ms -> {best:.0f} ms demand-weighted)")
            else:
                self._moves[name] = (now, index)

    def _demand_rtt(self, host: str, points: tuple[tuple[str, float], ...]) -> float:
        """The mean RTT from ``host`` to where the requests enter, weighed by them."""
        return demand_rtt(host, points, self.pair_rtt) / (sum(w for _, w in points) or 1.0)

    def _near(self, name: str, index: int) -> tuple[tuple[str, int], ...]:
        """The demand points a new replica is placed by: none for the lowest index of several
        (placed for spread), and none without demand."""
        c, demand = self.controllers[name], self.demand.get(name)
        if demand is None or not demand.points:
            return ()
        active = [s.index for s in c.slots.values() if s.draining_since is None]
        if c.replicas > 1 and index == min(active, default=index):
            return ()
        top = max(w for _, w in demand.points)
        return tuple((peer, max(1, min(MAX_NEAR_WEIGHT, round(MAX_NEAR_WEIGHT * w / top))))
                     for peer, w in demand.points[:MAX_NEAR])

    def _step_one(self, name: str, now: float, observed: Mapping[str, Observed]) -> None:
        c, spec = self.controllers[name], self.specs[name]
        for action in c.step(now, observed):
            match action:
                case StartReplica(index=index):
                    try:
                        job = self.jobs.submit(spec.job_spec(index, self._near(name, index)), spec.workdir,
                                               spec.owner)
                    except Exception as exc:  # a workdir evicted, a spec that no longer builds
                        log.warning("a replica could not be submitted", service=name, index=index, error=str(exc))
                        c.slots[index].retry_at = now + GATEWAY_RESTART_S
                        continue
                    c.started(index, job)
                    log.info("replica started", service=name, index=index, job=job)
                case StopReplica(index=index, job=job):
                    log.info("replica stopped", service=name, index=index, job=job)
                    try:
                        self.jobs.cancel(job)
                    except KeyError:  # gone from the store (its retention ran out): nothing to stop
                        c.slots[index].job = None
        if not spec.replicas and not c.slots:  # down, and every replica gone
            del self.controllers[name], self.specs[name]
            for table in (self.scalers, self.decisions, self.events, self.demand, self._moves):
                table.pop(name, None)  # type: ignore[attr-defined]
            (self.dir / f"{name}.json").unlink(missing_ok=True)
            log.info("service removed", service=name)
        else:
            self._save(name)

    def _members(self) -> list[Any]:
        view = self.gossip.view()
        members: list[Any] = list(view)
        own = self.gossip.own_record
        if own is not None and self.gossip.me not in view:
            members.append(_Own(peer=self.gossip.me, record=own))
        return members

    # --- the control API's side -----------------------------------------------------------

    def up(self, params: Mapping[str, Any], owner: int, admin: bool) -> dict[str, Any]:
        spec = check_spec({k: v for k, v in params.items() if k not in ("created", "generation")},
                          owner=owner, now=time.time())
        before = self.specs.get(spec.name)
        if before is not None:
            if before.owner != owner and not admin:
                raise ServeError(f"service {spec.name} belongs to another user")
            changed = (spec.template, spec.workdir, spec.health) != (before.template, before.workdir, before.health)
            spec = ServiceSpec(**{**spec.to_json(), "owner": before.owner, "created": before.created,
                                  "generation": before.generation + 1 if changed else before.generation})
            if spec.autoscale is not None and "replicas" not in params:  # the scaler's count stands
                low, high = spec.autoscale["min"], spec.autoscale["max"]
                spec = dataclasses.replace(spec, replicas=min(max(before.replicas, low), high))
        elif len(self.specs) >= MAX_CLAIMS:
            raise ServeError(f"this node controls {MAX_CLAIMS} services already")
        if (taken := self.registry.table.get(spec.name)) is not None and taken.controller != self.gossip.me:
            raise ServeError(f"the name {spec.name} is taken: another member ({taken.controller}) controls it")
        c = self.controllers.get(spec.name) or Controller(replicas=spec.replicas, generation=spec.generation)
        c.replicas, c.generation = spec.replicas, spec.generation
        self.specs[spec.name], self.controllers[spec.name] = spec, c
        self._set_scaler(spec)
        self._save(spec.name)
        log.info("service up", service=spec.name, replicas=spec.replicas, generation=spec.generation,
                 autoscale=spec.autoscale)
        return {"name": spec.name, "replicas": spec.replicas, "generation": spec.generation,
                "autoscale": spec.autoscale, "rolling": before is not None and spec.generation != before.generation}

    def _set_scaler(self, spec: ServiceSpec, state: Any = None) -> None:
        """The service's scaler for its policy now; what an earlier one learned carries over."""
        policy = spec.policy()
        if policy is None:
            self.scalers.pop(spec.name, None)
            self.decisions.pop(spec.name, None)
            return
        old = self.scalers.get(spec.name)
        if old is not None and old.policy == policy:
            return
        self.scalers[spec.name] = Scaler.from_json(policy, old.to_json() if old is not None else state)

    def scale(self, name: str, replicas: int | None, owner: int, admin: bool,
              autoscale: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A fixed count (autoscaling off), or with ``autoscale`` a new range and settings (those
        not given are kept)."""
        spec = self.own(name, owner, admin)
        if autoscale is not None:
            merged = check_autoscale({**(spec.autoscale or {}), **autoscale})
            assert merged is not None
            replicas = min(max(spec.replicas, merged["min"]), merged["max"])
        elif isinstance(replicas, bool) or not isinstance(replicas, int) or not 0 <= replicas <= MAX_ASSIGNED:
            raise ServeError(f"replicas: must be 0-{MAX_ASSIGNED}")
        else:
            merged = None
        self.specs[name] = spec = dataclasses.replace(spec, replicas=replicas, autoscale=merged)
        self.controllers[name].replicas = replicas
        self._set_scaler(spec)
        self._save(name)
        return {"name": name, "replicas": replicas, "autoscale": merged}

    def down(self, name: str, owner: int, admin: bool) -> dict[str, Any]:
        self.scale(name, 0, owner, admin)
        return {"name": name, "state": "draining"}

    def own(self, name: str, owner: int, admin: bool) -> ServiceSpec:
        spec = self.specs.get(name)
        if spec is None or (spec.owner != owner and not admin):
            raise ServeError(f"no service {name!r} controlled by this node" + ("" if spec is None else " of yours"))
        return spec

    def ls(self) -> list[dict[str, Any]]:
        """Every service the registry knows, with this node's own ones' desired counts."""
        table = self.registry.table
        out = []
        for name in sorted(set(table.services) | set(self.specs)):
            s, spec = table.get(name), self.specs.get(name)
            out.append({"name": name, "controller": s.controller if s else self.gossip.me,
                        "replicas": spec.replicas if spec else len(s.claim.assigned) if s else 0,
                        "serving": sum(1 for r in s.replicas if r.healthy) if s else 0,
                        "access": (s.claim.access if s else spec.access if spec else None),
                        "mine": spec is not None, "orphaned": bool(s and s.orphaned),
                        "contenders": list(s.contenders) if s else []})
        return out

    def show(self, name: str) -> dict[str, Any]:
        s, spec = self.registry.table.get(name), self.specs.get(name)
        if s is None and spec is None:
            raise ServeError(f"no service {name!r} in the registry")
        stats = self.gateway["stats"].get("services", {}).get(name, {}) if self.gateway["stats"] else {}
        per_replica = stats.get("replicas", {})
        jobs = {}
        if spec is not None:
            jobs = {slot.index: {"job": slot.job, "generation": slot.generation,
                                 "draining": slot.draining_since is not None}
                    for slot in self.controllers[name].slots.values()}
        rows = []
        for r in (s.replicas if s else ()):
            seen = per_replica.get(r.key, {})
            rows.append({"index": r.index, "host": r.host, "address": r.address, "port": r.port,
                         "healthy": r.healthy, "path": self.path(r.host) if r.host != self.gossip.me else "local",
                         "rtt_ms": 0.0 if r.host == self.gossip.me else self.rtt(r.host), **jobs.get(r.index, {}),
                         **{k: seen.get(k) for k in ("in_flight", "requests", "failures", "p50_ms", "p99_ms",
                                                     "rate_per_s", "ejected")}})
        listed = {row["index"] for row in rows}
        for index, j in sorted(jobs.items()):
            if index not in listed:  # not announced yet, or draining
                rows.append({"index": index, "host": None, "healthy": False, **j})
        return {"name": name, "controller": s.controller if s else self.gossip.me,
                "autoscale": self._autoscale_view(name, rows) if spec is not None else None,
                "access": s.claim.access if s else spec.access if spec else None,
                "health": s.claim.health if s else spec.health if spec else None,
                "replicas_wanted": spec.replicas if spec else None, "generation": spec.generation if spec else None,
                "orphaned": bool(s and s.orphaned), "contenders": list(s.contenders) if s else [],
                "replicas": sorted(rows, key=lambda r: r["index"]),
                "gateway": {k: stats.get(k) for k in ("requests", "failures", "in_flight", "p50_ms", "p99_ms",
                                                       "rate_per_s")} if stats else None}

    def _autoscale_view(self, name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """`serve show`'s autoscaling part: the policy, the demand and where it enters, the
        scaler's last decision and history, the replicas' start time, the scaling events."""
        spec, c = self.specs[name], self.controllers[name]
        demand, scaler, decision = self.demand.get(name), self.scalers.get(name), self.decisions.get(name)
        points = demand.points if demand is not None else ()
        for row in rows:
            if row.get("host"):
                row["demand_rtt_ms"] = round(self._demand_rtt(row["host"], points), 1) if points else None
        return {"policy": spec.autoscale, "replicas": c.replicas, "start_s": round(c.start_s, 1),
                "measured_starts": len(c.start_times),
                "demand": None if demand is None else {
                    "rate_per_s": round(demand.rate, 2), "in_flight": round(demand.in_flight, 2),
                    "p99_ms": demand.p99_ms, "latency_ms": demand.latency_ms, "members": demand.reporters,
                    "points": [[peer, round(w, 2)] for peer, w in demand.points]},
                "decision": None if decision is None else {
                    "replicas": decision.replicas, "reason": decision.reason, "mode": decision.mode,
                    "forecast_rate": decision.forecast_rate, "planned": decision.planned},
                "scaler": None if scaler is None else scaler.view(time.time()),
                "events": list(self.events.get(name, ()))}

    def replica_job(self, name: str, index: int, owner: int, admin: bool) -> str:
        self.own(name, owner, admin)
        slot = self.controllers[name].slots.get(index)
        if slot is None or slot.job is None:
            raise ServeError(f"{name} has no replica {index} running")
        return slot.job

    def routes(self, stats: Any) -> dict[str, Any]:
        """``serve.gateway``: the gateway's statistics in, its routing table out."""
        if isinstance(stats, dict):
            self.gateway["stats"], self.gateway["seen"] = stats, time.time()
            self.local_demand.observe(time.time(), stats)
        table: Table = self.registry.table
        services = {}
        for name, s in table.services.items():
            replicas = []
            for r in s.replicas:
                local = r.host == self.gossip.me
                if not local and r.address is None:
                    continue
                replicas.append({"key": r.key, "host": r.host, "address": "127.0.0.1" if local else r.address,
                                 "port": r.port, "rtt_ms": 0.0 if local else self.rtt(r.host), "healthy": r.healthy,
                                 "health": s.claim.health})
            services[name] = {"access": s.claim.access, "replicas": replicas,
                              "token_sha256": s.claim.token_sha256.hex() if s.claim.token_sha256 else None}
        return {"services": services}

    def status(self) -> dict[str, Any]:
        return {"controlled": sorted(self.specs), "replicas_here": len(self._entries),
                "registry": len(self.registry.table.services), "unassigned": self.registry.table.unassigned,
                "gateway": {k: v for k, v in self.gateway.items() if k != "stats"} | {
                    "listen": (self.gateway["stats"].get("gateway") or {}).get("listen") or self.gateway_listen}}

    # --- running --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._control)
            nursery.start_soon(self._check_health)
            if self.gateway_listen is not None:
                nursery.start_soon(self._supervise_gateway)
            task_status.started()

    async def _control(self) -> None:
        while True:
            try:
                self.step(time.time())
            except Exception:  # one bad round must not end the services: logged, tried again
                log.exception("services: a control round failed")
            await trio.sleep(STEP_S)

    async def _check_health(self) -> None:
        while True:
            serving = dict(getattr(self.jobs.worker, "serving", {}))
            results: dict[tuple[str, str], bool] = {}

            async def check(key: tuple[str, str], port: int, path: str) -> None:
                results[key] = await http_ok(port, path)

            async with trio.open_nursery() as nursery:
                for key, s in serving.items():
                    nursery.start_soon(check, key, s.port, s.serve.health)
            changed = results != self.health
            self.health = results
            if changed:
                self._publish()
            await trio.sleep(HEALTH_S)

    async def _supervise_gateway(self) -> None:
        """The gateway process, started again after it exits (a crash: after a pause)."""
        assert self.gateway_listen is not None
        argv = [sys.executable, "-m", "swarmd.serve.gateway", "--listen", self.gateway_listen,
                "--daemon-socket", str(self.socket_path), "--parent", str(os.getpid())]
        while True:
            try:
                async with trio.open_nursery() as nursery:
                    proc = await nursery.start(lambda task_status: trio.run_process(
                        argv, check=False, stdin=subprocess.DEVNULL, task_status=task_status))
                    self.gateway.update(state="running", pid=proc.pid)
                    await proc.wait()
                    code = proc.returncode
            except OSError as exc:
                code = None
                log.error("the gateway cannot start", error=str(exc))
            self.gateway.update(state=f"exited ({code})", pid=None, restarts=self.gateway["restarts"] + 1)
            log.warning("the gateway exited; starting it again", code=code, after_s=GATEWAY_RESTART_S)
            await trio.sleep(GATEWAY_RESTART_S)

    # --- on disk ----------------------------------------------------------------------------

    def _save(self, name: str) -> None:
        spec, c = self.specs[name], self.controllers[name]
        body = {"spec": spec.to_json(), "slots": [s.to_json() for s in c.slots.values()],
                "start_times": c.start_times}
        if (scaler := self.scalers.get(name)) is not None:
            body["scaler"] = scaler.to_json()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomically(self.dir / f"{name}.json", json.dumps(body, sort_keys=True).encode())

    def _load(self) -> None:
        """The services this node controls, as left on disk; a file that does not read back is
        set aside (renamed *.bad) and logged, never a reason not to start."""
        if not self.dir.is_dir():
            return
        for path in sorted(self.dir.glob("*.json"))[:MAX_CLAIMS]:
            try:
                if path.stat().st_size > 1 << 20:
                    raise ValueError("over 1 MiB")
                body = json.loads(path.read_text())
                data = body["spec"]
                spec = check_spec(data, owner=int(data["owner"]), now=time.time())
                if path.stem != spec.name:
                    raise ValueError(f"holds service {spec.name}")
                slots = [Slot.from_json(s) for s in body.get("slots", [])][:MAX_ASSIGNED * 2]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("a service's file does not read back: set aside", file=str(path), error=str(exc))
                os.replace(path, path.with_suffix(".bad"))
                continue
            self.specs[spec.name] = spec
            starts = body.get("start_times")
            starts = [float(t) for t in starts[-5:] if isinstance(t, (int, float)) and not isinstance(t, bool)
                      and 0 <= t < 86_400] if isinstance(starts, list) else []
            self.controllers[spec.name] = Controller(replicas=spec.replicas, generation=spec.generation,
                                                     slots={s.index: s for s in slots}, start_times=starts)
            self._set_scaler(spec, body.get("scaler"))  # from_json survives anything left there


def _has_slot(member: Any) -> bool:
    """Whether a member's record offers a free job slot (a host a replica could move to)."""
    jobs = getattr(member.record, "jobs", None)
    return jobs is not None and getattr(jobs, "free", 0) > 0


async def http_ok(port: int, path: str, *, host: str = "127.0.0.1", timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """A GET of `path` at host:port answered 2xx or 3xx within `timeout`."""
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            return False
        async with stream:
            try:
                await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                                      "User-Agent: swarmd-health\r\nConnection: close\r\n\r\n".encode())
                head = b""
                while b"\r\n" not in head and len(head) < 1024:
                    chunk = await stream.receive_some(1024)
                    if not chunk:
                        break
                    head += chunk
            except (OSError, trio.BrokenResourceError):
                return False
        parts = head.split(b"\r\n", 1)[0].split()
        return len(parts) >= 2 and parts[0].startswith(b"HTTP/1.") and parts[1][:1] in (b"2", b"3")
    return False

