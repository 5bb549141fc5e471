"""The Python client: what `swarmctl` does, for notebooks and scripts (issue 31).

    from swarmd.client import Swarm

    swarm = Swarm()  # the local daemon's control socket ($SWARMD_SOCKET, as swarmctl finds it)
    job = swarm.run(["python", "train.py"], workdir="./project", nodes="2:3", max_restarts=2)
    for line in swarm.logs(job, follow=True):
        print(line.rank, line.text)
    swarm.cancel(job)

Everything goes over the control socket as the calling process's own uid, so the daemon's
rules are the CLI's: anyone who can open the socket reads, a member of the daemon's group
runs jobs and manages only its own. The errors are the CLI's too: `DaemonUnreachable`
(nothing answers on the socket), `RemoteError` (the daemon refused the call or the operation
failed: `.code`, `.message`, the words `swarmctl` prints), `SpecError` (a job or service spec
that does not build, raised before anything is sent) and `WorkdirError` (a workdir that
cannot be packed).

A call is one request on one connection, opened for it (a `Swarm` holds no socket, so it is
safe to keep in a notebook across daemon restarts); `logs(follow=True)` holds its own until
the job ends or the iterator is closed. Results are typed where a script reads fields
(`Job`, `Member`, `LogLine`, `Service`), each keeping the daemon's whole reply in `.raw`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .compute.spec import SpecError, build
from .compute.workdir import Packed, WorkdirError, pack
from .paths import client_socket
from .rpc.client import Client, DaemonUnreachable, RemoteError

__all__ = ["DaemonUnreachable", "Job", "LogLine", "Member", "RemoteError", "Service", "SpecError", "Swarm",
           "WorkdirError"]

UPLOAD_CHUNK = 4 << 20  # bytes of a packed workdir per `jobs.upload` call (the daemon takes up to 8 MiB)


@dataclass(frozen=True)
class Member:
    """A member of the swarm as this node sees it (`swarmctl peers`)."""

    peer: str
    state: str  # alive, suspect, dead, left
    rtt_ms: float | None
    labels: dict[str, str]
    summary: str  # its capacity in words: "2 GPUs, 16 cores, 64 GB"
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Member:
        return cls(peer=d["peer"], state=d["state"], rtt_ms=d.get("rtt_ms"), labels=dict(d.get("labels") or {}),
                   summary=d.get("summary") or "", raw=dict(d))


@dataclass(frozen=True)
class Job:
    """A job this caller may see (`swarmctl jobs ls` / `show`)."""

    id: str
    name: str | None
    state: str  # placing, reserving, shipping, starting, running, restarting, succeeded, failed, cancelled
    nodes: tuple[str, ...]
    exit_code: int | None
    reason: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def over(self) -> bool:
        return self.state in ("succeeded", "failed", "cancelled")

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Job:
        return cls(id=d["id"], name=d.get("name"), state=d["state"], nodes=tuple(d.get("nodes") or ()),
                   exit_code=d.get("exit_code"), reason=d.get("reason"), raw=dict(d))


@dataclass(frozen=True)
class LogLine:
    """One line a rank wrote (without its newline), as the job's output keeps it."""

    rank: int
    text: str


@dataclass(frozen=True)
class Service:
    """A service this node knows of (`swarmctl serve ls`)."""

    name: str
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Service:
        return cls(name=d["name"], raw=dict(d))


def send_workdir(c: Client, packed: Packed) -> None:
    """Upload a packed workdir in chunks (swarmctl's and ``Swarm.upload``'s), stopping as soon as the
    daemon says it has that digest (uploaded before, or by another of this user's runs)."""
    for offset in range(0, len(packed.data), UPLOAD_CHUNK):
        reply = c.call("jobs.upload", digest=packed.digest, offset=offset, size=len(packed.data),
                       data=packed.data[offset:offset + UPLOAD_CHUNK])
        if reply.get("have"):
            return


