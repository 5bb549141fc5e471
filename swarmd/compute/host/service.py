"""The job protocol over libp2p (trio), a host's side: its handler (the coordinator's
side is coordinator/hosts.py).

`/swarmd/job/2.0.0`: one stream per request (each op's fields typed and checked in
messages.py). The first frame is ``{op, cert, job, …}`` and
at most `MAX_SMALL_FRAME`: the requester's certificate is checked against the peer id
Noise authenticated before anything else, then the host's submitter allowlist, then the
job id (ids.py's format, nothing else), and only then is anything larger read. Ops:
- ``reserve {gpus, ranks, lease}`` → ``{gpus}`` | ``{error}``; ``commit {port}`` →
  ``{gpus, port?}``; ``release`` → ``{}``; ``cancel`` → ``{found}``: the ledger keeps each
  hold for the coordinator that reserved it, and any other is refused;
- ``workdir {digest, size}`` → ``{have}``; only for a reservation the requester holds here
  (leased or committed), at most `MAX_UPLOADS_PER_PEER` at once. When not had, the
  requester sends ``{data}`` chunks (each within `CHUNK_TIMEOUT`, all within
  `WORKDIR_TIMEOUT`), spooled to disk, and ``{end}``, and the host answers ``{}`` once the
  tree is unpacked and verified; the tree is then kept for that reservation. One upload of
  a digest by a coordinator at a time, its second waits for the first (another
  coordinator's upload of the same digest never holds it up);
- ``start`` → a second frame ``{role, cmd, env, python, workdir, checkpoints}`` (up to
  `MAX_START_FRAME`), then the worker's events, one frame each, until ``{exit}``; ``start``
  needs the same coordinator's committed reservation and at most the ranks reserved.
  ``checkpoints`` lists at most 16 ``[name, sha256, size]`` (checkpoints.rules.check_listed),
  each in this host's cache of the (requester, job), else the start fails naming it. The
  stream breaking either way ends the job on that host.
- ``ckpt_put {name, sha256, size}`` → ``{have: true}``, or ``{have: false}`` then the
  requester's ``{data}`` chunks and ``{end}`` (each chunk within `CHUNK_TIMEOUT`, all
  within `transfer_timeout(size)`) and ``{}`` once the bytes match sha256 and size; only
  while the requester holds a committed or running reservation here (not a mere lease),
  at most the worker's `checkpoint_max` bytes, within the host's budget for all its
  checkpoint caches (checkpoints.cache.Budget), `MAX_CHECKPOINT_TRANSFERS_PER_PEER` at once. A
  checkpoint that does not match is refused and nothing of it is kept; a cache filled for
  a hold that ends before its job starts here goes with the hold (worker.py).
- ``forward {port}`` → ``{port}``, then the stream is a raw byte pipe to the job's
  listener on that TCP port of this host until either side closes (forward.py has the
  rules: only a listener of the job's uid, never even a connection to another's, at most
  16 at once per job and 20 new a second per coordinator, closed when idle 10 minutes or
  when the job's ranks end here); only for the requester's running hold.
  Its stream does not count against `MAX_STREAMS_PER_PEER` (forward.MAX_PER_JOB bounds it).
- ``ckpt_get {sha256}`` → ``{size}``, ``{data}`` chunks, ``{end}``, only out of the
  requester's own cache of that job (checkpoints/cache.py, keyed like the ledger by (requester,
  job)): another member asking for a coordinator's checkpoint finds its own, empty, cache.
- ``attach`` → ``{attached: {ranks, orphaned}}``, then the job's events as a start's, until
  ``{done}``: a successor (issue 26) takes over the stream of the job's running ranks here;
  the host first replays its log of the attempt (output.Replay), so no line is lost with the
  gone coordinator's stream or sent twice.
Every op's first frame may name another's job: ``origin`` (the peer whose job it is: holds,
directories and caches are keyed by it), ``epoch`` and ``charter`` (succession.py). The
worker's fence decides (`Worker.authorize`): with no charter known here only the origin
commands the job; once one is, only the coordinator of the highest epoch seen, and a higher
epoch presented with the charter becomes the one obeyed. Everything else is refused and
counted by reason (``not_replica``, ``not_its_epoch``, ``stale_epoch``, ``charter_changed``,
``charter_mismatch``, ``not_coordinator``, ``bad_epoch``, ``signature``). One exception: a
``forward`` of its own job from the job's origin passes at any epoch (it commands nothing;
the owner's front end reaches the job while a successor coordinates it), and the ledger
still lets it reach only a running hold keyed by that origin.
Before its certificate is checked a stream costs little and is held briefly: its first
frame and the check within `FIRST_FRAME_TIMEOUT`, at most `MAX_UNCHECKED_PER_PEER` such
streams a peer (peer ids are free: an outsider must not use up what members need). Only a
member's stream then counts against the host's budget: at most `MAX_STREAMS_PER_PEER`
beyond this host's job slots from one peer, and `MAX_STREAMS` from all; past either it is
refused before anything more is read.
Every refusal of a peer's request is counted by reason and answered with the reason. A
failure of this host's own (its disk, its sandbox) is logged with its traceback and answered
``{error: "<op>: this host failed: …"}``: the coordinator's job says what broke.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from pathlib import Path
from typing import Any

import structlog
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ...p2p.limits import Streams
from ...p2p.signed import Invalid, peer_bytes
from ...p2p.streams import MAX_SMALL_FRAME, PeerError, close_quietly, read_frame, reset_quietly, write_frame
from ...p2p.transfer import CHUNK_TIMEOUT, TransferError, receive_chunks, send_chunks
from ...rpc.framing import FrameTooLarge
from .. import forward as fwd
from ..checkpoints.cache import CheckpointError, Incoming
from ..ids import check_job_id, is_job_id
from ..ledger import Grant, Refusal
from ..messages import CkptGet, CkptPut, Commit, Forward, Reserve, Start, Workdir
from ..succession import Charter, check_epoch
from ..workdir import DEFAULT_LIMIT, WorkdirError
from .executor import ExecutorError, free_port
from .worker import CoordinatorGone, Refused, StartRequest, Worker, WorkerError

log = structlog.get_logger("swarmd.jobs")

JOB_PROTOCOL = "/swarmd/job/2.0.0"
MAX_START_FRAME = 4 * 1024 * 1024  # a job spec's largest cmd and env (spec.py) with room to spare
REQUEST_TIMEOUT = 10.0
WORKDIR_TIMEOUT = 600.0  # seconds a whole workdir upload may take (64 MiB at about 110 kB/s)
MAX_STREAMS_PER_PEER = 16  # beyond this host's job slots (each running job holds one stream)
MAX_STREAMS = 256
MAX_UPLOADS_PER_PEER = 2  # workdir uploads of one peer at once (each spools up to 64 MiB to disk)
MAX_CHECKPOINT_TRANSFERS_PER_PEER = 2  # checkpoint puts and gets of one peer at once
# bytes a second a checkpoint transfer averages at least: an 8 GiB one may take 2.3 hours,
# and one that trickles is given up (CHUNK_TIMEOUT bounds each pause)
CHECKPOINT_RATE = 1024 * 1024
FIRST_FRAME_TIMEOUT = 2.0  # seconds for a small first frame and the certificate check
MAX_UNCHECKED_PER_PEER = 4  # streams of one peer whose certificate is not yet checked
class _Rejected(Exception):
    """A peer's request broke the protocol: counted under `code`, answered with the message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# --- the host's side ----------------------------------------------------------------------

