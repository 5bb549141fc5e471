"""A job's record on its replicas (trio): the coordinator's writes, each replica's store on
disk, and the protocol between them. The rules are succession.py's; this is their I/O.

`/swarmd/jobrec/1.0.0`: one stream per request, one frame each way, the first at most
`MAX_FRAME`, the requester's certificate checked against the peer id Noise authenticated
before anything else (the gossip gate), everything within `TIMEOUT`:
- ``put {record}`` → ``{}`` | ``{error, reason}``: a record (succession.Record, signed by
  its epoch's coordinator, so any replica may pass one on) of a job this node is a replica
  of. It is on disk before the answer. ``stale`` tells a superseded coordinator that a
  higher epoch is here.
- ``get {origin, job}`` → ``{record}`` (``None`` when none is held) | ``{error, reason}``:
  only to a replica of that job (a successor gathering the newest, an origin catching up):
  a job's spec is its owner's business, not every member's.
- ``log {origin, job, offset}`` → ``{lines: [[rank, text]…], next}``: the output of a job
  this node took over, as it received it, from byte ``offset`` of its copy (at most
  `LOG_READ` bytes a request), only to the job's origin (its owner's front end).
- ``cancel {origin, job}`` → ``{state}``: only from the job's origin, for a job this node
  coordinates for it.
Every refusal is counted by reason (``Handler.refused``) and answered with it.

The store: ``<state>/replicas/<sha256(origin)[:32]>-<job id>.rec``, one file per job, the
record's signed bytes, written atomically. At start every file goes through `Record.open`
and the core's checks again: anything else left there (a half-written temporary, a file
whose name is not its job's, a record that fails, a directory) is removed and counted, and
a record not rewritten for `RETENTION` is let go, so a start-up survives whatever it finds.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Any, Protocol

import msgpack
import structlog
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ...atomic import write_atomically
from ...p2p.signed import Invalid, Signer, peer_bytes
from ...p2p.streams import PeerError, close_quietly, read_frame, write_frame
from ...rpc.framing import FrameTooLarge
from .. import trees
from ..ids import is_job_id
from .run import TERMINAL
from ..succession import MAX_RECORD, Charter, Record, Replicas, newest

log = structlog.get_logger("swarmd.jobs")

PROTOCOL = "/swarmd/jobrec/1.0.0"
MAX_FRAME = MAX_RECORD + 16 * 1024  # a record, its charter, the certificate
TIMEOUT = 5.0  # seconds for one request, either side
RETENTION = 7 * 86400.0  # a record not rewritten this long is let go at start (jobs' own retention)
LOG_READ = 40 * 1024  # bytes of a job's output per log request (the reply stays within MAX_FRAME)
HASH = 32  # hex digits of sha256(origin) in a record's file name, as ids.host_dir

Request = Callable[[ID, str, Any, int], Awaitable[Any]]  # Transport.request


def file_name(key: tuple[str, str]) -> str:
    origin, job = key
    return f"{hashlib.sha256(origin.encode()).hexdigest()[:HASH]}-{job}.rec"


class Store:
    """The records this node holds as a replica (succession.Replicas), on disk."""

    def __init__(self, me: str, directory: Path) -> None:
        self.held = Replicas(me)  # the rules (succession.py); this class adds the files
        self.dir = directory
        self.removed = 0  # files found at start that were not a record to keep
        # puts run in worker threads (a replica's answers, the coordinator's own writes): one at a
        # time, so a check, its file and its eviction are one step
        self._lock = threading.Lock()

    def load(self, *, now: float | None = None) -> int:
        """Read what a previous life left; returns the records kept. Blocking: call in a thread."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        now = time.time() if now is None else now
        with os.scandir(self.dir) as it:
            entries = list(it)
        for entry in entries:
            why = self._load_one(entry, now)
            if why is not None:
                log.info("a replica file was removed at start", file=entry.name[:80], why=why)
                self.removed += 1
                path = Path(entry.path)
                if entry.is_dir(follow_symlinks=False):
                    trees.remove(path)
                else:
                    path.unlink(missing_ok=True)
        return len(self.held)

    def _load_one(self, entry: os.DirEntry, now: float) -> str | None:
        if not entry.is_file(follow_symlinks=False):
            return "not a regular file"
        stat = entry.stat(follow_symlinks=False)
        if stat.st_size > MAX_FRAME:
            return "too large"
        if now - stat.st_mtime > RETENTION:
            return "not rewritten within the retention"
        try:
            record = Record.open(Path(entry.path).read_bytes())
        except (Invalid, OSError) as exc:
            return f"not a record ({exc})"
        if entry.name != file_name(record.charter.key):
            return "named for another job"
        return self.held.offer(record)

    def put(self, record: Record) -> str | None:
        """Keep ``record`` if the core allows (on disk before this returns); else why not. When
        the store is full, the record of a job that ended, written longest ago, makes room
        (this origin's first, when it is its share that is full)."""
        with self._lock:
            return self._put(record)

    def _put(self, record: Record) -> str | None:
        why = self.held.check(record)
        if why == "full" and self._evict_ended(record.charter.origin):
            why = self.held.check(record)
        if why is not None:
            self.held.offer(record)  # counts it
            return why
        write_atomically(self.dir / file_name(record.charter.key), record.blob)
        self.held.offer(record)
        return None

    def get(self, key: tuple[str, str]) -> Record | None:
        return self.held.get(key)

    def drop(self, key: tuple[str, str]) -> None:
        """Forget the job's record, its file first. Blocking: call in a thread."""
        with self._lock:
            (self.dir / file_name(key)).unlink(missing_ok=True)
            self.held.drop(key)

    def _evict_ended(self, origin: str) -> bool:
        over = []
        for key in self.held.keys():
            record = self.held.get(key)
            if record is None or not ended(record):
                continue
            try:
                written = (self.dir / file_name(key)).stat().st_mtime
            except OSError:
                written = 0.0
            over.append((key[0] != origin, written, key))
        if not over:
            return False
        _, _, key = min(over)
        (self.dir / file_name(key)).unlink(missing_ok=True)
        self.held.drop(key)
        return True


