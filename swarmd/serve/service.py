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

A service belongs to the local user who deployed it (their uid, as jobs are); the replicas'
jobs are that user's jobs.
"""

from __future__ import annotations

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
from ..compute.spec import MAX_RESTARTS, JobSpec, Serve, SpecError
from ..gossip.registry import (ACCESS, MAX_ASSIGNED, MAX_CLAIMS, MAX_REPLICAS, ReplicaEntry, ServiceClaim,
                               check_health, check_name)
from ..p2p.signed import Invalid
from .control import Controller, Observed, Slot, StartReplica, StopReplica
from .registry import Registry, Table

log = structlog.get_logger("swarmd.serve")

STEP_S = 0.5  # controllers' period
HEALTH_S = 2.0  # replicas' health checks
HEALTH_TIMEOUT_S = 2.0
GATEWAY_RESTART_S = 2.0  # after the gateway process exits, before it is started again
REPLICA_WAIT_S = 86_400.0  # a replica waits this long for a host that fits before its job fails
TEMPLATE_FIELDS = ("cmd", "env", "cpus", "mem", "gpus_per_node", "labels", "hosts", "python")


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

    def job_spec(self, index: int) -> JobSpec:
        fields = {**self.template, "name": f"{self.name}-{index}", "nodes": 1, "max_restarts": MAX_RESTARTS,
                  "wait": REPLICA_WAIT_S, "serve": {"service": self.name, "replica": index, "health": self.health}}
        return JobSpec.from_wire(fields)

    def claim(self, assigned: tuple[tuple[int, str], ...]) -> ServiceClaim:
        return ServiceClaim(name=self.name, created=self.created, access=self.access,
                            token_sha256=bytes.fromhex(self.token_sha256) if self.token_sha256 else None,
                            health=self.health, assigned=assigned)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "replicas": self.replicas, "template": self.template, "workdir": self.workdir,
                "health": self.health, "access": self.access, "token_sha256": self.token_sha256,
                "owner": self.owner, "created": self.created, "generation": self.generation}


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
    spec = ServiceSpec(name=name, replicas=replicas, template=dict(template), workdir=workdir, health=health,
                       access=access, token_sha256=token, owner=owner, created=float(created), generation=generation)
    try:
        spec.job_spec(0)
    except SpecError as exc:
        raise ServeError(str(exc).removeprefix("spec: ")) from None
    return spec


@dataclass(slots=True)
class _Own:
    """The own record as a member of the view: the registry reads it like any other."""
    peer: str
    record: Any
    in_service: bool = True


class Services:
    def __init__(self, *, jobs: Any, gossip: Any, state_dir: Path, rtt: Callable[[str], float | None],
                 path: Callable[[str], str | None], gateway_listen: str | None, socket_path: Path) -> None:
        self.jobs, self.gossip = jobs, gossip
        self.rtt, self.path = rtt, path  # routing's RTT and path kind from this node to a host
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
        self._load()

    # --- what goes into this node's record ----------------------------------------------

    def serve_info(self) -> dict[str, Any]:
        return {"services": self._claims, "replicas": self._entries}

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
        if (claims, entries) != (self._claims, self._entries):
            self._claims, self._entries = claims, entries
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
        self.registry.update(now, self._members())
        observed = self._observed()
        for name in list(self.controllers):
            try:
                self._step_one(name, now, observed)
            except Exception:
                log.exception("a service's control round failed", service=name)
        self._publish()

    def _step_one(self, name: str, now: float, observed: Mapping[str, Observed]) -> None:
        c, spec = self.controllers[name], self.specs[name]
        for action in c.step(now, observed):
            match action:
                case StartReplica(index=index):
                    try:
                        job = self.jobs.submit(spec.job_spec(index), spec.workdir, spec.owner)
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
        elif len(self.specs) >= MAX_CLAIMS:
            raise ServeError(f"this node controls {MAX_CLAIMS} services already")
        if (taken := self.registry.table.get(spec.name)) is not None and taken.controller != self.gossip.me:
            raise ServeError(f"the name {spec.name} is taken: another member ({taken.controller}) controls it")
        c = self.controllers.get(spec.name) or Controller(replicas=spec.replicas, generation=spec.generation)
        c.replicas, c.generation = spec.replicas, spec.generation
        self.specs[spec.name], self.controllers[spec.name] = spec, c
        self._save(spec.name)
        log.info("service up", service=spec.name, replicas=spec.replicas, generation=spec.generation)
        return {"name": spec.name, "replicas": spec.replicas, "generation": spec.generation,
                "rolling": before is not None and spec.generation != before.generation}

    def scale(self, name: str, replicas: int, owner: int, admin: bool) -> dict[str, Any]:
        spec = self.own(name, owner, admin)
        if isinstance(replicas, bool) or not 0 <= replicas <= MAX_ASSIGNED:
            raise ServeError(f"replicas: must be 0-{MAX_ASSIGNED}")
        self.specs[name] = ServiceSpec(**{**spec.to_json(), "replicas": replicas})
        self.controllers[name].replicas = replicas
        self._save(name)
        return {"name": name, "replicas": replicas}

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
                "access": s.claim.access if s else spec.access if spec else None,
                "health": s.claim.health if s else spec.health if spec else None,
                "replicas_wanted": spec.replicas if spec else None, "generation": spec.generation if spec else None,
                "orphaned": bool(s and s.orphaned), "contenders": list(s.contenders) if s else [],
                "replicas": sorted(rows, key=lambda r: r["index"]),
                "gateway": {k: stats.get(k) for k in ("requests", "failures", "in_flight", "p50_ms", "p99_ms",
                                                       "rate_per_s")} if stats else None}

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
        body = {"spec": spec.to_json(), "slots": [s.to_json() for s in c.slots.values()]}
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
            self.controllers[spec.name] = Controller(replicas=spec.replicas, generation=spec.generation,
                                                     slots={s.index: s for s in slots})


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

