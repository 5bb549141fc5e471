"""The coordinator's side of the job protocol: one interface (`Host`) to its own worker
(`LocalHost`, called directly) and to a peer's (`RemoteHost`, over `/swarmd/job/2.0.0`,
host/service.py and messages.py). Whatever a peer does (a frame too large or unreadable, a
malformed reply, a stream that breaks or goes silent) and whatever this host's files do (a
checkpoint pruned before it is opened, a full disk) leaves their methods as one `HostError`
naming the host: the coordinator handles a host's failure in one place, never a stray
exception type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Protocol

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from ...p2p.signed import short
from ...p2p.streams import MAX_SMALL_FRAME, PeerError, close_quietly, read_frame, reset_quietly, write_frame
from ...p2p.transfer import CHUNK_TIMEOUT, TransferError, receive_chunks, send_chunks
from ...rpc.framing import FramingError
from .. import forward as fwd
from ..checkpoints.cache import CheckpointError
from ..host.executor import ExecutorError, free_port
from ..host.service import JOB_PROTOCOL, REQUEST_TIMEOUT, WORKDIR_TIMEOUT, open_forward, transfer_timeout
from ..host.worker import HEARTBEAT, Refused, StartRequest, Worker, WorkerError
from ..ledger import Grant, Refusal
from ..messages import CkptGet, CkptPut, Commit, Forward, Reserve, Start, Workdir
from ..succession import Charter
from ..workdir import WorkdirError

# forwards a coordinator opens to one host at once, until the host answered: a burst of local
# connections (a load generator) must not meet that host's cap on unchecked streams
FORWARD_OPENS_PER_HOST = 2
_forward_opens: dict[str, trio.Semaphore] = {}
MAX_EVENT_FRAME = 4 * 1024 * 1024  # an output batch (worker.OUTPUT_BATCH_BYTES) of lines up to 64 KiB, escaped
# The coordinator's patience with a host. Before "started" the host copies the job's
# workdir into its directory (up to workdir.UNPACKED_LIMIT); after it, an idle host sends a
# heartbeat every HEARTBEAT, so eight missed mean it is gone or stalling (a silently dead
# host of an elastic job is noticed this fast, or sooner by membership).
FIRST_EVENT_TIMEOUT = 300.0
EVENT_TIMEOUT = 8 * HEARTBEAT
SHIP_TIMEOUT = WORKDIR_TIMEOUT + 120.0  # the host's own upload limit, and time to unpack and answer
Emit = Callable[[dict[str, Any]], Awaitable[None]]
MAX_GPUS = 1024  # GPU indices a host's answer may name


class HostError(Exception):
    """A host refused or could not be reached; the message says which and why."""


@dataclasses.dataclass(slots=True)
class Authority:
    """On whose behalf this node commands a job's hosts: the job's origin (what hosts key its
    holds by), the epoch this node coordinates it at, and its charter once there is one
    (succession.py). Shared with the job's hosts, which read it at each request: the
    charter comes after the first placement."""

    origin: str
    epoch: int = 0
    charter: Charter | None = None

    def fields(self) -> dict[str, Any]:
        """What a request's first frame says of it (host/service.py's `_authorize`)."""
        out: dict[str, Any] = {"origin": self.origin, "epoch": self.epoch}
        if self.charter is not None:
            out["charter"] = self.charter.blob
        return out

class Host(Protocol):
    """A host of a job as its coordinator sees it: reserve, commit, ship, start or attach (its events
    until it is done), cancel, release, forward, and the job's checkpoints there. Every
    failure is a HostError naming `peer`."""

    peer: str

    async def reserve(self, job: str, gpus: int, ranks: int, lease: float) -> tuple[int, ...]: ...

    async def commit(self, job: str, port: bool) -> tuple[tuple[int, ...], int | None]: ...

    async def release(self, job: str) -> None: ...

    async def ship(self, job: str, digest: str, archive: Path, progress: Callable[[int], None]) -> None: ...

    async def start(self, req: StartRequest, emit: Emit) -> None: ...

    async def attach(self, job: str, emit: Emit) -> None: ...

    async def cancel(self, job: str) -> None: ...

    def forward(self, job: str, port: int) -> AbstractAsyncContextManager[tuple[fwd.End, trio.Event | None]]: ...

    async def put_checkpoint(self, job: str, name: str, sha: str, size: int, path: Path) -> None: ...

    async def get_checkpoint(self, job: str, sha: str, size: int, dest: Path) -> None: ...


class LocalHost:
    """The coordinator's own worker, called directly."""

    def __init__(self, peer: str, worker: Worker, authority: Authority | None = None) -> None:
        self.peer = peer
        self.worker = worker
        self.authority = authority or Authority(peer)

    def _key(self, job: str) -> str:
        """The job's origin, once this node's worker let it command the job (the same fence
        as a peer's request: a superseded coordinator is refused by its own host too)."""
        a = self.authority
        try:
            self.worker.authorize(job, self.peer, a.origin, a.epoch, a.charter)
        except Refused as exc:
            raise HostError(f"{short(self.peer)}: {exc}") from None
        return a.origin

    async def reserve(self, job: str, gpus: int, ranks: int, lease: float) -> tuple[int, ...]:
        return _granted(self.peer, self.worker.reserve(job, self._key(job), gpus, ranks, lease))

    async def commit(self, job: str, port: bool) -> tuple[tuple[int, ...], int | None]:
        gpus = _granted(self.peer, self.worker.commit(job, self._key(job)))
        return gpus, free_port() if port else None

    async def release(self, job: str) -> None:
        if isinstance(refusal := self.worker.release(job, self._key(job)), Refusal):
            raise HostError(f"{short(self.peer)}: {refusal.reason}")

    async def ship(self, job: str, digest: str, archive: Path, progress: Callable[[int], None]) -> None:
        with _host_errors(self.peer, "shipping the workdir"):
            origin = self._key(job)
            if not self.worker.cache.has(digest):
                data = await trio.Path(archive).read_bytes()
                await trio.to_thread.run_sync(self.worker.cache.put, digest, data)
            self.worker.pin(job, origin, digest)

    async def start(self, req: StartRequest, emit: Emit) -> None:
        try:
            self._key(req.job)
            await self.worker.start(dataclasses.replace(req, coordinator=self.authority.origin), emit)
        except (WorkerError, WorkdirError, ExecutorError, OSError) as exc:
            raise HostError(f"{short(self.peer)}: {_why(exc)}") from None

    async def attach(self, job: str, emit: Emit) -> None:
        """This node took the job over and runs some of its ranks itself: their events go to
        `emit` from now until they are done. HostError when none run here."""
        origin = self._key(job)

        async def hello(frame: dict[str, Any]) -> None:
            pass

        try:
            await self.worker.attach(job, origin, self.peer, emit, hello)
        except WorkerError as exc:
            raise HostError(f"{short(self.peer)}: {_why(exc)}") from None

    async def cancel(self, job: str) -> None:
        if isinstance(refusal := self.worker.cancel(job, self._key(job)), Refusal):
            raise HostError(f"{short(self.peer)}: {refusal.reason}")

    @contextlib.asynccontextmanager
    async def forward(self, job: str, port: int) -> AsyncIterator[tuple[fwd.End, trio.Event | None]]:
        """The job's listener on `port` here, by the same checks as a peer's request."""
        try:
            async with open_forward(self.worker, job, self._key(job), port) as (end, stop):
                yield end, stop
                return
        except (Refused, fwd.ForwardRefused, fwd.NothingListens) as exc:
            raise HostError(f"{short(self.peer)}: forward: {exc}") from None

    async def put_checkpoint(self, job: str, name: str, sha: str, size: int, path: Path) -> None:
        """The checkpoint at `path` into this host's cache of the job (the hub's own)."""
        with _host_errors(self.peer, f"putting checkpoint {sha[:12]}"):
            origin = self._key(job)
            if self.worker.checkpoint_path(job, origin, sha) is None:
                await self.worker.store_checkpoint(job, origin, sha, size, path)

    async def get_checkpoint(self, job: str, sha: str, size: int, dest: Path) -> None:
        """The cached checkpoint `sha` copied to `dest`; on any failure `dest` is removed."""
        with _host_errors(self.peer, f"getting checkpoint {sha[:12]}"):
            src = self.worker.checkpoint_path(job, self._key(job), sha)
            if src is None:
                raise HostError(f"{short(self.peer)}: checkpoint {sha[:12]} of job {job} is not on this host")

            def copy() -> None:
                try:
                    shutil.copyfile(src, dest, follow_symlinks=False)
                    if (got := os.stat(dest).st_size) != size:
                        raise HostError(f"{short(self.peer)}: checkpoint {sha[:12]} is {got} bytes here, not {size}")
                except BaseException:
                    dest.unlink(missing_ok=True)
                    raise

            await trio.to_thread.run_sync(copy)


