"""The control socket: a thin trio driver around framing and the dispatcher.

Rules:
- Each connection is its own task, and each call its own task within it, so a silent
  client, a slow reader or a long stream never holds up anyone else.
- A protocol error (truncated, oversize or non-msgpack frame, a malformed request, an
  unknown method, bad params, a refused call) gets an error reply where one can be sent
  and the connection is closed. A handler's failure is answered and the connection stays.
- Sends are bounded in time; a client that stops reading is dropped after SEND_TIMEOUT.
- Connections are bounded per local user (`Limits`): a uid that does not administer holds
  at most `per_uid`, and all of them together leave `admin_reserve` of `max_connections` to
  root and the daemon's user, so no group member (nor anyone the socket's mode lets in) can
  lock the administrator out (issue 23, finding 15). A connection past its limit gets a
  BUSY error saying which limit, and is closed. A connection with no call under way that
  sends nothing for `idle_timeout` is closed: idle ones do not pile up.
- A `takeover` method (protocol.Takeover) must be the only call on its connection, and it
  runs in the read loop itself, so no byte after its request is read as a frame: once its
  reply is sent, the connection is the handler's byte pipe until it ends, then closed.
"""

from __future__ import annotations

import errno
import math
import os
import socket as _socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio

from .framing import NOT_YET, FrameDecoder, FramingError, FrameTooLarge, decode, encode_frame
from .protocol import (Access, Call, Caller, Dispatcher, ErrorCode, RpcError, Takeover, access_of, end_of_stream,
                       error_reply, reply)

log = structlog.get_logger("swarmd.rpc")

SEND_TIMEOUT = 10.0  # a reader this slow is gone or hostile
FRAME_TIMEOUT = 30.0  # a frame that has started must finish within this
THREAD_DECODE = 256 * 1024  # a larger body is decoded in a worker thread, not on the event loop
MAX_CALLS_PER_CONNECTION = 64

Observer = Callable[[str, ErrorCode | None], None]


class SocketInUse(Exception):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """How much of the control socket the local users may hold."""

    # connections at once, all users together (each is a task and a few buffers)
    max_connections: int = 256
    # of those, what a uid that does not administer may hold: swarmctl uses one a command,
    # `jobs forward` one a relayed connection (16 at once), a watch one each
    per_uid: int = 32
    # of max_connections, what only root and the daemon's user may use: whatever the
    # others hold, an administrator can still connect (and cancel their jobs)
    admin_reserve: int = 32
    # seconds a connection with no call under way may send nothing before it is closed
    idle_timeout: float = 300.0

    def refusal(self, caller: Caller, total: int, of_uid: int) -> str | None:
        """None when `caller` may open one more connection while `total` are open, `of_uid`
        of them its uid's; else why not."""
        if caller.access >= Access.ADMIN:
            if total >= self.max_connections:
                return f"too many connections ({self.max_connections})"
            return None
        if of_uid >= self.per_uid:
            return f"too many connections from uid {caller.uid} ({self.per_uid} at most)"
        if total >= self.max_connections - self.admin_reserve:
            return (f"too many connections ({self.max_connections - self.admin_reserve}; the rest are kept for "
                    "root and the daemon's user)")
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessPolicy:
    """Turns a connection's kernel credentials into a `Caller` and its `Access` level."""

    daemon_uid: int
    group_gid: int | None

    def caller(self, pid: int, uid: int, gid: int, groups: set[int]) -> Caller:
        return Caller(pid=pid, uid=uid, gid=gid,
                      access=access_of(uid, groups | {gid}, daemon_uid=self.daemon_uid,
                                       group_gid=self.group_gid))