class Swarm:
    """The local daemon, over its control socket. ``socket``: its path (default: where
    `swarmctl` looks); ``timeout``: seconds a call may wait for the daemon's answer."""

    def __init__(self, socket: str | os.PathLike[str] | None = None, *, timeout: float = 30.0) -> None:
        self.socket = str(socket) if socket is not None else str(client_socket())
        self.timeout = timeout

    def _client(self, timeout: float | None = None) -> Client:
        return Client(self.socket, timeout=self.timeout if timeout is None else timeout)

    def call(self, method: str, **params: Any) -> Any:
        """Any method of the control API (`swarmctl` lists them), its result as the daemon sends it."""
        with self._client() as c:
            return c.call(method, **params)

    # --- reading ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def peers(self) -> list[Member]:
        return [Member.from_wire(p) for p in self.call("peers")["peers"]]

    def jobs(self, limit: int = 50) -> list[Job]:
        return [Job.from_wire(j) for j in self.call("jobs.ls", limit=limit)["jobs"]]

    def job(self, job: str) -> Job:
        return Job.from_wire(self.call("jobs.show", id=job))

    def logs(self, job: str, *, follow: bool = False, rank: int | None = None) -> Iterator[LogLine]:
        """The job's output from its first line; with ``follow``, then each line as it comes
        until the job ends."""
        params: dict[str, Any] = {"id": job, "follow": follow}
        if rank is not None:
            params["rank"] = rank
        with self._client(timeout=None if follow else self.timeout) as c:
            for event in c.stream("jobs.logs", **params):
                for r, text in event.get("out", ()):
                    yield LogLine(rank=int(r), text=text)

    def services(self) -> list[Service]:
        return [Service.from_wire(s) for s in self.call("serve.ls")["services"]]

    # --- acting -----------------------------------------------------------------------

    def run(self, cmd: Sequence[str], *, workdir: str | os.PathLike[str] | None = None, **spec: Any) -> str:
        """Submit a job and return its id at once (it runs detached: `logs(id, follow=True)`
        follows it). ``spec``: the fields of a job spec as `swarmctl jobs run` takes them
        (``nodes=2`` or ``"2:3"``, ``max_restarts``, ``gpus_per_node``, ``procs_per_node``,
        ``cpus``, ``mem="4G"``, ``env={...}``, ``labels={...}``, ``hosts=[...]``, ``wait="10m"``,
        ``name``, ``ray``, ``grow``, ``groups``, ``python``). SpecError before anything is sent."""
        wire = build({}, {**spec, "cmd": list(cmd), "workdir": None if workdir is None else str(workdir)}).to_wire()
        params: dict[str, Any] = {"spec": wire, "detach": True}
        if workdir is not None:
            params["workdir"] = self.upload(workdir)
        with self._client() as c:
            for event in c.stream("jobs.run", **params):
                if "submitted" in event:
                    return str(event["submitted"])
        raise RemoteError(0, "jobs.run: the daemon ended the call without naming the job")

    def upload(self, workdir: str | os.PathLike[str]) -> str:
        """Pack ``workdir`` here (the daemon may not be able to read it) and upload it; its digest."""
        packed = pack(Path(workdir))
        with self._client() as c:
            send_workdir(c, packed)
        return packed.digest

    def cancel(self, job: str) -> Job:
        """Cancel one of the caller's jobs; what the daemon says of it now."""
        self.call("jobs.cancel", id=job)
        return self.job(job)

    def serve(self, name: str, cmd: Sequence[str], *, replicas: int = 1, workdir: str | os.PathLike[str] | None = None,
              health: str | None = None, access: str | None = None, autoscale: Mapping[str, Any] | None = None,
              **template: Any) -> dict[str, Any]:
        """Deploy a service, or roll a change out (`swarmctl serve up`): each replica runs ``cmd``
        (listening on $PORT) with ``template``'s job fields (``env``, ``cpus``, ``mem``,
        ``gpus_per_node``, ``labels``, ``hosts``, ``python``)."""
        params: dict[str, Any] = {"name": name, "replicas": replicas, "template": {"cmd": list(cmd), **template}}
        if workdir is not None:
            params["workdir"] = self.upload(workdir)
        for key, value in (("health", health), ("access", access), ("autoscale", autoscale)):
            if value is not None:
                params[key] = dict(value) if key == "autoscale" else value
        return self.call("serve.up", **params)
