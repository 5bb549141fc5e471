"""Every error path of the control socket, against a real daemon: a clear error reply where
one can be sent, the connection closed, and the daemon still serving everyone else. And the
connection limits against a server in this process (`Limits`, small ones): a uid at its
cap, or all non-administrators together, cannot lock out root; an idle connection is
closed, one with a call under way is not."""

import contextlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import pytest
import trio

from conftest import root_only
from swarmd.rpc.client import Client, RemoteError
from swarmd.rpc.framing import NOT_YET, FrameDecoder, encode_frame
from swarmd.rpc.protocol import Access, Caller, Dispatcher, ErrorCode, Method
from swarmd.rpc.server import AccessPolicy, Limits, RpcServer, bind_unix


def raw(daemon, timeout=5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(daemon.socket))
    return s


def replies_until_closed(s: socket.socket) -> list:
    """Every reply the daemon sends before it closes the connection."""
    decoder, out = FrameDecoder(), []
    while data := s.recv(65536):
        decoder.feed(data)
        while (m := decoder.next_message()) is not NOT_YET:
            out.append(m)
    return out


def error_after(daemon, payload: bytes, *, half_close: bool = True) -> dict:
    with raw(daemon) as s:
        s.sendall(payload)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        replies = replies_until_closed(s)
    assert len(replies) == 1, replies
    return replies[0]["error"]


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("payload, code, text", [
    (frame(b"\xc1"), ErrorCode.PARSE_ERROR, "not valid msgpack"),
    (struct.pack(">I", 100) + b"abc", ErrorCode.PARSE_ERROR, "truncated frame"),
    (struct.pack(">I", 17 * 1024 * 1024), ErrorCode.FRAME_TOO_LARGE, "exceeds the 16777216-byte limit"),
    (frame(msgpack.packb("hello")), ErrorCode.INVALID_REQUEST, "must be a map, got str"),
    (encode_frame({"id": 1, "method": "reboot"}), ErrorCode.METHOD_NOT_FOUND, "unknown method 'reboot'"),
    (encode_frame({"id": 1, "method": "log.level", "params": {"level": 5}}), ErrorCode.INVALID_PARAMS,
     "parameter 'level' must be string"),
    (encode_frame({"id": 1, "method": "status.watch", "params": {"interval": 0.001}}),
     ErrorCode.INVALID_PARAMS, "'interval' must be at least"),
])
def test_bad_input_gets_an_error_and_the_daemon_keeps_serving(daemon, payload, code, text):
    error = error_after(daemon, payload, half_close=code != ErrorCode.FRAME_TOO_LARGE)
    assert error["code"] == code
    assert text in error["message"]
    assert daemon.call("status")["peer_id"]


def test_a_handler_error_keeps_the_connection(daemon):
    with daemon.client() as c:
        with pytest.raises(RemoteError) as err:
            c.call("log.level", level="loud")
        assert err.value.code == ErrorCode.INVALID_PARAMS
        assert "must be one of" in err.value.message
        assert c.call("status")["log_level"] == "info"  # same connection, still served


def test_silent_and_half_sent_clients_do_not_block_others(daemon):
    silent = [raw(daemon) for _ in range(20)]
    half = raw(daemon)
    half.sendall(struct.pack(">I", 1000) + b"x" * 10)  # a frame that never finishes
    try:
        started = time.monotonic()
        for _ in range(20):
            assert daemon.call("status")
        assert time.monotonic() - started < 5
    finally:
        for s in [*silent, half]:
            s.close()


def test_a_client_that_stops_reading_does_not_block_others(daemon):
    hog = raw(daemon)
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.sendall(encode_frame({"id": 1, "method": "status.watch", "params": {"interval": 0.1}}))
    try:
        for _ in range(30):  # three seconds of snapshots pile up unread on the hog
            assert daemon.call("status")
            time.sleep(0.1)
    finally:
        hog.close()
    assert daemon.call("status")


def test_many_calls_on_one_connection_are_answered_by_id(daemon):
    with raw(daemon) as s:
        s.sendall(b"".join(encode_frame({"id": i, "method": "status"}) for i in range(50)))
        s.shutdown(socket.SHUT_WR)
        replies = replies_until_closed(s)
    assert sorted(r["id"] for r in replies) == list(range(50))
    assert all(r["final"] and r["result"]["peer_id"] for r in replies)


def test_streaming_ends_with_a_final_reply(daemon):
    with daemon.client() as c:
        snapshots = list(c.stream("status.watch", interval=0.1, count=3))
    assert len(snapshots) == 3
    assert snapshots[0]["uptime_s"] < snapshots[-1]["uptime_s"]