SO_PEERGROUPS = getattr(_socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; Python names it not


def _peer_groups(sock: Any, pid: int, uid: int) -> set[int]:
    """The peer's supplementary groups as they were when it connected (the kernel's view, not
    /etc/group's). Read from the socket: /proc/PID is only a fallback for old kernels, and
    trusted only if that pid still belongs to the same uid (a pid can be reused)."""
    for size in (256, 65536):  # NGROUPS_MAX is 65536
        try:
            raw = sock.getsockopt(_socket.SOL_SOCKET, SO_PEERGROUPS, 4 * size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue
            break
        return set(struct.unpack(f"{len(raw) // 4}I", raw))
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return set()
    if int(fields.get("Uid", "-1 ").split()[0]) != uid:
        return set()
    return {int(g) for g in fields.get("Groups", "").split()}


def _peer_credentials(sock: Any) -> tuple[int, int, int, set[int]]:
    creds = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid, _peer_groups(sock, pid, uid)


def _refuse_live_socket(path: Path) -> None:
    """Remove a stale socket; refuse to steal one another daemon is serving."""
    if not path.exists() and not path.is_symlink():
        return
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink(missing_ok=True)
    else:
        raise SocketInUse(f"{path} is served by another process (is swarmd already running?)")
    finally:
        probe.close()


async def bind_unix(path: Path, *, mode: int = 0o660, group_gid: int | None = None) -> trio.SocketListener:
    path.parent.mkdir(parents=True, exist_ok=True)
    _refuse_live_socket(path)
    sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)  # the socket is never wider than `mode`, not even briefly
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old)
    if group_gid is not None:
        os.chown(path, -1, group_gid)
    os.chmod(path, mode)
    sock.listen(128)
    return trio.SocketListener(sock)


