"""Forwarding a TCP port of a running job (`swarmctl jobs forward`): who owns a listener, a
byte pipe with limits, and a host's forwards per job.

Theory of operation. `swarmctl jobs forward ID LOCAL[:REMOTE]` accepts on the user's machine
and opens one control connection per accepted connection (`jobs.forward`); the coordinator
asks the job's first host (node rank 0) over the job protocol (`forward {port}`), and after
each side's OK answer every hop is a raw byte pipe (`pipe`): swarmctl ⇄ control socket ⇄
coordinator ⇄ libp2p stream ⇄ head host ⇄ TCP ⇄ the job's listener.

Rules (the head host's):
- Only a listener of the job: the host connects to 127.0.0.1:PORT (then ::1, then its
  overlay addresses), and the socket that accepted that connection must belong to the job's
  uid (`accepting_uid`: the `uid` column of /proc/net/tcp{,6} for the socket whose local
  address is our connection's remote end; an accepted socket carries its listener's uid).
  So a forward never reaches sshd, the daemon's own ports or another job. A job that runs
  as root (no per-job uid, `job_user` root) is never forwarded; one that runs as the
  daemon's own user (no root, no sandbox) is refused this daemon's own listeners
  (`own_inodes`). Without per-job uids, two jobs of the same user are not told apart.
- At most `MAX_PER_JOB` forwards of one job at once (`Forwards.slot`); a pipe with no byte
  either way for `IDLE_TIMEOUT` is closed; reads are at most `CHUNK` bytes; when the job's
  ranks end on the host its forwards end (`Forwards.close`).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

MAX_PER_JOB = 16  # forwards of one job at once on its head host (each holds a TCP and a stream)
# forwards of one coordinator's jobs together on a host: well below the gossip guard's 64
# streams per peer, so forwards alone never leave that coordinator's start and cancel streams
# to this host without room (another user's cancel among them)
MAX_PER_COORDINATOR = 24
IDLE_TIMEOUT = 600.0  # seconds without a byte either way after which a forward is closed
CHUNK = 64 * 1024  # bytes read at most per step: a pipe holds at most this per direction
CONNECT_TIMEOUT = 5.0  # seconds to connect to a listener on this host
TCP_LISTEN, TCP_TIME_WAIT, TCP_CLOSE = 0x0A, 0x06, 0x07

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class ForwardRefused(Exception):
    """A forward this host will not make; `code` is the metric label, the message the reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class NothingListens(Exception):
    """No listener on the port at any of this host's addresses (the job's service is not up)."""


# --- who owns a socket: /proc/net/tcp and tcp6 ------------------------------------------------

@dataclass(frozen=True, slots=True)
class TcpSocket:
    """One row of /proc/net/tcp or tcp6."""

    local: tuple[Address, int]
    remote: tuple[Address, int]
    state: int
    uid: int
    inode: int


def _address(hex_addr: str) -> Address:
    """The kernel writes an address as 32-bit words, each in this host's byte order."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) not in (4, 16):
        raise ValueError(f"an address of {len(raw)} bytes")
    swapped = b"".join(int.from_bytes(raw[i:i + 4], "big").to_bytes(4, sys.byteorder) for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(swapped)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped  # a dual-stack socket's IPv4 peer is the same peer
    return addr


def _endpoint(text: str) -> tuple[Address, int]:
    addr, _, port = text.partition(":")
    return _address(addr), int(port, 16)


def parse_tcp_table(text: str) -> list[TcpSocket]:
    """The sockets of a /proc/net/tcp or tcp6 text; a malformed line is skipped."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        try:
            out.append(TcpSocket(local=_endpoint(f[1]), remote=_endpoint(f[2]), state=int(f[3], 16),
                                 uid=int(f[7]), inode=int(f[9])))
        except ValueError:
            continue
    return out


def _normal(addr: str) -> Address:
    a = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def read_tables(proc: Path = Path("/proc")) -> list[TcpSocket]:
    sockets: list[TcpSocket] = []
    for name in ("tcp", "tcp6"):
        try:
            sockets += parse_tcp_table((proc / "net" / name).read_text())
        except FileNotFoundError:  # no IPv6 on this host
            continue
    return sockets


def accepting_uid(ours: tuple[str, int], theirs: tuple[str, int], sockets: list[TcpSocket]) -> int | None:
    """The uid of the socket at the other end of our connection from `ours` to `theirs` (the
    one its listener accepted: it carries the listener's uid), or None when there is none."""
    want_local, want_remote = (_normal(theirs[0]), theirs[1]), (_normal(ours[0]), ours[1])
    for s in sockets:
        if s.local == want_local and s.remote == want_remote and s.state not in (TCP_TIME_WAIT, TCP_CLOSE):
            return s.uid
    return None


