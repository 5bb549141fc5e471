"""Every error path of the control socket, against a real daemon: a clear error reply where
one can be sent, the connection closed, and the daemon still serving everyone else."""

import os
import socket
import struct
import time

import msgpack
import pytest

from conftest import root_only
from swarmd.rpc.client import Client, RemoteError
from swarmd.rpc.framing import NOT_YET, FrameDecoder, encode_frame
from swarmd.rpc.protocol import ErrorCode


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
def test_mutation_refused_to_a_caller_outside_the_group(daemon, tmp_path):
    os.chmod(daemon.socket, 0o666)  # an admin loosened the socket: reading is fine, changing is not
    for parent in daemon.socket.parents:  # let nobody reach it through pytest's 0700 dirs
        parent.chmod(parent.stat().st_mode | 0o001)
        if parent == tmp_path.parent.parent:
            break
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
