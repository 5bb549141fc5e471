"""The control socket's job methods: upload a workdir, run, list, show, follow logs, cancel, forward a port.

A job belongs to the uid that submitted it (its SO_PEERCRED uid, stored as `submitted_by`):
members of the daemon's group run jobs and list, read and cancel only their own; root and the
daemon's user see and act on every job (`rpc.protocol.Access`, `check_owner`).

A workdir travels from swarmctl in chunks (`jobs.upload`) into the uploading user's own
`.part` file, is checked against its sha256 (read from disk in chunks, never whole into
memory), kept as an archive here (the coordinator ships it on) and unpacked into the
cache. A user has at most `MAX_PARTS_PER_UID` unfinished uploads: starting one more drops
that user's least recently written part (another user's are never touched).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..rpc.protocol import Access, Caller, ErrorCode, Method, Param, RpcError, Takeover, check_owner
from .coordinator.hosts import HostError
from .forward import StreamEnd, pipe
from .spec import JobSpec, SpecError
from .workdir import DEFAULT_LIMIT, WorkdirError

if TYPE_CHECKING:
    from .coordinator.coordinator import Jobs
    from .coordinator.store import JobRow

DIGEST = re.compile(r"^[0-9a-f]{64}$")
MAX_CHUNK = 8 * 1024 * 1024
MAX_PARTS_PER_UID = 4  # unfinished uploads of one user (each up to DEFAULT_LIMIT on disk)


def _make_room(archives: Path, uid: int, keep: int) -> None:
    """Drop `uid`'s least recently written parts beyond `keep`."""
    parts = sorted(archives.glob(f"*.{uid}.part"), key=lambda p: p.lstat().st_mtime_ns, reverse=True)
    for old in parts[keep:]:
        old.unlink(missing_ok=True)