def listener_inodes(theirs: tuple[str, int], sockets: list[TcpSocket]) -> set[int]:
    """Inodes of the listeners that could have accepted a connection to `theirs`."""
    addr, port = _normal(theirs[0]), theirs[1]
    wildcard = {ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::")}
    return {s.inode for s in sockets
            if s.state == TCP_LISTEN and s.local[1] == port and (s.local[0] == addr or s.local[0] in wildcard)}


def own_inodes(proc: Path = Path("/proc")) -> set[int]:
    """Inodes of this process's own sockets."""
    found = set()
    for fd in (proc / "self" / "fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    return found


def listeners(port: int, proc: Path = Path("/proc")) -> set[int]:
    """The uids of the sockets listening on TCP `port` of this host, at any address (blocking)."""
    return {s.uid for s in read_tables(proc) if s.state == TCP_LISTEN and s.local[1] == port}


def check_owner(ours: tuple[str, int], theirs: tuple[str, int], uid: int, *, daemon_uid: int,
                proc: Path = Path("/proc")) -> str | None:
    """None when the listener that accepted our connection belongs to `uid`, else why not
    (blocking: call it from a worker thread)."""
    sockets = read_tables(proc)
    owner = accepting_uid(ours, theirs, sockets)
    if owner is None:
        return f"the socket that accepted port {theirs[1]} was not found in /proc/net/tcp"
    if owner != uid:
        return f"port {theirs[1]} is served by uid {owner}, not by the job (uid {uid})"
    if uid == daemon_uid and listener_inodes(theirs, sockets) & own_inodes(proc):
        return f"port {theirs[1]} is this daemon's own"
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
    """A TCP connection to the job's listener on `port` of this host: 127.0.0.1, ::1, then
    `addresses`, the first whose accepting socket belongs to `uid`. ForwardRefused when one
    answers that is not the job's (and none that is), NothingListens when none answers."""
    import socket as _socket

    daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid
    if uid == 0:
        raise ForwardRefused("forward_root", "the job runs as root on this host: its ports are not forwarded")
    # before any connection: a port whose listeners are none of the job's is refused without
    # the daemon ever connecting to it (no member pokes sshd through us); the check after the
    # connection below is what decides, a listener may change in between
    listening = await trio.to_thread.run_sync(listeners, port)
    if not listening:
        raise NothingListens(f"nothing listens on port {port} of this host")
    if uid not in listening:
        raise ForwardRefused("forward_target", f"port {port} is served by uid {min(listening)}, not by the job "
                                               f"(uid {uid})")
    refused: str | None = None
    for addr in dict.fromkeys(["127.0.0.1", "::1", *addresses]):
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
    forwards under way: at most `per_job` each; all end when the job's ranks do."""

    def __init__(self, per_job: int = MAX_PER_JOB, per_coordinator: int = MAX_PER_COORDINATOR) -> None:
        self.per_job = per_job
        self.per_coordinator = per_coordinator
        self._jobs: dict[Key, _Job] = {}

    def running(self, key: Key, uid: int) -> None:
        """The job's ranks run here as `uid`: its ports may be forwarded."""
        self._jobs[key] = _Job(uid=uid)

    def ended(self, key: Key) -> None:
        """The job's ranks ended here: its forwards end, and no new one starts."""
        job = self._jobs.pop(key, None)
        if job is not None:
            job.ended.set()

    def uid(self, key: Key) -> int | None:
        job = self._jobs.get(key)
        return None if job is None else job.uid

    def open(self, key: Key) -> int:
        job = self._jobs.get(key)
        return 0 if job is None else job.open

    @contextlib.contextmanager
    def slot(self, key: Key) -> Iterator[trio.Event]:
        """One forward of the job while it lasts; yields the event set when the job's ranks end.
        ForwardRefused when the job is not running here or has `per_job` forwards already."""
        job = self._jobs.get(key)
        if job is None:
            raise ForwardRefused("not_running", f"job {key[1]} is not running on this host")
        if job.open >= self.per_job:
            raise ForwardRefused("too_many_forwards", f"job {key[1]} already has {self.per_job} forwards on this host")
        if sum(j.open for k, j in self._jobs.items() if k[0] == key[0]) >= self.per_coordinator:
            raise ForwardRefused("too_many_forwards", f"this coordinator's jobs already have {self.per_coordinator} "
                                 "forwards on this host")
        job.open += 1
        try:
            yield job.ended
        finally:
            job.open -= 1
