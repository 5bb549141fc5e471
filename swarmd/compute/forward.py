"""Forwarding a TCP port of a running job (`swarmctl jobs forward`): who owns a listener, a
byte pipe with limits, and a host's forwards per job.

Theory of operation. `swarmctl jobs forward ID LOCAL[:REMOTE]` accepts on the user's machine
and opens one control connection per accepted connection (`jobs.forward`); the coordinator
asks the job's first host (node rank 0) over the job protocol (`forward {port}`), and after
each side's OK answer every hop is a raw byte pipe (`pipe`): swarmctl ⇄ control socket ⇄
coordinator ⇄ libp2p stream ⇄ head host ⇄ TCP ⇄ the job's listener.

Rules (the head host's):
- Only a listener of the job: before any connection the host asks the kernel which listener
  a connection to 127.0.0.1:PORT, [::1]:PORT and each of its overlay addresses would reach
  (`targets`, sockdiag.py: one socket's lookup, never the host's socket table, whose parse
  cost 1.2 s and ~157 MB with 200,000 sockets), and connects only where that listener is the
  job's uid's; once connected, the socket that accepted must belong to the job's uid
  (`check_owner`: an accepted socket carries its listener's uid). So a forward never
  reaches sshd, a root service on 127.0.0.1, the daemon's own ports or another job, not
  even for a connect. A job that runs as root (no per-job uid, `job_user` root) is never
  forwarded; one that runs as the daemon's own user (no root, no sandbox) is refused this
  daemon's own listeners (`own_inodes`). Without per-job uids, two jobs of the same user
  are not told apart.
- At most `MAX_PER_JOB` forwards of one job at once (`Forwards.slot`), and of one
  coordinator's jobs `MAX_PER_COORDINATOR`; a coordinator starts at most `RATE` a second
  (bursts of `BURST`): each costs kernel lookups, a connection and a thread's turn. A pipe
  with no byte either way for `IDLE_TIMEOUT` is closed; reads are at most `CHUNK` bytes;
  when the job's ranks end on the host its forwards end (`Forwards.ended`).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from .. import sockdiag

MAX_PER_JOB = 16  # forwards of one job at once on its head host (each holds a TCP and a stream)
# forwards of one coordinator's jobs together on a host: well below the gossip guard's 64
# streams per peer, so forwards alone never leave that coordinator's start and cancel streams
# to this host without room (another user's cancel among them)
MAX_PER_COORDINATOR = 24
# forwards a coordinator starts a second on a host, and the burst it may start at once: a
# browser opens a handful of connections together; a loop that retries a refused port
# must not keep a worker thread busy asking the kernel
RATE, BURST = 20.0, 40
IDLE_TIMEOUT = 600.0  # seconds without a byte either way after which a forward is closed
CHUNK = 64 * 1024  # bytes read at most per step: a pipe holds at most this per direction
CONNECT_TIMEOUT = 5.0  # seconds to connect to a listener on this host


class ForwardRefused(Exception):
    """A forward this host will not make; `code` is the metric label, the message the reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class NothingListens(Exception):
    """No listener on the port at any of this host's addresses (the job's service is not up)."""


# --- whose listener: one socket at a time (sockdiag.py) ----------------------------------------

