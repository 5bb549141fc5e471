"""The job protocol over libp2p (trio): a host's handler, and the coordinator's proxies.

`/swarmd/job/1.0.0`: one stream per request. The first frame is ``{op, cert, job, …}``;
the requester's certificate is checked against the peer id Noise authenticated before
anything else, then the host's submitter allowlist. Ops:
- ``reserve {gpus, lease}`` → ``{gpus}`` | ``{error}``; ``commit {port}`` → ``{gpus, port?}``;
  ``release`` → ``{}``; ``cancel`` → ``{found}``;
- ``workdir {digest, size}`` → ``{have}``; when not had, the requester sends ``{data}``
  chunks and ``{end}``, and the host answers ``{}`` once the tree is unpacked and verified;
- ``start {role, cmd, env, python, workdir}`` → the worker's events, one frame each, until
  ``{exit}``. The stream breaking either way ends the job on that host.

`LocalHost` and `RemoteHost` give the coordinator one interface to its own worker and to
a peer's.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

import structlog
import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from ..gossip.streams import MAX_SYNC_FRAME, PeerError, close_quietly, read_frame, write_frame
from ..rpc.framing import FrameTooLarge
from .executor import ExecutorError, free_port
from .ledger import Grant, Refusal
from .torchenv import NodeRole
from .worker import StartRequest, Worker, WorkerError
from .workdir import DEFAULT_LIMIT, WorkdirError

log = structlog.get_logger("swarmd.jobs")

JOB_PROTOCOL = "/swarmd/job/1.0.0"
CHUNK = 1024 * 1024
REQUEST_TIMEOUT = 10.0
MAX_LEASE = 300.0
MAX_NODES = 1024  # as a job spec allows
MAX_PROCS_PER_NODE = 256
Emit = Callable[[dict[str, Any]], Awaitable[None]]


class HostError(Exception):
    """A host refused or could not be reached; the message says which and why."""


# --- the host's side ----------------------------------------------------------------------

class JobHandler:
    def __init__(self, worker: Worker, *, check_member: Callable[[Any, ID, INetStream], Awaitable[bool]],
                 submitters: Collection[str], rejected: Callable[[str, str, str], None]) -> None:
        self.worker = worker
        self.check_member = check_member
        self.submitters = frozenset(submitters)
        self.rejected = rejected

    async def handle(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            with trio.move_on_after(REQUEST_TIMEOUT) as scope:
                req = await read_frame(stream, MAX_SYNC_FRAME)
            if scope.cancelled_caught or not await self.check_member(req, peer, stream):
                return
            coordinator = str(peer)
            if self.submitters and coordinator not in self.submitters:
                self.rejected("submitter", coordinator, "not in this host's job_submitters")
                await write_frame(stream, {"error": "this host takes jobs only from its allowed submitters"})
                return
            op, job = req.get("op"), req.get("job")
            try:
                if not isinstance(job, str) or not 1 <= len(job) <= 64:
                    raise ValueError("'job' must be a job id")
                await write_frame(stream, await self._op(op, job, coordinator, req, stream))
            except (ValueError, TypeError, KeyError) as exc:  # a malformed request
                self.rejected("malformed", coordinator, f"job request {op!r}: {exc}")
                await write_frame(stream, {"error": f"{op}: {exc}"})
            except (WorkerError, WorkdirError, ExecutorError) as exc:  # well-formed, and this host cannot
                await write_frame(stream, {"error": f"{op}: {exc}"})
        except FrameTooLarge as exc:
            self.rejected("too_large", str(peer), f"job request: {exc}")
        except PeerError as exc:
            self.rejected("malformed", str(peer), f"job request: {exc}")
        finally:
            await close_quietly(stream)

    async def _op(self, op: Any, job: str, coordinator: str, req: dict[str, Any], stream: INetStream) -> dict[str, Any]:
        w = self.worker
        match op:
            case "reserve":
                return _answer(w.reserve(job, coordinator, _uint(req, "gpus"), _lease(req.get("lease"))))
            case "commit":
                return _answer(w.commit(job, coordinator), port=bool(req.get("port")))
            case "release":
                w.release(job)
                return {}
            case "cancel":
                return {"found": w.cancel(job)}
            case "workdir":
                return await self._receive_workdir(req, stream)
            case "start":
                start = StartRequest(job=job, coordinator=coordinator, role=_role(req.get("role")),
                                     cmd=tuple(_strings(req.get("cmd"), "cmd")), env=_env(req.get("env")),
                                     python=req.get("python") if isinstance(req.get("python"), str) else None,
                                     workdir=req.get("workdir") if isinstance(req.get("workdir"), str) else None)
                await w.start(start, lambda event: write_frame(stream, event))
                return {"done": True}
            case _:
                raise ValueError(f"unknown op {op!r}")

    async def _receive_workdir(self, req: dict[str, Any], stream: INetStream) -> dict[str, Any]:
        digest, size = req.get("digest"), _uint(req, "size")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ValueError("'digest' must be a sha256 hex digest")
        cache = self.worker.cache
        if cache.has(digest):
            return {"have": True}
        if size > DEFAULT_LIMIT:
            raise ValueError(f"a workdir of {size} bytes is over the {DEFAULT_LIMIT} limit")
        await write_frame(stream, {"have": False})
        data = bytearray()
        while True:
            frame = await read_frame(stream, MAX_SYNC_FRAME)
            if not isinstance(frame, dict) or frame.get("end"):
                break
            chunk = frame.get("data")
            if not isinstance(chunk, bytes) or len(data) + len(chunk) > size:
                raise ValueError("workdir chunks do not add up to the announced size")
            data += chunk
        await trio.to_thread.run_sync(cache.put, digest, bytes(data))
        return {}


def _answer(answer: Grant | Refusal, *, port: bool = False) -> dict[str, Any]:
    if isinstance(answer, Refusal):
        return {"error": answer.reason}
    reply: dict[str, Any] = {"gpus": list(answer.gpus)}
    if port:
        reply["port"] = free_port()
    return reply


def _lease(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v <= MAX_LEASE:
        raise ValueError(f"'lease' must be 1-{MAX_LEASE:g} seconds")
    return float(v)


def _uint(req: dict[str, Any], name: str) -> int:
    v = req.get(name, 0)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**40:
        raise ValueError(f"'{name}' must be a non-negative integer")
    return v


def _strings(v: Any, name: str) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        raise ValueError(f"'{name}' must be a non-empty list of strings")
    return v


def _env(v: Any) -> dict[str, str]:
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise ValueError("'env' must map names to strings")
    return v


def _role(v: Any) -> NodeRole:
    """A node's part in a job, from a peer: every number in range (a member's request must
    not make this host start a thousand ranks), every address an IP."""
    if not isinstance(v, dict):
        raise ValueError("'role' must be a map")

    def integer(name: str, low: int, high: int) -> int:
        x = v.get(name)
        if isinstance(x, bool) or not isinstance(x, int) or not low <= x <= high:
            raise ValueError(f"'role.{name}' must be an integer from {low} to {high}")
        return x

    def ip(x: Any, name: str) -> str:
        try:
            return str(ipaddress.ip_address(x))
        except ValueError:
            raise ValueError(f"'role.{name}' must be an IP address") from None

    nnodes = integer("nnodes", 1, MAX_NODES)
    ips = v.get("node_ips")
    if not isinstance(ips, list) or len(ips) != nnodes:
        raise ValueError("'role.node_ips' must list one address per node")
    job = v.get("job_id")
    if not isinstance(job, str) or not 1 <= len(job) <= 64:
        raise ValueError("'role.job_id' must be a job id")
    return NodeRole(job_id=job, node_rank=integer("node_rank", 0, nnodes - 1), nnodes=nnodes,
                    procs_per_node=integer("procs_per_node", 1, MAX_PROCS_PER_NODE),
                    master_addr=ip(v.get("master_addr"), "master_addr"),
                    master_port=integer("master_port", 1, 65535), ifname=None, gpus=(),
                    node_ips=tuple(ip(x, "node_ips") for x in ips), checkpoint_dir="",
                    restart_count=integer("restart_count", 0, 1_000_000))


def role_to_wire(role: NodeRole) -> dict[str, Any]:
    return {k: (list(x) if isinstance(x, tuple) else x) for k, x in dataclasses.asdict(role).items()}


# --- the coordinator's side ---------------------------------------------------------------

class LocalHost:
    """The coordinator's own worker, called directly."""

    def __init__(self, peer: str, worker: Worker) -> None:
        self.peer = peer
        self.worker = worker

    async def reserve(self, job: str, gpus: int, lease: float) -> tuple[int, ...]:
        return _granted(self.peer, self.worker.reserve(job, self.peer, gpus, lease))

    async def commit(self, job: str, port: bool) -> tuple[tuple[int, ...], int | None]:
        gpus = _granted(self.peer, self.worker.commit(job, self.peer))
        return gpus, free_port() if port else None

    async def release(self, job: str) -> None:
        self.worker.release(job)

    async def ship(self, digest: str, archive: Path, progress: Callable[[int], None]) -> None:
        if not self.worker.cache.has(digest):
            data = await trio.Path(archive).read_bytes()
            try:
                await trio.to_thread.run_sync(self.worker.cache.put, digest, data)
            except WorkdirError as exc:
                raise HostError(f"{short(self.peer)}: {exc}") from None

    async def start(self, req: StartRequest, emit: Emit) -> None:
        try:
            await self.worker.start(req, emit)
        except (WorkerError, WorkdirError, ExecutorError) as exc:
            raise HostError(f"{short(self.peer)}: {exc}") from None

    async def cancel(self, job: str) -> None:
        self.worker.cancel(job)