class JobHandler:
    def __init__(self, worker: Worker, *, check_member: Callable[[Any, ID, INetStream], Awaitable[bool]],
                 submitters: Collection[str], rejected: Callable[[str, str, str], None]) -> None:
        self.worker = worker
        self.check_member = check_member
        self.submitters = frozenset(submitters)
        self.rejected = rejected
        self.unchecked = Streams(MAX_UNCHECKED_PER_PEER, what="job streams")  # before check_member, per peer
        # members', per peer and in all
        self.streams = Streams(MAX_STREAMS_PER_PEER + worker.ledger.slots, MAX_STREAMS, what="job streams")
        self._uploading: dict[tuple[str, str], trio.Event] = {}  # (coordinator, digest) -> set when it ends
        self._uploads: Counter[str] = Counter()  # workdir uploads under way, per peer
        self._transfers: Counter[str] = Counter()  # checkpoint puts and gets under way, per peer

    async def handle(self, stream: INetStream) -> None:
        peer = str(stream.muxed_conn.peer_id)
        try:
            if not await self._refuse_if(self.unchecked.acquire(peer), stream, peer):
                try:
                    req = await self._first(stream, peer)
                finally:
                    self.unchecked.release(peer)
                if req is not None and not await self._refuse_if(self.streams.acquire(peer), stream, peer):
                    try:
                        await self._serve(stream, peer, req)
                    finally:
                        self.streams.release(peer)
        finally:
            await close_quietly(stream)

    async def _refuse_if(self, busy: str | None, stream: INetStream, peer: str) -> bool:
        if busy is None:
            return False
        self.rejected("too_many_streams", peer, busy)
        with trio.move_on_after(1):
            try:
                await write_frame(stream, {"error": busy})
            except PeerError:
                pass
        return True

    async def _first(self, stream: INetStream, peer: str) -> dict[str, Any] | None:
        """The first frame of a member's request, or None (refused, counted, and told why
        where it got that far)."""
        try:
            with trio.move_on_after(FIRST_FRAME_TIMEOUT) as scope:
                req = await read_frame(stream, MAX_SMALL_FRAME)
                member = await self.check_member(req, stream.muxed_conn.peer_id, stream)
        except FrameTooLarge as exc:
            self.rejected("too_large", peer, f"job request: {exc}")
            return None
        except PeerError as exc:
            self.rejected("malformed", peer, f"job request: {exc}")
            return None
        if scope.cancelled_caught:
            self.rejected("timeout", peer, f"no job request within {FIRST_FRAME_TIMEOUT:g} s")
            return None
        return req if member and isinstance(req, dict) else None

    async def _serve(self, stream: INetStream, peer: str, req: dict[str, Any]) -> None:
        try:
            if self.submitters and peer not in self.submitters:
                self.rejected("submitter", peer, "not in this host's job_submitters")
                await write_frame(stream, {"error": "this host takes jobs only from its allowed submitters"})
                return
            op = req.get("op")
            shown = op if isinstance(op, str) and len(op) <= 16 else "request"
            try:
                if not is_job_id(req.get("job")):
                    check_job_id(req.get("job"))  # raises, naming the format
                if op == Forward.OP and req.get("origin", peer) == peer:
                    # its own job's listener, for its origin (the owner's front end) at any epoch: a
                    # forward commands nothing, and the owner reaches the job while a successor coordinates
                    origin = peer
                else:
                    origin = self._authorize(req, req["job"], peer)
                reply = await self._op(op, req["job"], origin, req, stream, peer)
                if reply is not None:  # None: the op has had the stream (a forward, a ckpt_get)
                    await write_frame(stream, reply)
            except _Rejected as exc:
                self.rejected(exc.code, peer, f"job {shown}: {exc}")
                await write_frame(stream, {"error": f"{shown}: {exc}"})
            except fwd.ForwardRefused as exc:  # not the job's listener, too many forwards
                self.rejected(exc.code, peer, f"job {shown}: {exc}")
                await write_frame(stream, {"error": f"{shown}: {exc}"})
            except Refused as exc:  # the ledger: not this coordinator's, not committed, too many ranks
                self.rejected(exc.code, peer, f"job {shown}: {exc}")
                await write_frame(stream, {"error": f"{shown}: {exc}"})
            except (ValueError, TypeError, KeyError) as exc:  # a malformed request
                code = "job_id" if not is_job_id(req.get("job")) else "malformed"
                self.rejected(code, peer, f"job {shown}: {exc}")
                await write_frame(stream, {"error": f"{shown}: {exc}"})
            except WorkdirError as exc:  # a tree refused (its digest, depth, entries, size) or this disk full
                self.rejected("workdir", peer, f"job {shown}: {exc}")
                await write_frame(stream, {"error": f"{shown}: {exc}"})
            except (WorkerError, ExecutorError, fwd.NothingListens) as exc:  # well-formed, and this host cannot
                await write_frame(stream, {"error": f"{shown}: {exc}"})
            except CoordinatorGone as exc:
                log.info("a coordinator went away from its job", peer=peer, job=req.get("job"), why=str(exc))
            except (PeerError, FrameTooLarge):  # the stream, below: the peer's doing, not this host's
                raise
            except Exception as exc:  # this host broke, not the request: its coordinator reads what broke
                log.exception("a job request failed on this host", peer=peer, job=req.get("job"), op=shown)
                what = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)  # no path of ours
                with trio.move_on_after(1), contextlib.suppress(PeerError):
                    await write_frame(stream, {"error": f"{shown}: this host failed: {exc.__class__.__name__}: "
                                                        f"{what[:200]}"})
        except FrameTooLarge as exc:
            self.rejected("too_large", peer, f"job request: {exc}")
        except PeerError as exc:
            self.rejected("malformed", peer, f"job request: {exc}")

    def _authorize(self, req: dict[str, Any], job: str, peer: str) -> str:
        """The origin of the job the request commands (its own, unless it names another's with
        ``origin``), once the fence let `peer` command it at its ``epoch`` (worker.authorize:
        Refused otherwise). ``charter``, the job's signed charter, makes a successor known here."""
        origin, epoch, blob = req.get("origin", peer), req.get("epoch", 0), req.get("charter")
        if not isinstance(origin, str) or len(origin) > 64:
            raise ValueError("'origin' must be a peer id")
        try:
            if origin != peer:  # another's job: its id must be one (a charter or the fence names it)
                peer_bytes(origin)
            epoch = check_epoch(epoch)
            charter = Charter.open(blob) if blob is not None else None
        except Invalid as exc:
            raise _Rejected(exc.reason if exc.reason != "malformed" else "charter", exc.detail) from None
        self.worker.authorize(job, peer, origin, epoch, charter)
        return origin

    async def _op(self, op: Any, job: str, coordinator: str, req: dict[str, Any],
                  stream: INetStream, peer: str) -> dict[str, Any] | None:
        """`coordinator`: the job's origin, whose holds, directories and caches it is keyed by
        here; `peer`, who asks (the origin, or the successor authorized for it)."""
        w = self.worker
        match op:
            case Reserve.OP:
                r = Reserve.from_wire(req)
                return _answer(w.reserve(job, coordinator, r.gpus, r.ranks, r.lease))
            case Commit.OP:
                return _answer(w.commit(job, coordinator), port=Commit.from_wire(req).port)
            case "release":
                if isinstance(refusal := w.release(job, coordinator), Refusal):
                    raise Refused(refusal)
                return {}
            case "cancel":
                if isinstance(found := w.cancel(job, coordinator), Refusal):
                    raise Refused(found)
                return {"found": found}
            case Workdir.OP:
                return await self._receive_workdir(Workdir.from_wire(req), stream, job, coordinator)
            case Forward.OP:
                port = Forward.from_wire(req).port
                async with open_forward(w, job, coordinator, port) as (end, stop):
                    await write_frame(stream, {"port": port})
                    with self.streams.aside(coordinator):
                        piped = await fwd.pipe(fwd.NetEnd(stream), end, stop=stop)
                log.debug("forward ended", job=job, port=port, sent=piped.sent, received=piped.received,
                          why=piped.why)
                if piped.why != "closed":  # not both ends done: the coordinator must not write on into it
                    await reset_quietly(stream)
                return None
            case CkptPut.OP | CkptGet.OP:
                try:
                    if op == CkptPut.OP:
                        return await self._put_checkpoint(CkptPut.from_wire(req), stream, job, coordinator)
                    await self._get_checkpoint(CkptGet.from_wire(req), stream, job, coordinator)
                    return None
                except OSError as exc:  # this host's disk, not the request
                    raise WorkerError(f"this host's checkpoint cache: {exc}") from None
            case "start":
                with trio.move_on_after(REQUEST_TIMEOUT) as scope:
                    body = await read_frame(stream, MAX_START_FRAME)
                if scope.cancelled_caught:
                    raise _Rejected("timeout", f"no start request within {REQUEST_TIMEOUT:g} s")
                asked = Start.from_wire(body, w.checkpoint_max)
                start = StartRequest(job=job, coordinator=coordinator, role=asked.role, cmd=asked.cmd, env=asked.env,
                                     python=asked.python, workdir=asked.workdir, checkpoints=asked.checkpoints,
                                     ray=asked.ray, serve=asked.serve, cpus=asked.cpus, mem_mb=asked.mem_mb)

                async def emit(event: dict[str, Any]) -> None:
                    try:
                        await write_frame(stream, event)
                    except PeerError as exc:
                        raise CoordinatorGone(str(exc)) from None

                await w.start(start, emit)
                return {"done": True}
            case "attach":
                async def to_successor(event: dict[str, Any]) -> None:
                    try:
                        await write_frame(stream, event)
                    except PeerError as exc:
                        raise CoordinatorGone(str(exc)) from None

                async def hello(frame: dict[str, Any]) -> None:
                    with trio.move_on_after(REQUEST_TIMEOUT):
                        await write_frame(stream, frame)

                await w.attach(job, coordinator, peer, to_successor, hello)
                return {"done": True}
            case _:
                raise ValueError(f"unknown op {str(op)[:40]!r}")

    async def _receive_workdir(self, req: Workdir, stream: INetStream, job: str,
                               coordinator: str) -> dict[str, Any]:
        digest, size = req.digest, req.size
        if self.worker.ledger.state_of(job, coordinator) not in ("leased", "committed"):
            raise Refused(Refusal(f"job {job} holds no reservation on this host to ship a workdir for",
                                  "no_reservation"))
        if self._uploads[coordinator] >= MAX_UPLOADS_PER_PEER:
            raise _Rejected("too_many_uploads", f"{MAX_UPLOADS_PER_PEER} workdir uploads from this peer are "
                                                "already under way")
        self._uploads[coordinator] += 1
        try:
            had = await self._upload(digest, size, stream, coordinator)
        finally:
            self._uploads[coordinator] -= 1
            if self._uploads[coordinator] <= 0:
                del self._uploads[coordinator]
        self.worker.pin(job, coordinator, digest)  # kept until the hold goes
        return {"have": True} if had else {}

    async def _upload(self, digest: str, size: int, stream: INetStream, coordinator: str) -> bool:
        """The tree `digest` into the cache: True when it was here already, else it is
        received into a spool file (after ``{have: false}``) and unpacked."""
        cache = self.worker.cache
        key = (coordinator, digest)
        while (other := self._uploading.get(key)) is not None:  # one upload of a tree at a time
            with trio.move_on_after(WORKDIR_TIMEOUT):
                await other.wait()
            if not other.is_set():
                raise WorkerError(f"workdir {digest[:12]} is being uploaded by another request")
        if cache.has(digest):
            return True
        if not 0 < size <= DEFAULT_LIMIT:
            raise ValueError(f"'size' must be 1-{DEFAULT_LIMIT} bytes")
        done = self._uploading[key] = trio.Event()
        try:
            await write_frame(stream, {"have": False})
            with cache.spool() as spool:  # on disk, not in memory; removed when closed
                await _receive_chunks(stream, size, WORKDIR_TIMEOUT, "workdir", spool.write)
                spool.flush()
                await trio.to_thread.run_sync(cache.put_file, digest, Path(spool.name))
        finally:
            del self._uploading[key]
            done.set()
        return False


    # --- checkpoints -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _transfer(self, peer: str) -> Any:
        if self._transfers[peer] >= MAX_CHECKPOINT_TRANSFERS_PER_PEER:
            raise _Rejected("too_many_transfers", f"{MAX_CHECKPOINT_TRANSFERS_PER_PEER} checkpoint transfers from "
                                                  "this peer are already under way")
        self._transfers[peer] += 1
        try:
            yield
        finally:
            self._transfers[peer] -= 1
            if self._transfers[peer] <= 0:
                del self._transfers[peer]

    async def _put_checkpoint(self, req: CkptPut, stream: INetStream, job: str,
                              coordinator: str) -> dict[str, Any]:
        """A checkpoint of the requester's job into its cache here: ``{have: true}`` when it
        is here already, else ``{have: false}``, its chunks, and ``{}`` once verified."""
        w = self.worker
        sha, size = req.sha256, req.size
        if size > w.checkpoint_max:
            raise _Rejected("too_large", f"a checkpoint of {size} bytes is over this host's checkpoint_max of "
                                         f"{w.checkpoint_max}")
        if (refusal := w.accept_checkpoint_put(job, coordinator)) is not None:
            raise Refused(refusal)
        if (have := w.checkpoint_path(job, coordinator, sha)) is not None:
            try:
                here = (await trio.Path(have).stat()).st_size
            except OSError:
                here = None  # pruned meanwhile: received afresh
            if here is not None and here != size:
                raise _Rejected("checkpoint_size", f"checkpoint {sha[:12]} is {here} bytes, not {size}")
            if here is not None:
                return {"have": True}
        async with self._transfer(coordinator):
            cache = w.checkpoint_cache(job, coordinator)
            try:
                incoming = await trio.to_thread.run_sync(cache.open_incoming, size)
            except (CheckpointError, OSError) as exc:
                raise WorkerError(f"checkpoint {sha[:12]}: {exc}") from None
            try:
                await write_frame(stream, {"have": False})
                await self._receive_checkpoint(incoming, stream)
                try:
                    await trio.to_thread.run_sync(incoming.finish, sha)
                except CheckpointError as exc:
                    raise _Rejected("checkpoint_sha256", str(exc)) from None
            except OSError as exc:  # this host's disk
                raise WorkerError(f"checkpoint {sha[:12]}: {exc}") from None
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(incoming.discard)
            await trio.to_thread.run_sync(cache.prune, w.checkpoint_keep,
                                          {sha, *w.kept_checkpoints(job, coordinator)})
        return {}

    async def _receive_checkpoint(self, incoming: Incoming, stream: INetStream) -> None:
        async def take(chunk: bytes) -> None:
            await trio.to_thread.run_sync(incoming.write, chunk)

        await _receive_chunks(stream, incoming.size, transfer_timeout(incoming.size), "checkpoint", take,
                              size_code="checkpoint_size")

    async def _get_checkpoint(self, req: CkptGet, stream: INetStream, job: str, coordinator: str) -> None:
        """A checkpoint from the requester's own cache of its job: ``{size}``, its chunks,
        ``{end}``."""
        sha = req.sha256
        path = self.worker.checkpoint_path(job, coordinator, sha)
        if path is None:
            raise WorkerError(f"checkpoint {sha[:12]} of job {job} is not on this host")
        async with self._transfer(coordinator):
            try:  # the descriptor keeps the file while a prune removes its name
                fd = await trio.to_thread.run_sync(os.open, path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                raise WorkerError(f"checkpoint {sha[:12]} of job {job} is not on this host") from None
            try:
                size = os.fstat(fd).st_size
                await write_frame(stream, {"size": size})
                with trio.move_on_after(transfer_timeout(size)) as whole:
                    await send_chunks(stream, fd)
                if whole.cancelled_caught:
                    raise _Rejected("timeout", f"the checkpoint was not taken within {transfer_timeout(size):g} s")
            finally:
                os.close(fd)


def transfer_timeout(size: int) -> float:
    """Seconds a checkpoint of `size` bytes may take to cross, either way."""
    return REQUEST_TIMEOUT + 2 * CHUNK_TIMEOUT + size / CHECKPOINT_RATE


async def _receive_chunks(stream: INetStream, size: int, within: float, what: str,
                          take: Callable[[bytes], Any], *, size_code: str = "malformed") -> None:
    """transfer.receive_chunks, its refusals as this protocol's: a malformed chunk a
    ValueError, a pause or the deadline counted under ``timeout``, a size mismatch under
    `size_code`."""
    try:
        await receive_chunks(stream, size, take, what=what, within=within)
    except TransferError as exc:
        if exc.reason == "malformed":
            raise ValueError(str(exc)) from None
        raise _Rejected("timeout" if exc.reason in ("stalled", "late") else size_code, str(exc)) from None


def _answer(answer: Grant | Refusal, *, port: bool = False) -> dict[str, Any]:
    if isinstance(answer, Refusal):
        return {"error": answer.reason}
    reply: dict[str, Any] = {"gpus": list(answer.gpus)}
    if port:
        reply["port"] = free_port()
    return reply


@contextlib.asynccontextmanager
async def open_forward(worker: Worker, job: str, coordinator: str,
                       port: int) -> AsyncIterator[tuple[fwd.StreamEnd, trio.Event]]:
    """A connection to the job's listener on `port` of this host, for the coordinator whose
    hold of the job runs here, and the event set when the job's ranks end (forward.py). Refused
    (`Refused`, `ForwardRefused`) or `NothingListens` otherwise."""
    if worker.ledger.state_of(job, coordinator) != "running":
        if (refusal := worker.ledger.check_holder(job, coordinator)) is not None:
            raise Refused(refusal)
        raise Refused(Refusal(f"job {job} is not running on this host", "not_running"))
    key = (coordinator, job)
    uid = worker.forwards.uid(key)
    if uid is None:
        raise Refused(Refusal(f"job {job} is not running on this host", "not_running"))
    with worker.forwards.slot(key, trio.current_time()) as stop:
        tcp = await fwd.connect(port, uid, fwd.interface_addresses(worker.ifname()))
        end = fwd.StreamEnd(tcp)
        try:
            yield end, stop
        finally:
            await end.aclose()