def test_socket_mode_is_0660(daemon):
    assert daemon.socket.stat().st_mode & 0o777 == 0o660


def as_nobody(fn, *args) -> str:
    """Run ``fn(*args)`` in a forked child with uid/gid 65534; its result or its error."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = repr(fn(*args))
        except BaseException as exc:
            out = f"{type(exc).__name__}: {exc}"
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        return f.read()


def status_then_mutate(path: str) -> tuple:
    with Client(path, timeout=5) as c:
        peer = c.call("status")["peer_id"]
        try:
            c.call("log.level", level="debug")
        except RemoteError as exc:
            return peer, exc.code, exc.message
        return peer, "allowed"


@root_only()
def test_mutation_refused_to_a_caller_outside_the_group(daemon):
    os.chmod(daemon.socket, 0o666)  # an admin loosened the socket: reading is fine, changing is not
    from test_rpc_access import let_others_reach

    let_others_reach(daemon.socket)  # nobody reaches it through pytest's 0700 dirs
    outcome = as_nobody(status_then_mutate, str(daemon.socket))
    peer = daemon.call("status")["peer_id"]
    assert outcome.startswith(f"('{peer}', {int(ErrorCode.PERMISSION_DENIED)}, "), outcome  # status was fine
    assert "log.level: refused: it needs root or the daemon's user; uid 65534 may only read" in outcome
    assert daemon.call("status")["log_level"] == "info"
    assert daemon.call("log.level", level="debug")["previous"] == "info"  # root may


def test_peer_groups_come_from_the_socket_and_proc_only_for_the_same_uid():
    import errno

    from swarmd.rpc.server import _peer_groups

    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert _peer_groups(a, os.getpid(), os.getuid()) == set(os.getgroups())  # SO_PEERGROUPS

    class OldKernel:
        def getsockopt(self, *args):
            raise OSError(errno.ENOPROTOOPT, "Protocol not available")

    assert _peer_groups(OldKernel(), os.getpid(), os.getuid()) == set(os.getgroups())  # /proc/PID/status
    assert _peer_groups(OldKernel(), os.getpid(), os.getuid() + 1) == set(), \
        "a pid now of another uid (reused) is not trusted"


# --- connection limits (issue 23, finding 15) ------------------------------------------------

def caller(uid: int, access: Access) -> Caller:
    return Caller(pid=1, uid=uid, gid=uid, access=access)


@pytest.mark.parametrize("who, total, of_uid, refused", [
    (caller(1000, Access.JOBS), 0, 0, None),
    (caller(1000, Access.JOBS), 3, 1, None),
    (caller(1000, Access.JOBS), 3, 2, "too many connections from uid 1000 (2 at most)"),
    (caller(1001, Access.READ), 4, 0, "too many connections (4; the rest are kept for root and the daemon's user)"),
    (caller(0, Access.ADMIN), 4, 4, None),  # the reserve, and no cap of its own
    (caller(0, Access.ADMIN), 5, 5, None),
    (caller(0, Access.ADMIN), 6, 6, "too many connections (6)"),
])
def test_limits_per_uid_and_the_reserve_for_administrators(who, total, of_uid, refused):
    assert Limits(max_connections=6, per_uid=2, admin_reserve=2).refusal(who, total, of_uid) == refused


async def ping(params, caller):
    return "pong"


async def watch(params, caller):
    yield "tick"
    await trio.sleep_forever()


@contextlib.asynccontextmanager
async def serving(limits: Limits):
    """A control socket in this process, open to every uid (0666 in a 0711 directory), with
    `ping` and `watch` for anyone; its path."""
    directory = Path(tempfile.mkdtemp(prefix="swarmd-test-rpc-"))
    directory.chmod(0o711)
    path = directory / "ctl.sock"
    methods = [Method(name="ping", handler=ping, doc="", access=Access.READ),
               Method(name="watch", handler=watch, doc="", access=Access.READ, streams=True)]
    server = RpcServer(Dispatcher(methods), AccessPolicy(daemon_uid=os.geteuid(), group_gid=None), limits=limits)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, await bind_unix(path, mode=0o666))
            yield path
            nursery.cancel_scope.cancel()
    finally:
        path.unlink(missing_ok=True)
        directory.rmdir()


async def one_message(stream: trio.SocketStream, decoder: FrameDecoder) -> dict | None:
    """The next message, or None when the server closed the connection."""
    while (m := decoder.next_message()) is NOT_YET:
        if not (data := await stream.receive_some(65536)):
            return None
        decoder.feed(data)
    return m


async def test_an_idle_connection_is_closed_and_one_with_a_call_under_way_is_not(autojump_clock):
    async with serving(Limits(idle_timeout=60.0)) as path:
        idle, answered, busy = [await trio.open_unix_socket(str(path)) for _ in range(3)]
        started = trio.current_time()
        await answered.send_all(encode_frame({"id": 1, "method": "ping"}))
        await busy.send_all(encode_frame({"id": 2, "method": "watch"}))
        assert (await one_message(answered, FrameDecoder()))["result"] == "pong"
        busy_decoder = FrameDecoder()
        assert (await one_message(busy, busy_decoder))["result"] == "tick"
        assert await idle.receive_some(1) == b"", "an idle connection is closed"
        assert 60.0 <= trio.current_time() - started < 61.0
        assert await answered.receive_some(1) == b"", "idle after its answer: closed"
        assert 60.0 <= trio.current_time() - started < 61.0
        await trio.sleep(600.0)  # ten idle timeouts while its watch is under way
        await busy.send_all(encode_frame({"id": 3, "method": "ping"}))
        assert (await one_message(busy, busy_decoder)) == {"id": 3, "result": "pong", "final": True}
        for s in (idle, answered, busy):
            await s.aclose()


HOLDER = """
import socket, struct, sys
path, n, request = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(20)
    s.connect(path)
    try:
        s.sendall(request)
    except OSError:  # refused and closed before it read: its reason is there to read
        pass
    got = b""
    while len(got) < 4 or len(got) < 4 + struct.unpack(">I", got[:4])[0]:
        data = s.recv(65536)
        if not data:
            break
        got += data
    print(got.hex(), flush=True)
    held.append(s)