class RpcServer:
    def __init__(self, dispatcher: Dispatcher, policy: AccessPolicy, *,
                 observer: Observer | None = None, limits: Limits = Limits()) -> None:
        self._dispatcher = dispatcher
        self._policy = policy
        self._observer = observer or (lambda method, code: None)
        self._limits = limits
        self._connections = 0
        self._of_uid: dict[int, int] = {}  # open connections per uid (only uids that hold one)

    async def serve(self, listener: trio.SocketListener, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with listener, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                stream = await listener.accept()
                nursery.start_soon(self._connection, stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                try:
                    pid, uid, gid, groups = _peer_credentials(stream.socket)
                except OSError:
                    return  # gone before it was looked at
                caller = self._policy.caller(pid, uid, gid, groups)
                conn = _Conn(stream, self, caller)
                if (why := self._limits.refusal(caller, self._connections, self._of_uid.get(uid, 0))) is not None:
                    log.info("rpc connection refused", pid=pid, uid=uid, why=why)
                    await conn.send(error_reply(None, ErrorCode.BUSY, why))
                    return
                self._connections += 1
                self._of_uid[uid] = self._of_uid.get(uid, 0) + 1
                try:
                    await conn.run()
                finally:
                    self._connections -= 1
                    if (left := self._of_uid.pop(uid) - 1) > 0:
                        self._of_uid[uid] = left
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away or was dropped for not reading
        except* Exception:
            log.exception("rpc connection failed")  # a bug; this connection only


class _Conn:
    def __init__(self, stream: trio.SocketStream, server: RpcServer, caller: Caller) -> None:
        self.stream = stream
        self.server = server
        self.caller = caller
        self.send_lock = trio.Lock()
        self.in_flight = 0
        self.waiting: trio.CancelScope | None = None  # the read loop's wait for bytes, while it waits

    async def send(self, message: dict[str, Any]) -> None:
        frame = encode_frame(message)
        async with self.send_lock:
            with trio.move_on_after(SEND_TIMEOUT) as scope:
                await self.stream.send_all(frame)
            if scope.cancelled_caught:
                raise trio.BrokenResourceError("client stopped reading")

    async def run(self) -> None:
        caller = self.caller
        pid, uid = caller.pid, caller.uid
        log.debug("rpc connection", pid=pid, uid=uid, gid=caller.gid, access=caller.access.name)
        decoder = FrameDecoder()
        async with trio.open_nursery() as calls:
            try:
                await self._read_loop(decoder, caller, calls)
            except RpcError as exc:
                self.server._observer(exc.method or "<invalid>", exc.code)
                log.info("rpc request refused", pid=pid, uid=uid, code=exc.code.name, error=exc.message)
                try:
                    await self.send(exc.reply())
                finally:
                    calls.cancel_scope.cancel()  # close: the stream can no longer be trusted

    def _idle_deadline(self) -> float:
        """When a connection that sends nothing more is closed: never while a call is under way."""
        return trio.current_time() + self.server._limits.idle_timeout if self.in_flight == 0 else math.inf

    async def _read_loop(self, decoder: FrameDecoder, caller: Caller, calls: trio.Nursery) -> None:
        while True:
            pending = decoder.pending
            data: bytes | None = None
            deadline = trio.current_time() + FRAME_TIMEOUT if pending else self._idle_deadline()
            with trio.CancelScope(deadline=deadline) as self.waiting:
                data = await self.stream.receive_some(1 << 16)
            self.waiting = None
            if data is None:  # its deadline came first
                if pending:
                    raise RpcError(ErrorCode.PARSE_ERROR,
                                   f"incomplete frame ({pending} bytes) not finished within {FRAME_TIMEOUT:g} s")
                log.debug("rpc connection idle: closed", pid=caller.pid, uid=caller.uid,
                          idle_timeout=self.server._limits.idle_timeout)
                return
            if not data:
                if decoder.pending:
                    raise RpcError(ErrorCode.PARSE_ERROR,
                                   f"truncated frame: stream ended inside a frame ({decoder.pending} bytes buffered)")
                return  # in-flight calls finish, then the nursery closes
            decoder.feed(data)
            while (message := await self._next_message(decoder)) is not NOT_YET:
                call = self.server._dispatcher.prepare(message, caller)
                if call.method.takeover:
                    if self.in_flight:
                        raise RpcError(ErrorCode.BUSY, f"{call.method.name} must be the only call on its connection",
                                       request_id=call.id, method=call.method.name)
                    if await self._take_over(call, decoder):
                        return
                    continue
                if self.in_flight >= MAX_CALLS_PER_CONNECTION:
                    raise RpcError(ErrorCode.BUSY, f"more than {MAX_CALLS_PER_CONNECTION} calls in flight",
                                   request_id=call.id, method=call.method.name)
                self.in_flight += 1
                calls.start_soon(self._run_call, call)

    @staticmethod
    async def _next_message(decoder: FrameDecoder) -> Any:
        try:
            body = decoder.next_body()
            if body is NOT_YET or len(body) <= THREAD_DECODE:
                return body if body is NOT_YET else decode(body)
            return await trio.to_thread.run_sync(decode, body)
        except FrameTooLarge as exc:
            raise RpcError(ErrorCode.FRAME_TOO_LARGE, str(exc)) from None
        except FramingError as exc:
            raise RpcError(ErrorCode.PARSE_ERROR, str(exc)) from None

    async def _take_over(self, call: Call, decoder: FrameDecoder) -> bool:
        """Run a takeover call in the read loop; True when the connection was taken over (or
        refused) and is done, False when the handler answered as a plain call."""
        name = call.method.name
        try:
            result = await call.method.handler(call.params, call.caller)
        except RpcError as exc:
            self.server._observer(name, exc.code)
            await self.send(error_reply(call.id, exc.code, exc.message))
            return True  # a refused pipe: whatever the client sent after it is not frames
        except Exception as exc:  # a bug: answer, log, close
            log.exception("rpc handler crashed", method=name)
            self.server._observer(name, ErrorCode.INTERNAL_ERROR)
            await self.send(error_reply(call.id, ErrorCode.INTERNAL_ERROR,
                                        f"internal error in {name}: {type(exc).__name__}: {exc}"))
            return True
        self.server._observer(name, None)
        if not isinstance(result, Takeover):
            await self.send(reply(call.id, result))
            return False
        try:
            await self.send(reply(call.id, result.result))
            await result.run(self.stream, decoder.rest())
        finally:
            with trio.CancelScope(shield=True):
                await result.close()
        return True

    async def _run_call(self, call: Call) -> None:
        name = call.method.name
        code: ErrorCode | None = None
        counted = False

        def count(outcome: ErrorCode | None) -> None:
            """Once per call, before its answer goes out: a client that reads the metrics
            after its answer sees its call counted."""
            nonlocal counted
            if not counted:
                counted = True
                self.server._observer(name, outcome)

        try:
            if call.method.streams:
                async for item in call.method.handler(call.params, call.caller):
                    await self.send(reply(call.id, item, final=False))
                count(None)
                await self.send(end_of_stream(call.id))
            else:
                result = await call.method.handler(call.params, call.caller)
                count(None)
                await self.send(reply(call.id, result))
        except RpcError as exc:
            code = exc.code
            count(code)
            await self.send(error_reply(call.id, exc.code, exc.message))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise
        except Exception as exc:  # a bug: answer, log, keep serving
            code = ErrorCode.INTERNAL_ERROR
            log.exception("rpc handler crashed", method=name)
            count(code)
            await self.send(error_reply(call.id, code, f"internal error in {name}: {type(exc).__name__}: {exc}"))
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self.waiting is not None:  # idle from now on
                self.waiting.deadline = self._idle_deadline()
            count(code)