class RemoteHost:
    """A peer's worker, over the job protocol."""

    def __init__(self, peer: str, host: IHost, cert: bytes, authority: Authority | None = None) -> None:
        self.peer = peer
        self.host = host
        self.cert = cert
        self.authority = authority  # None: this node's own job, at epoch 0 (the first frame says nothing)

    async def _open(self, op: str, job: str, **fields: Any) -> INetStream:
        try:
            stream = await self.host.new_stream(ID.from_base58(self.peer), [JOB_PROTOCOL])
        except Exception as exc:
            raise HostError(f"{short(self.peer)}: cannot open a job stream ({exc.__class__.__name__})") from None
        try:
            claim = self.authority.fields() if self.authority is not None else {}
            await write_frame(stream, {"op": op, "job": job, "cert": self.cert, **claim, **fields})
        except PeerError as exc:
            await close_quietly(stream)
            raise HostError(f"{short(self.peer)}: {exc}") from None
        return stream

    async def _call(self, op: str, job: str, **fields: Any) -> dict[str, Any]:
        with trio.move_on_after(REQUEST_TIMEOUT) as scope:
            stream = await self._open(op, job, **fields)
            try:
                with _host_errors(self.peer, op):
                    reply = await read_frame(stream, MAX_SMALL_FRAME)
            finally:
                await close_quietly(stream)
        if scope.cancelled_caught:
            raise HostError(f"{short(self.peer)}: no answer to {op} within {REQUEST_TIMEOUT:g} s")
        return _reply(self.peer, reply)

    async def reserve(self, job: str, gpus: int, ranks: int, lease: float) -> tuple[int, ...]:
        return _gpus(self.peer, await self._call(Reserve.OP, job, **Reserve(gpus, ranks, lease).to_wire()))

    async def commit(self, job: str, port: bool) -> tuple[tuple[int, ...], int | None]:
        reply = await self._call(Commit.OP, job, **Commit(port).to_wire())
        granted = reply.get("port")
        if port and not (isinstance(granted, int) and not isinstance(granted, bool) and 1 <= granted <= 65535):
            raise HostError(f"{short(self.peer)}: commit: 'port' must be 1-65535")
        return _gpus(self.peer, reply), granted if port else None

    async def release(self, job: str) -> None:
        await self._call("release", job)

    async def cancel(self, job: str) -> None:
        await self._call("cancel", job)

    @contextlib.asynccontextmanager
    async def forward(self, job: str, port: int) -> AsyncIterator[tuple[fwd.End, trio.Event | None]]:
        """A stream that is a byte pipe to the job's listener on `port` of the host, once the
        host said yes; HostError with its reason otherwise."""
        stream = None
        opens = _forward_opens.setdefault(self.peer, trio.Semaphore(FORWARD_OPENS_PER_HOST))
        with trio.move_on_after(REQUEST_TIMEOUT) as scope:
            async with opens:
                stream = await self._open(Forward.OP, job, **Forward(port).to_wire())
                try:
                    with _host_errors(self.peer, "forward"):
                        answer = await read_frame(stream, MAX_SMALL_FRAME)
                except BaseException:
                    await close_quietly(stream)
                    raise
        if scope.cancelled_caught:
            if stream is not None:
                await close_quietly(stream)
            raise HostError(f"{short(self.peer)}: no answer to forward within {REQUEST_TIMEOUT:g} s")
        try:
            if _reply(self.peer, answer).get("port") != port:
                raise HostError(f"{short(self.peer)}: forward: a malformed answer")
            yield fwd.NetEnd(stream), None
        finally:  # the pipe is over: both ends done, or one failed or idled (then the host must stop too)
            await reset_quietly(stream)

    async def put_checkpoint(self, job: str, name: str, sha: str, size: int, path: Path) -> None:
        """Send the checkpoint at `path` (its sha256 and size as given) unless the host has it;
        it needs a reservation of the job there. HostError naming the host otherwise."""
        with trio.move_on_after(REQUEST_TIMEOUT + transfer_timeout(size)) as scope:
            with _host_errors(self.peer, f"putting checkpoint {sha[:12]}"):
                await self._put_checkpoint(job, name, sha, size, path)
        if scope.cancelled_caught:
            raise HostError(f"{short(self.peer)}: checkpoint {sha[:12]} was not taken within "
                            f"{REQUEST_TIMEOUT + transfer_timeout(size):g} s")

    async def _put_checkpoint(self, job: str, name: str, sha: str, size: int, path: Path) -> None:
        stream = await self._open(CkptPut.OP, job, **CkptPut(name, sha, size).to_wire())
        try:
            with trio.move_on_after(REQUEST_TIMEOUT) as first:
                have = _reply(self.peer, await read_frame(stream, MAX_SMALL_FRAME))
            if first.cancelled_caught:
                raise HostError(f"{short(self.peer)}: no answer to ckpt_put within {REQUEST_TIMEOUT:g} s")
            if have.get("have"):
                return
            fd = await trio.to_thread.run_sync(os.open, path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                await send_chunks(stream, fd)
            finally:
                os.close(fd)
            _reply(self.peer, await read_frame(stream, MAX_SMALL_FRAME))
        except PeerError as exc:
            raise HostError(f"{short(self.peer)}: putting checkpoint {sha[:12]} failed: {exc}") from None
        finally:
            await close_quietly(stream)

    async def get_checkpoint(self, job: str, sha: str, size: int, dest: Path) -> None:
        """The host's cached checkpoint `sha` of the job into the file `dest`, verified (its
        sha256 and `size`); on any failure `dest` is removed and HostError names the host."""
        with trio.move_on_after(REQUEST_TIMEOUT + transfer_timeout(size)) as scope:
            try:
                with _host_errors(self.peer, f"getting checkpoint {sha[:12]}"):
                    await self._get_checkpoint(job, sha, size, dest)
            except BaseException:
                dest.unlink(missing_ok=True)
                raise
        if scope.cancelled_caught:
            dest.unlink(missing_ok=True)
            raise HostError(f"{short(self.peer)}: checkpoint {sha[:12]} did not arrive within "
                            f"{REQUEST_TIMEOUT + transfer_timeout(size):g} s")

    async def _get_checkpoint(self, job: str, sha: str, size: int, dest: Path) -> None:
        stream = await self._open(CkptGet.OP, job, **CkptGet(sha).to_wire())
        try:
            with trio.move_on_after(REQUEST_TIMEOUT) as first:
                head = _reply(self.peer, await read_frame(stream, MAX_SMALL_FRAME))
            if first.cancelled_caught:
                raise HostError(f"{short(self.peer)}: no answer to ckpt_get within {REQUEST_TIMEOUT:g} s")
            if head.get("size") != size:
                raise HostError(f"{short(self.peer)}: checkpoint {sha[:12]} is {str(head.get('size'))[:20]} bytes "
                                f"there, not {size}")
            received = _Received(dest)
            try:
                await receive_chunks(stream, size, lambda chunk: trio.to_thread.run_sync(received.write, chunk),
                                     what="checkpoint", check=lambda frame: _reply(self.peer, frame))
            except TransferError as exc:  # one short of `size` is told below, with its sha256
                if exc.reason == "stalled":
                    raise HostError(f"{short(self.peer)}: no checkpoint chunk for {CHUNK_TIMEOUT:g} s") from None
                if exc.reason != "short":
                    raise HostError(f"{short(self.peer)}: checkpoint {sha[:12]}: more than its {size} bytes, "
                                    "or a malformed chunk") from None
            finally:
                received.close()
            if received.size != size or received.hash.hexdigest() != sha:
                raise HostError(f"{short(self.peer)}: checkpoint {sha[:12]} arrived as {received.size} bytes "
                                f"with sha256 {received.hash.hexdigest()[:12]}")
        except PeerError as exc:
            raise HostError(f"{short(self.peer)}: getting checkpoint {sha[:12]} failed: {exc}") from None
        finally:
            await close_quietly(stream)

    async def ship(self, job: str, digest: str, archive: Path, progress: Callable[[int], None]) -> None:
        with _host_errors(self.peer, "shipping the workdir"):
            data = await trio.Path(archive).read_bytes()
        with trio.move_on_after(SHIP_TIMEOUT) as scope:
            with _host_errors(self.peer, "shipping the workdir"):
                await self._ship(job, digest, data, progress)
        if scope.cancelled_caught:
            raise HostError(f"{short(self.peer)}: the workdir was not taken within {SHIP_TIMEOUT:g} s")

    async def _ship(self, job: str, digest: str, data: bytes, progress: Callable[[int], None]) -> None:
        stream = await self._open(Workdir.OP, job, **Workdir(digest, len(data)).to_wire())
        try:
            first = _reply(self.peer, await read_frame(stream, MAX_SMALL_FRAME))
            if first.get("have"):
                return
            await send_chunks(stream, data, progress=progress)
            _reply(self.peer, await read_frame(stream, MAX_SMALL_FRAME))
        except PeerError as exc:
            raise HostError(f"{short(self.peer)}: shipping the workdir failed: {exc}") from None
        finally:
            await close_quietly(stream)

    async def start(self, req: StartRequest, emit: Emit) -> None:
        """The host's events, each passed to `emit`, until it is done; a host silent for
        `EVENT_TIMEOUT` (`FIRST_EVENT_TIMEOUT` before its first) is a HostError naming it."""
        with trio.move_on_after(REQUEST_TIMEOUT) as opening:
            stream = await self._open("start", req.job)
        if opening.cancelled_caught:
            raise HostError(f"{short(self.peer)}: no job stream within {REQUEST_TIMEOUT:g} s")
        try:
            try:
                await write_frame(stream, Start(role=req.role, cmd=req.cmd, env=req.env, python=req.python,
                                                workdir=req.workdir, checkpoints=req.checkpoints, cpus=req.cpus,
                                                mem_mb=req.mem_mb, ray=req.ray, serve=req.serve).to_wire())
            except PeerError as exc:
                raise HostError(f"{short(self.peer)}: {exc}") from None
            await self._events(stream, emit, FIRST_EVENT_TIMEOUT)
        finally:
            await close_quietly(stream)

    async def attach(self, job: str, emit: Emit) -> None:
        """This node took the job over (succession.py): the host's running ranks' events, from
        the one that waited for a successor on, each passed to `emit`, until they are done.
        HostError when the host refuses (its fence) or runs none of the job."""
        with trio.move_on_after(REQUEST_TIMEOUT) as opening:
            stream = await self._open("attach", job)
        if opening.cancelled_caught:
            raise HostError(f"{short(self.peer)}: no job stream within {REQUEST_TIMEOUT:g} s")
        try:
            with _host_errors(self.peer, "attach"), trio.move_on_after(REQUEST_TIMEOUT) as quiet:
                hello = _reply(self.peer, await read_frame(stream, MAX_SMALL_FRAME))
            if quiet.cancelled_caught:
                raise HostError(f"{short(self.peer)}: no answer to attach within {REQUEST_TIMEOUT:g} s")
            if not isinstance(hello.get("attached"), dict):
                raise HostError(f"{short(self.peer)}: attach: a malformed answer")
            await self._events(stream, emit, EVENT_TIMEOUT)
        finally:
            await close_quietly(stream)

    async def _events(self, stream: INetStream, emit: Emit, patience: float) -> None:
        """The job stream's events until ``{done}``; silence past `patience` (then EVENT_TIMEOUT)
        is a HostError."""
        while True:
            with _host_errors(self.peer, "job stream"), trio.move_on_after(patience) as quiet:
                frame = await read_frame(stream, MAX_EVENT_FRAME)
            if quiet.cancelled_caught:
                raise HostError(f"{short(self.peer)}: silent for {patience:g} s (gone, or not running the job)")
            patience = EVENT_TIMEOUT
            event = _reply(self.peer, frame)
            if event.get("done"):
                return
            await emit(event)


class _Received:
    """A checkpoint arriving into a file of the coordinator's choosing, hashed as written."""

    def __init__(self, dest: Path) -> None:
        self.fd: int | None = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                                      0o600)
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        assert self.fd is not None
        view = memoryview(chunk)
        while view:
            view = view[os.write(self.fd, view):]
        self.hash.update(chunk)
        self.size += len(chunk)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@contextlib.contextmanager
def _host_errors(peer: str, what: str) -> Iterator[None]:
    """A peer's misbehaviour (a frame too large or unreadable, a broken stream, a refusal of
    its worker) or this host's own file trouble (gone, unreadable, a full disk) as one
    HostError naming the host and what was being done."""
    try:
        yield
    except (PeerError, FramingError, WorkerError, WorkdirError, CheckpointError, OSError) as exc:
        raise HostError(f"{short(peer)}: {what}: {_why(exc)}") from None


def _why(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    return str(exc) or exc.__class__.__name__


def _gpus(peer: str, reply: dict[str, Any]) -> tuple[int, ...]:
    """The GPU indices a host's reserve or commit answer names, checked."""
    gpus = reply.get("gpus")
    if (not isinstance(gpus, list) or len(gpus) > MAX_GPUS
            or not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < MAX_GPUS for g in gpus)):
        raise HostError(f"{short(peer)}: 'gpus' must be a list of GPU indices 0-{MAX_GPUS - 1}")
    return tuple(gpus)


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