class RemoteHost:
    """A peer's worker, over the job protocol."""

    def __init__(self, peer: str, host: IHost, cert: bytes) -> None:
        self.peer = peer
        self.host = host
        self.cert = cert

    async def _open(self, op: str, job: str, **fields: Any) -> INetStream:
        try:
            stream = await self.host.new_stream(ID.from_base58(self.peer), [JOB_PROTOCOL])
        except Exception as exc:
            raise HostError(f"{short(self.peer)}: cannot open a job stream ({exc.__class__.__name__})") from None
        try:
            await write_frame(stream, {"op": op, "job": job, "cert": self.cert, **fields})
        except PeerError as exc:
            await close_quietly(stream)
            raise HostError(f"{short(self.peer)}: {exc}") from None
        return stream

    async def _call(self, op: str, job: str, **fields: Any) -> dict[str, Any]:
        with trio.move_on_after(REQUEST_TIMEOUT) as scope:
            stream = await self._open(op, job, **fields)
            try:
                reply = await read_frame(stream, MAX_SYNC_FRAME)
            except PeerError as exc:
                raise HostError(f"{short(self.peer)}: {exc}") from None
            finally:
                await close_quietly(stream)
        if scope.cancelled_caught:
            raise HostError(f"{short(self.peer)}: no answer to {op} within {REQUEST_TIMEOUT:g} s")
        return _reply(self.peer, reply)

    async def reserve(self, job: str, gpus: int, lease: float) -> tuple[int, ...]:
        return tuple((await self._call("reserve", job, gpus=gpus, lease=lease))["gpus"])

    async def commit(self, job: str, port: bool) -> tuple[tuple[int, ...], int | None]:
        reply = await self._call("commit", job, port=port)
        return tuple(reply["gpus"]), reply.get("port")

    async def release(self, job: str) -> None:
        await self._call("release", job)

    async def cancel(self, job: str) -> None:
        await self._call("cancel", job)

    async def ship(self, digest: str, archive: Path, progress: Callable[[int], None]) -> None:
        data = await trio.Path(archive).read_bytes()
        stream = await self._open("workdir", "-", digest=digest, size=len(data))
        try:
            first = _reply(self.peer, await read_frame(stream, MAX_SYNC_FRAME))
            if first.get("have"):
                return
            for offset in range(0, len(data), CHUNK):
                await write_frame(stream, {"data": data[offset:offset + CHUNK]})
                progress(min(len(data), offset + CHUNK))
            await write_frame(stream, {"end": True})
            _reply(self.peer, await read_frame(stream, MAX_SYNC_FRAME))
        except PeerError as exc:
            raise HostError(f"{short(self.peer)}: shipping the workdir failed: {exc}") from None
        finally:
            await close_quietly(stream)

    async def start(self, req: StartRequest, emit: Emit) -> None:
        stream = await self._open("start", req.job, role=role_to_wire(req.role), cmd=list(req.cmd),
                                  env=req.env, python=req.python, workdir=req.workdir)
        try:
            while True:
                try:
                    event = _reply(self.peer, await read_frame(stream, MAX_SYNC_FRAME))
                except PeerError as exc:
                    raise HostError(f"{short(self.peer)}: {exc}") from None
                if event.get("done"):
                    return
                await emit(event)
        finally:
            await close_quietly(stream)


def _granted(peer: str, answer: Grant | Refusal) -> tuple[int, ...]:
    if isinstance(answer, Refusal):
        raise HostError(f"{short(peer)}: {answer.reason}")
    return answer.gpus


def _reply(peer: str, reply: Any) -> dict[str, Any]:
    if not isinstance(reply, dict):
        raise HostError(f"{short(peer)}: a malformed reply")
    if "error" in reply:
        raise HostError(f"{short(peer)}: {reply['error']}")
    return reply


def short(peer: str) -> str:
    return f"{peer[:6]}…{peer[-4:]}" if len(peer) > 12 else peer