def methods(get_jobs: Any) -> list[Method]:
    def jobs_or_error(method: str) -> Jobs:
        jobs = get_jobs()
        if jobs is None:
            raise RpcError(ErrorCode.OPERATION_FAILED, f"{method}: this node is in no swarm (swarmctl swarm init or join)")
        return jobs

    def digest_of(params: dict[str, Any], method: str) -> str:
        digest = params["digest"]
        if not DIGEST.match(digest):
            raise RpcError(ErrorCode.INVALID_PARAMS, f"{method}: 'digest' must be a sha256 hex digest")
        return digest

    async def upload(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        jobs = jobs_or_error("jobs.upload")
        digest, offset, size, data = digest_of(params, "jobs.upload"), params["offset"], params["size"], params["data"]
        archive = jobs.archives / f"{digest}.tar.gz"
        if archive.exists():
            return {"have": True}
        if not 0 < size <= DEFAULT_LIMIT:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"jobs.upload: 'size' must be 1-{DEFAULT_LIMIT} bytes")
        if len(data) > MAX_CHUNK:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"jobs.upload: chunks of at most {MAX_CHUNK} bytes")
        part = jobs.archives / f"{digest}.{caller.uid}.part"  # each user's own: no one appends to another's
        have = part.stat().st_size if part.exists() else 0
        if offset != have or offset + len(data) > size:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"jobs.upload: offset {offset} does not follow the "
                                                     f"{have} bytes received")
        if not have:
            _make_room(jobs.archives, caller.uid, keep=MAX_PARTS_PER_UID - 1)
        with open(part, "ab") as f:
            f.write(data)
        if offset + len(data) < size:
            return {"have": False, "received": offset + len(data)}
        try:  # hashed and unpacked from the file, in chunks
            await trio.to_thread.run_sync(jobs.worker.cache.put_file, digest, part)
        except WorkdirError as exc:  # a mismatch, a hostile or broken archive: refused, the upload dropped
            part.unlink()
            raise RpcError(ErrorCode.INVALID_PARAMS, f"jobs.upload: {exc}") from None
        part.rename(archive)
        return {"have": True}

    async def run(params: dict[str, Any], caller: Caller) -> AsyncIterator[dict[str, Any]]:
        jobs = jobs_or_error("jobs.run")
        try:
            spec = JobSpec.from_wire(params["spec"])
        except SpecError as exc:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"jobs.run: {exc}") from None
        if spec.serve is not None:
            raise RpcError(ErrorCode.INVALID_PARAMS, "jobs.run: 'serve' is set by a service's controller "
                                                     "(swarmctl serve up), not by a job")
        workdir = params.get("workdir")
        if workdir is not None:
            workdir = digest_of(params | {"digest": workdir}, "jobs.run")
            if not (jobs.archives / f"{workdir}.tar.gz").exists():
                raise RpcError(ErrorCode.INVALID_PARAMS, "jobs.run: the workdir was not uploaded (jobs.upload)")
        job = jobs.submit(spec, workdir, caller.uid)
        yield {"submitted": job}
        if not params.get("detach"):
            async for event in jobs.watch(job, progress=True, output=True):
                yield event

    def own_job(params: dict[str, Any], method: str, jobs: Jobs, caller: Caller) -> JobRow:
        """The job `params["id"]` names, if the caller may act on it. A prefix looks among the
        caller's own jobs only (another user's can neither match nor make it ambiguous)."""
        mine = None if caller.access >= Access.ADMIN else caller.uid
        try:
            row = jobs.store.get(params["id"], submitted_by=mine)
        except ValueError as exc:  # an ambiguous prefix
            raise RpcError(ErrorCode.INVALID_PARAMS, f"{method}: {exc}") from None
        if row is None:
            raise RpcError(ErrorCode.OPERATION_FAILED, f"{method}: no job {params['id']!r}")
        check_owner(caller, method, f"job {row.id}", row.submitted_by)
        return row

    async def ls(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        jobs = jobs_or_error("jobs.ls")
        mine = None if caller.access >= Access.ADMIN else caller.uid
        return {"jobs": [jobs.describe(row) for row in jobs.store.list(params.get("limit", 50), submitted_by=mine)]}

    async def show(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        jobs = jobs_or_error("jobs.show")
        return jobs.describe(own_job(params, "jobs.show", jobs, caller))

    async def logs(params: dict[str, Any], caller: Caller) -> AsyncIterator[dict[str, Any]]:
        jobs = jobs_or_error("jobs.logs")
        job = own_job(params, "jobs.logs", jobs, caller).id
        async for event in jobs.watch(job, progress=False, output=True, rank=params.get("rank"),
                                      follow=bool(params.get("follow"))):
            yield event

    async def cancel(params: dict[str, Any], caller: Caller) -> dict[str, Any]:
        jobs = jobs_or_error("jobs.cancel")
        job = own_job(params, "jobs.cancel", jobs, caller).id
        return {"id": job, "state": jobs.cancel(job)}

    async def forward(params: dict[str, Any], caller: Caller) -> dict[str, Any] | Takeover:
        jobs = jobs_or_error("jobs.forward")
        job = own_job(params, "jobs.forward", jobs, caller).id
        port = params["port"]
        if not 1 <= port <= 65535:
            raise RpcError(ErrorCode.INVALID_PARAMS, "jobs.forward: 'port' must be 1-65535")
        try:
            peer, address, host = jobs.head(job)
        except HostError as exc:
            raise RpcError(ErrorCode.OPERATION_FAILED, f"jobs.forward: {exc}") from None
        where = {"id": job, "peer": peer, "address": address, "port": port}
        if params.get("check"):
            return where
        stack = contextlib.AsyncExitStack()
        try:
            end, stop = await stack.enter_async_context(host.forward(job, port))
        except HostError as exc:
            await stack.aclose()
            raise RpcError(ErrorCode.OPERATION_FAILED, f"jobs.forward: {exc}") from None

        async def run(stream: trio.SocketStream, leftover: bytes) -> None:
            await pipe(StreamEnd(stream, leftover), end, stop=stop)

        return Takeover(result=where, run=run, close=stack.aclose)

    return [
        Method(name="jobs.upload", handler=upload, access=Access.JOBS, doc="send a packed workdir, in chunks",
               params={"digest": Param(type=str, required=True, doc="sha256 of the whole archive"),
                       "offset": Param(type=int, required=True, doc="where this chunk starts"),
                       "size": Param(type=int, required=True, doc="bytes of the whole archive"),
                       "data": Param(type=bytes, required=True, doc="the chunk")}),
        Method(name="jobs.run", handler=run, access=Access.JOBS, streams=True,
               doc="run a job: its id, then progress and output until it ends (unless detached)",
               params={"spec": Param(type=dict, required=True, doc="the job spec"),
                       "workdir": Param(type=str, doc="digest of an uploaded workdir"),
                       "detach": Param(type=bool, doc="return once submitted")}),
        Method(name="jobs.ls", handler=ls, access=Access.JOBS,
               doc="jobs coordinated by this node, newest first: the caller's own (every job for root and the daemon's user)",
               params={"limit": Param(type=int, doc="at most this many (default 50)")}),
        Method(name="jobs.show", handler=show, access=Access.JOBS, doc="one job: state, nodes, ranks, exit code, why",
               params={"id": Param(type=str, required=True, doc="job id or a unique prefix")}),
        Method(name="jobs.logs", handler=logs, access=Access.JOBS, streams=True, doc="a job's output, merged or of one rank",
               params={"id": Param(type=str, required=True, doc="job id or a unique prefix"),
                       "rank": Param(type=int, doc="only this rank"),
                       "follow": Param(type=bool, doc="keep streaming until the job ends")}),
        Method(name="jobs.cancel", handler=cancel, access=Access.JOBS, doc="stop a job: SIGTERM, then SIGKILL",
               params={"id": Param(type=str, required=True, doc="job id or a unique prefix")}),
        Method(name="jobs.forward", handler=forward, access=Access.JOBS, takeover=True,
               doc="a TCP connection to `port` on the running job's first host: after the answer ({id, peer, "
                   "address, port}) this connection is a byte pipe to it (`check`: only the answer)",
               params={"id": Param(type=str, required=True, doc="job id or a unique prefix"),
                       "port": Param(type=int, required=True, doc="the TCP port on the job's first host"),
                       "check": Param(type=bool, doc="only say where the forward would go")}),
    ]