def own_inodes(proc: Path = Path("/proc")) -> set[int]:
    """Inodes of this process's own sockets."""
    found = set()
    for fd in (proc / "self" / "fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    return found


def _not_the_jobs(listener: sockdiag.TcpSocket, port: int, uid: int, daemon_uid: int) -> str | None:
    """None when `listener` on `port` is the job's (`uid`), else why not (blocking)."""
    if listener.uid != uid:
        return f"port {port} is served by uid {listener.uid}, not by the job (uid {uid})"
    if uid == daemon_uid and listener.inode in own_inodes():
        return f"port {port} is this daemon's own"
    return None


@dataclass(frozen=True, slots=True)
class Targets:
    """Where a forward may connect on this host: the addresses whose listener is the job's,
    and, when there is none, why (None: nothing listens at any of them)."""

    addresses: tuple[str, ...]
    refused: str | None


def targets(port: int, uid: int, addresses: list[str], *, daemon_uid: int) -> Targets:
    """Of `addresses`, those where a connection to `port` would reach a listener of the job
    (`uid`), asking the kernel which listener that is before any connection (blocking)."""
    ok: list[str] = []
    refused: str | None = None
    for addr in addresses:
        try:
            found = sockdiag.listener(addr, port)
        except (sockdiag.DiagError, ValueError) as exc:  # ValueError: not an address
            refused = refused or f"cannot tell who listens on port {port} at {addr}: {exc}"
            continue
        if found is None:
            continue
        if (why := _not_the_jobs(found, port, uid, daemon_uid)) is None:
            ok.append(addr)
        else:
            refused = refused or why
    return Targets(addresses=tuple(ok), refused=refused)


def check_owner(ours: tuple[str, int], theirs: tuple[str, int], uid: int, *, daemon_uid: int) -> str | None:
    """None when the socket that accepted our connection from `ours` to `theirs` belongs to
    `uid` (an accepted socket carries its listener's uid) and is not this daemon's own
    listener's, else why not (blocking: call it from a worker thread)."""
    try:
        accepted = sockdiag.connection(theirs, ours)
        if accepted is None:
            return f"the socket that accepted port {theirs[1]} was not found"
        if accepted.uid != uid:
            return f"port {theirs[1]} is served by uid {accepted.uid}, not by the job (uid {uid})"
        if uid == daemon_uid and (listening := sockdiag.listener(theirs[0], theirs[1])) is not None:
            return _not_the_jobs(listening, theirs[1], uid, daemon_uid)
    except sockdiag.DiagError as exc:
        return f"cannot tell who accepted port {theirs[1]}: {exc.strerror or exc}"
    return None


def interface_addresses(ifname: str | None) -> list[str]:
    """The addresses of interface `ifname` (the mesh's), IPv4 first."""
    if not ifname:
        return []
    import psutil

    import socket as _socket

    found = psutil.net_if_addrs().get(ifname, [])
    v4 = [a.address for a in found if a.family == _socket.AF_INET]
    v6 = [a.address for a in found if a.family == _socket.AF_INET6 and "%" not in a.address]
    return v4 + v6


async def connect(port: int, uid: int, addresses: list[str], *, daemon_uid: int | None = None,
                  timeout: float = CONNECT_TIMEOUT) -> trio.SocketStream:
    """A TCP connection to the job's listener on `port` of this host: of 127.0.0.1, ::1, then
    `addresses`, those where the kernel says a listener of `uid` would accept, the first whose
    accepting socket belongs to `uid`. ForwardRefused when a listener answers that is not the
    job's (and none that is), NothingListens when none answers."""
    import socket as _socket

    daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid
    if uid == 0:
        raise ForwardRefused("forward_root", "the job runs as root on this host: its ports are not forwarded")
    # before any connection: only an address whose listener is the job's is connected to (no
    # member pokes sshd or a root service on 127.0.0.1 through us while the job listens on
    # ::1 or the mesh); the check after the connection below is what decides, a listener may
    # change in between
    plan = await trio.to_thread.run_sync(
        lambda: targets(port, uid, list(dict.fromkeys(["127.0.0.1", "::1", *addresses])), daemon_uid=daemon_uid))
    if not plan.addresses:
        if plan.refused is not None:
            raise ForwardRefused("forward_target", plan.refused)
        raise NothingListens(f"nothing listens on port {port} of this host")
    refused: str | None = None
    for addr in plan.addresses:
        family = _socket.AF_INET6 if ":" in addr else _socket.AF_INET
        try:
            sock = trio.socket.socket(family, _socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        try:
            with trio.fail_after(timeout):
                await sock.connect((addr, port))
        except (OSError, trio.TooSlowError) as exc:
            sock.close()
            if isinstance(exc, OSError) and exc.errno not in (errno.ECONNREFUSED, errno.EADDRNOTAVAIL, errno.ENETUNREACH,
                                                              errno.EHOSTUNREACH, errno.EAFNOSUPPORT):
                refused = refused or f"connecting to {addr}:{port}: {exc.strerror or exc}"
            continue
        ours, theirs = sock.getsockname()[:2], sock.getpeername()[:2]
        why = await trio.to_thread.run_sync(lambda: check_owner(ours, theirs, uid, daemon_uid=daemon_uid))
        if why is None:
            return trio.SocketStream(sock)
        sock.close()
        refused = refused or why
    if refused is not None:
        raise ForwardRefused("forward_target", refused)
    raise NothingListens(f"nothing listens on port {port} of this host")


# --- the pipe -----------------------------------------------------------------------------

class Broken(Exception):
    """One end of a pipe failed (reset, closed under us)."""


class End:
    """One end of a pipe: read up to n bytes (b"" at its end), write, half-close, close.
    `leftover` is what was read past a protocol's last frame before the pipe began."""

    def __init__(self, leftover: bytes = b"") -> None:
        self.leftover = leftover

    async def receive(self, n: int) -> bytes:
        if self.leftover:
            data, self.leftover = self.leftover[:n], self.leftover[n:]
            return data
        return await self._receive(n)

    async def _receive(self, n: int) -> bytes:
        raise NotImplementedError

    async def send(self, data: bytes) -> None:
        raise NotImplementedError

    async def send_eof(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class StreamEnd(End):
    """A trio stream (a TCP or Unix socket)."""

    def __init__(self, stream: trio.SocketStream, leftover: bytes = b"") -> None:
        super().__init__(leftover)
        self.stream = stream

    async def _receive(self, n: int) -> bytes:
        try:
            return await self.stream.receive_some(n)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise Broken(str(exc) or exc.__class__.__name__) from None

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise Broken(str(exc) or exc.__class__.__name__) from None

    async def send_eof(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self.stream.send_eof()

    async def aclose(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self.stream.aclose()


class NetEnd(End):
    """A libp2p stream (yamux): its end is StreamEOF, its half-close `close_write`."""

    def __init__(self, stream: Any, leftover: bytes = b"") -> None:
        super().__init__(leftover)
        self.stream = stream

    async def _receive(self, n: int) -> bytes:
        from libp2p.network.stream.exceptions import StreamEOF

        try:
            return await self.stream.read(n)
        except StreamEOF:
            return b""
        except Exception as exc:  # StreamReset, StreamError, a connection gone
            raise Broken(str(exc) or exc.__class__.__name__) from None

    async def send(self, data: bytes) -> None:
        try:
            await self.stream.write(data)
        except Exception as exc:
            raise Broken(str(exc) or exc.__class__.__name__) from None

    async def send_eof(self) -> None:
        close_write = getattr(self.stream, "close_write", None)
        with contextlib.suppress(Exception):
            await (close_write() if close_write is not None else self.stream.close())

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.stream.close()


@dataclass(slots=True)
class Piped:
    """What a pipe carried and why it ended."""

    sent: int = 0  # a -> b
    received: int = 0  # b -> a
    why: str = "closed"


async def pipe(a: End, b: End, *, idle: float = IDLE_TIMEOUT, chunk: int = CHUNK,
               stop: trio.Event | None = None) -> Piped:
    """Bytes both ways between `a` and `b` until both have ended (each end's EOF is passed on
    as a half-close), either fails, nothing moves for `idle` seconds, or `stop` is set. Reads
    at most `chunk` bytes at a time. Closes neither end."""
    out = Piped()
    last = trio.current_time()

    async def one(src: End, dst: End, forward: bool) -> None:
        nonlocal last
        while True:
            data = await src.receive(chunk)
            if not data:
                await dst.send_eof()
                return
            last = trio.current_time()
            await dst.send(data)
            if forward:
                out.sent += len(data)
            else:
                out.received += len(data)
            last = trio.current_time()

    async def both(cancel: trio.CancelScope) -> None:
        try:
            async with trio.open_nursery() as n:
                n.start_soon(one, a, b, True)
                n.start_soon(one, b, a, False)
        except* Broken as group:
            out.why = f"broken: {group.exceptions[0]}"
        cancel.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(both, nursery.cancel_scope)
        if stop is not None:
            async def stopper() -> None:
                await stop.wait()
                out.why = "the job's ranks ended"
                nursery.cancel_scope.cancel()

            nursery.start_soon(stopper)
        while True:
            await trio.sleep_until(last + idle)
            if trio.current_time() >= last + idle:
                out.why = f"idle for {idle:g} s"
                nursery.cancel_scope.cancel()
                break
    return out


# --- a host's forwards, per job ------------------------------------------------------------

Key = tuple[str, str]  # (coordinator, job), as the ledger keys a hold


@dataclass(slots=True)
class _Job:
    uid: int
    open: int = 0
    ended: trio.Event = field(default_factory=trio.Event)


class Forwards:
    """The jobs whose ports this host forwards (their ranks run here, as `uid`), and their
    forwards under way: at most `per_job` each, `per_coordinator` of one coordinator's jobs,
    and `rate` new ones a second per coordinator (a token bucket of `burst`); all end when
    the job's ranks do. Time comes in as `now` (seconds, any monotonic clock)."""

    def __init__(self, per_job: int = MAX_PER_JOB, per_coordinator: int = MAX_PER_COORDINATOR, *,
                 rate: float = RATE, burst: int = BURST) -> None:
        self.per_job = per_job
        self.per_coordinator = per_coordinator
        self.rate = rate
        self.burst = burst
        self._jobs: dict[Key, _Job] = {}
        # coordinator -> (tokens, when counted); kept only while it has a job running here
        self._buckets: dict[str, tuple[float, float]] = {}

    def running(self, key: Key, uid: int) -> None:
        """The job's ranks run here as `uid`: its ports may be forwarded."""
        self._jobs[key] = _Job(uid=uid)

    def ended(self, key: Key) -> None:
        """The job's ranks ended here: its forwards end, and no new one starts."""
        job = self._jobs.pop(key, None)
        if job is not None:
            job.ended.set()
        if not any(k[0] == key[0] for k in self._jobs):
            self._buckets.pop(key[0], None)

    def uid(self, key: Key) -> int | None:
        job = self._jobs.get(key)
        return None if job is None else job.uid

    def open(self, key: Key) -> int:
        job = self._jobs.get(key)
        return 0 if job is None else job.open

    def _take_token(self, coordinator: str, now: float) -> bool:
        tokens, then = self._buckets.get(coordinator, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - then) * self.rate)
        if tokens < 1.0:
            self._buckets[coordinator] = (tokens, now)
            return False
        self._buckets[coordinator] = (tokens - 1.0, now)
        return True

    @contextlib.contextmanager
    def slot(self, key: Key, now: float) -> Iterator[trio.Event]:
        """One forward of the job while it lasts; yields the event set when the job's ranks end.
        ForwardRefused when the job is not running here, has `per_job` forwards already, its
        coordinator's jobs have `per_coordinator`, or that coordinator started `burst` in the
        last moments (more than `rate` a second)."""
        job = self._jobs.get(key)
        if job is None:
            raise ForwardRefused("not_running", f"job {key[1]} is not running on this host")
        if job.open >= self.per_job:
            raise ForwardRefused("too_many_forwards", f"job {key[1]} already has {self.per_job} forwards on this host")
        if sum(j.open for k, j in self._jobs.items() if k[0] == key[0]) >= self.per_coordinator:
            raise ForwardRefused("too_many_forwards", f"this coordinator's jobs already have {self.per_coordinator} "
                                 "forwards on this host")
        if not self._take_token(key[0], now):
            raise ForwardRefused("forward_rate", f"this coordinator starts more than {self.rate:g} forwards a second "
                                 "on this host: try again shortly")
        job.open += 1
        try:
            yield job.ended
        finally:
            job.open -= 1