sys.stdin.read()
"""


def hold_connections(path: Path, uid: int, n: int) -> tuple[subprocess.Popen, list[dict]]:
    """A process of `uid` that opens `n` connections one after another, each asking `ping`,
    and holds them open until its stdin closes; and the first reply on each."""
    request = encode_frame({"id": 1, "method": "ping"}).hex()
    proc = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c",
                             HOLDER, str(path), str(n), request], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd="/")
    replies = []
    for _ in range(n):
        decoder = FrameDecoder()
        decoder.feed(bytes.fromhex(proc.stdout.readline()))
        replies.append(decoder.next_message())
    return proc, replies


@root_only()
async def test_users_holding_their_connections_cannot_lock_out_root():
    limits = Limits(max_connections=6, per_uid=2, admin_reserve=2, idle_timeout=300.0)
    pong = {"id": 1, "result": "pong", "final": True}
    procs = []
    try:
        async with serving(limits) as path:
            proc, replies = await trio.to_thread.run_sync(hold_connections, path, 65534, 3)
            procs.append(proc)
            assert replies == [pong, pong, {"id": None, "final": True, "error": {
                "code": ErrorCode.BUSY, "message": "too many connections from uid 65534 (2 at most)"}}]
            proc, replies = await trio.to_thread.run_sync(hold_connections, path, 61000, 2)
            procs.append(proc)
            assert replies == [pong, pong]
            proc, replies = await trio.to_thread.run_sync(hold_connections, path, 61001, 1)
            procs.append(proc)
            assert replies == [{"id": None, "final": True, "error": {
                "code": ErrorCode.BUSY,
                "message": "too many connections (4; the rest are kept for root and the daemon's user)"}}]
            for _ in range(2):  # root: the two kept for it
                stream = await trio.open_unix_socket(str(path))
                await stream.send_all(encode_frame({"id": 1, "method": "ping"}))
                assert await one_message(stream, FrameDecoder()) == pong
                procs.append(stream)
    finally:
        for p in procs:
            if isinstance(p, trio.SocketStream):
                await p.aclose()
            else:
                p.kill()
                p.wait()
                p.stdin.close()
                p.stdout.close()


async def test_a_client_refused_for_too_many_connections_is_told_why():
    async with serving(Limits(max_connections=1, per_uid=1, admin_reserve=0)) as path:
        held = await trio.open_unix_socket(str(path))
        await held.send_all(encode_frame({"id": 1, "method": "ping"}))
        assert (await one_message(held, FrameDecoder()))["result"] == "pong"

        def call() -> tuple:
            with Client(str(path), timeout=10) as c:
                try:
                    return "ok", c.call("ping")
                except RemoteError as exc:
                    return exc.code, exc.message

        assert await trio.to_thread.run_sync(call) == (ErrorCode.BUSY, "too many connections (1)")
        await held.aclose()