def ended(record: Record) -> bool:
    """Whether the job of ``record`` is over (its run's state), as its coordinator wrote it."""
    try:
        state = msgpack.unpackb(record.body, raw=False)["run"]["state"]
    except Exception:  # a body this daemon cannot read: kept (its writer's business)
        return False
    return state in TERMINAL


class Coordinated(Protocol):
    """What the replica's handler asks of the coordinator (coordinator.Jobs) for an origin."""

    def handed_log(self, origin: str, job: str, offset: int, limit: int
                   ) -> tuple[list[tuple[int, str]], int] | None: ...

    def cancel_handed(self, origin: str, job: str) -> str | None: ...


class Handler:
    """The replica's side of the protocol."""

    def __init__(self, store: Store, *, check_member: Callable[[Any, ID, INetStream], Awaitable[bool]],
                 reject: Callable[[str, str, str], None], jobs: Coordinated | None = None) -> None:
        self.store = store
        self.check_member = check_member
        self.reject = reject
        self.jobs = jobs  # the coordinator, for an origin's log and cancel (None: a replica only)
        self.refused: dict[str, int] = {}
        self.served = 0

    def refuse(self, reason: str, peer: str, detail: str) -> dict[str, str]:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        self.reject(reason, peer, detail)
        return {"error": detail, "reason": reason}

    async def handle(self, stream: INetStream) -> None:
        peer = str(stream.muxed_conn.peer_id)
        try:
            with trio.fail_after(TIMEOUT):
                req = await read_frame(stream, MAX_FRAME)
                if not await self.check_member(req, stream.muxed_conn.peer_id, stream):
                    return
                await write_frame(stream, await self.answer(req, peer))
        except FrameTooLarge as exc:
            self.refuse("too_large", peer, str(exc))
        except (PeerError, trio.TooSlowError):
            pass
        finally:
            await close_quietly(stream)

    async def answer(self, req: Any, peer: str) -> dict[str, Any]:
        if not isinstance(req, dict):
            return self.refuse("malformed", peer, "a request is a map")
        op = req.get("op")
        if op == "put":
            try:
                record = Record.open(req.get("record"))
            except Invalid as exc:
                return self.refuse(exc.reason, peer, f"put: {exc.detail}")
            why = await trio.to_thread.run_sync(self.store.put, record)
            if why is not None:
                return self.refuse(why, peer, f"put: job {record.charter.job}: {why}")
            self.served += 1
            return {}
        if op == "get":
            origin, job = req.get("origin"), req.get("job")
            try:
                if not isinstance(origin, str):
                    raise Invalid("malformed", "get: origin must be a peer id")
                peer_bytes(origin)
            except Invalid as exc:
                return self.refuse("malformed", peer, exc.detail)
            if not is_job_id(job):
                return self.refuse("malformed", peer, "get: job must be a job id")
            record = self.store.get((origin, job))
            if record is None:
                return {"record": None}
            if peer not in record.charter.replicas:
                return self.refuse("not_replica", peer, f"get: {peer[-8:]} is not a replica of job {job}")
            self.served += 1
            return {"record": record.blob}
        if op in ("log", "cancel"):
            return self._origin_op(op, req, peer)
        return self.refuse("malformed", peer, f"unknown op {str(op)[:40]!r}")

    def _origin_op(self, op: str, req: dict[str, Any], peer: str) -> dict[str, Any]:
        """An origin's ``log`` or ``cancel`` of its job this node coordinates: the origin is the
        requester itself, so no member reads or stops another's job."""
        job, offset = req.get("job"), req.get("offset", 0)
        if not is_job_id(job):
            return self.refuse("malformed", peer, f"{op}: job must be a job id")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < 2**62:
            return self.refuse("malformed", peer, f"{op}: offset must be a byte offset")
        if self.jobs is None:
            return self.refuse("not_coordinator", peer, f"{op}: this node coordinates no jobs")
        if op == "cancel":
            state = self.jobs.cancel_handed(peer, job)
            if state is None:
                return self.refuse("not_coordinator", peer, f"cancel: this node does not coordinate job {job} "
                                                            "for the requester")
            self.served += 1
            return {"state": state}
        got = self.jobs.handed_log(peer, job, offset, LOG_READ)
        if got is None:
            return self.refuse("not_coordinator", peer, f"log: this node took no job {job} over from the requester")
        lines, after = got
        self.served += 1
        return {"lines": [[rank, text] for rank, text in lines], "next": after}


