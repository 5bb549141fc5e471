"""Property: whatever bytes or msgpack a client throws at the socket, the daemon answers
with well-formed frames (or nothing), and `status` still answers afterwards."""

import socket
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import Daemon
from swarmd.rpc.framing import NOT_YET, FrameDecoder

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8) | st.integers(-2**63, 2**63 - 1), inner, max_size=5),
    max_leaves=20)

requests = st.fixed_dictionaries(
    {"id": st.integers(0, 2**31) | st.text(max_size=5) | st.none(),
     "method": st.sampled_from(["status", "version", "log.level", "status.watch", "nope"]) | st.text(max_size=10)},
    optional={"params": st.dictionaries(st.sampled_from(["level", "interval", "count", "x"]),
                                        msgpack_values, max_size=3) | msgpack_values})


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    d = Daemon(state_dir=base / "state", socket=base / "swarmd.sock", log=base / "swarmd.log")
    d.start()
    yield d
    d.kill()


def throw(daemon: Daemon, payload: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(daemon.socket))
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon may hang up mid-send on an oversize header: that is allowed
        decoder = FrameDecoder()
        while True:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            decoder.feed(data)
            while (reply := decoder.next_message()) is not NOT_YET:  # replies are well-formed frames
                assert isinstance(reply, dict) and "id" in reply and ("result" in reply or "error" in reply
                                                                      or reply.get("final") is True)
    assert daemon.call("status")["peer_id"]


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(shared_daemon, payload):
    throw(shared_daemon, payload)


@FUZZ
@given(st.lists(msgpack_values, min_size=1, max_size=3))
def test_random_msgpack_frames(shared_daemon, values):
    payload = b"".join(struct.pack(">I", len(b)) + b for b in map(lambda v: msgpack.packb(v), values))
    throw(shared_daemon, payload)


@FUZZ
@given(requests)
@example({"id": 1, "method": "status.watch", "params": None})
def test_random_requests(shared_daemon, request):
    if request.get("method") == "status.watch" and isinstance(request.get("params"), (dict, type(None))):
        # a valid endless stream is not a fuzz finding; params None means none, as absent does
        # (missing that made CI's derandomized run hang here until its 90 minutes ran out)
        request["params"] = {**(request.get("params") or {}), "count": 1}
    throw(shared_daemon, (lambda b: struct.pack(">I", len(b)) + b)(msgpack.packb(request)))