class Writer:
    """The coordinator's side: a record to every replica, a gathering of the newest."""

    def __init__(self, store: Store, *, me: str, sign: Signer, request: Request, cert: Callable[[], bytes | None]
                 ) -> None:
        self.store = store
        self.me = me
        self.sign = sign
        self.request = request
        self.cert = cert  # this node's certificate, once it is in a swarm
        self.failed: dict[str, int] = {}  # replicas that did not take a write, by reason

    def record(self, charter: Charter, epoch: int, seq: int, state: dict[str, Any]) -> Record:
        return Record.make(charter, epoch, seq, msgpack.packb(state, use_bin_type=True), self.sign)

    async def write(self, record: Record, skip: Collection[str] = ()) -> dict[str, str | None]:
        """``record`` on every replica, this node first: peer -> None (taken) or why not. Those
        in ``skip`` (membership declares them gone: a request would only wait out TIMEOUT) are
        not asked and answer ``gone``."""
        out: dict[str, str | None] = {}
        try:
            out[self.me] = await trio.to_thread.run_sync(self.store.put, record) \
                if self.me in record.charter.replicas else "not_replica"
        except OSError as exc:  # this node's disk (full, read-only): the other replicas still count
            out[self.me] = f"disk: {exc.strerror or exc}"[:80]

        async def one(peer: str) -> None:
            out[peer] = await self._ask(peer, {"op": "put", "record": record.blob}, lambda reply: reply.get("reason"))

        async with trio.open_nursery() as nursery:
            for peer in record.charter.replicas:
                if peer in skip and peer != self.me:
                    out[peer] = "gone"
                elif peer != self.me:
                    nursery.start_soon(one, peer)
        for why in out.values():
            if why is not None:
                self.failed[why] = self.failed.get(why, 0) + 1
        return out

    async def gather(self, key: tuple[str, str], replicas: tuple[str, ...], skip: Collection[str] = ()
                     ) -> Record | None:
        """The newest record of the job among ours and those of every replica that answers
        (those in ``skip`` are not asked)."""
        found: list[Record | None] = [self.store.get(key)]
        charter = found[0].charter if found[0] is not None else None

        def opened(reply: dict[str, Any]) -> Record | None:
            blob = reply.get("record")
            if blob is None:
                return None
            record = Record.open(blob, charter)
            if record.charter.key != key:
                raise Invalid("malformed", "a record of another job")
            return record

        async def one(peer: str) -> None:
            got = await self._ask(peer, {"op": "get", "origin": key[0], "job": key[1]}, opened)
            if isinstance(got, Record):
                found.append(got)

        async with trio.open_nursery() as nursery:
            for peer in replicas:
                if peer != self.me and peer not in skip:
                    nursery.start_soon(one, peer)
        return newest(found)

    async def log(self, peer: str, key: tuple[str, str], offset: int) -> tuple[list[tuple[int, str]], int] | str:
        """The output ``peer`` received of this node's job since it took it over, from byte
        ``offset`` of its copy: (rank, line) pairs and the offset to go on from; why not."""

        def read(reply: dict[str, Any]) -> tuple[list[tuple[int, str]], int] | str:
            if "error" in reply:
                return str(reply.get("reason"))[:40]
            lines, after = reply.get("lines"), reply.get("next")
            if not isinstance(lines, list) or isinstance(after, bool) or not isinstance(after, int) or \
                    not offset <= after < 2**62 or not all(
                        isinstance(x, list) and len(x) == 2 and isinstance(x[0], int) and not isinstance(x[0], bool)
                        and 0 <= x[0] < 1 << 20 and isinstance(x[1], str) for x in lines):
                return "malformed_reply"
            return [(rank, text) for rank, text in lines], after

        return await self._ask(peer, {"op": "log", "origin": key[0], "job": key[1], "offset": offset}, read)

    async def cancel(self, peer: str, key: tuple[str, str]) -> str | None:
        """Ask ``peer``, which coordinates this node's job, to cancel it: None when it took it."""
        def read(reply: dict[str, Any]) -> str | None:
            return str(reply.get("reason"))[:40] if "error" in reply else None

        return await self._ask(peer, {"op": "cancel", "origin": key[0], "job": key[1]}, read)

    async def _ask(self, peer: str, body: dict[str, Any], read: Callable[[dict[str, Any]], Any]) -> Any:
        cert = self.cert()
        if cert is None:
            return "not_in_a_swarm"
        try:
            with trio.fail_after(TIMEOUT):
                reply = await self.request(ID.from_base58(peer), PROTOCOL, {"cert": cert, **body}, MAX_FRAME)
            if not isinstance(reply, dict):
                return "malformed_reply"
            return read(reply)
        except trio.TooSlowError:
            return "timeout"
        except PeerError:
            return "unreachable"
        except Invalid as exc:
            return f"bad_reply: {exc.reason}"
