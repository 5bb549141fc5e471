"""forward.py: the rows of /proc/net/tcp{,6}, who owns the socket that accepted a connection
(against real listeners), the pipe's limits (64 KiB reads, the idle timeout, half-closes, the
job's end) and a host's forwards per job."""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import socket
import subprocess
import sys

import pytest
import trio

from swarmd.compute import forward
from swarmd.compute.forward import (CHUNK, IDLE_TIMEOUT, MAX_PER_JOB, End, ForwardRefused, Forwards, NothingListens,
                                    accepting_uid, check_owner, parse_tcp_table, pipe, read_tables)

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"


def kernel_hex(ip: str) -> str:
    """An address as the kernel writes it: 32-bit words, each in this host's byte order."""
    raw = ipaddress.ip_address(ip).packed
    return "".join(f"{int.from_bytes(raw[i:i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4))


def row(local: str, lport: int, remote: str, rport: int, state: int, uid: int, inode: int) -> str:
    return (f"   0: {kernel_hex(local)}:{lport:04X} {kernel_hex(remote)}:{rport:04X} {state:02X} 00000000:00000000 "
            f"00:00000000 00000000 {uid:>5}        0 {inode} 1 0000000000000000 100 0 0 10 0")


def test_rows_of_tcp_and_tcp6_parse_and_a_malformed_line_is_skipped():
    text = "\n".join([HEADER, row("127.0.0.1", 8000, "0.0.0.0", 0, 0x0A, 1000, 11),
                      row("::ffff:127.0.0.1", 8000, "::ffff:127.0.0.1", 41000, 0x01, 61185, 12),
                      row("fd00::1", 443, "fd00::2", 5000, 0x01, 0, 13),
                      "   3: nonsense", "   4: ZZZZ:0000 00000000:0000 0A 0 0 0 0 0 0 0"])
    rows = parse_tcp_table(text)
    assert [(str(r.local[0]), r.local[1], str(r.remote[0]), r.remote[1], r.state, r.uid, r.inode) for r in rows] == [
        ("127.0.0.1", 8000, "0.0.0.0", 0, 0x0A, 1000, 11),
        ("127.0.0.1", 8000, "127.0.0.1", 41000, 0x01, 61185, 12),  # a dual-stack socket's IPv4 peer
        ("fd00::1", 443, "fd00::2", 5000, 0x01, 0, 13)]


@pytest.mark.skipif(sys.byteorder != "little", reason="the literal row is an x86 host's")
def test_a_row_as_an_x86_kernel_writes_it():
    line = "   1: 0100007F:1F40 0100007F:A028 01 00000000:00000000 00:00000000 00000000  1000        0 4242 1"
    (r,) = parse_tcp_table(HEADER + "\n" + line)
    assert (str(r.local[0]), r.local[1], str(r.remote[0]), r.remote[1], r.uid) == ("127.0.0.1", 8000, "127.0.0.1",
                                                                                    41000, 1000)


def test_the_accepting_socket_is_the_one_whose_local_end_is_our_remote_end():
    rows = parse_tcp_table("\n".join([
        HEADER,
        row("127.0.0.1", 8000, "0.0.0.0", 0, 0x0A, 61185, 1),  # the listener
        row("127.0.0.1", 41000, "127.0.0.1", 8000, 0x01, 0, 2),  # our own end
        row("127.0.0.1", 8000, "127.0.0.1", 40000, 0x06, 0, 3),  # an older connection in TIME_WAIT
        row("127.0.0.1", 8000, "127.0.0.1", 41000, 0x01, 61185, 4),  # what the listener accepted
    ]))
    assert accepting_uid(("127.0.0.1", 41000), ("127.0.0.1", 8000), rows) == 61185
    assert accepting_uid(("127.0.0.1", 40000), ("127.0.0.1", 8000), rows) is None, "TIME_WAIT is nobody's"
    assert accepting_uid(("127.0.0.1", 41001), ("127.0.0.1", 8000), rows) is None


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::")])
def test_a_real_listeners_owner_is_found_and_another_uid_is_refused(family, host):
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6")
    with socket.socket(family) as listener:
        listener.bind((host, 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as c:  # to a dual-stack one: a v4-mapped row in tcp6
            ours, theirs = c.getsockname()[:2], c.getpeername()[:2]
            me = os.geteuid()
            assert accepting_uid(ours, theirs, read_tables()) == me
            assert check_owner(ours, theirs, me, daemon_uid=-1) is None
            assert check_owner(ours, theirs, me + 1, daemon_uid=-1) == \
                f"port {port} is served by uid {me}, not by the job (uid {me + 1})"
            assert check_owner(ours, theirs, me, daemon_uid=me) == f"port {port} is this daemon's own", \
                "a listener of this process is never a job's, whatever the uid"


def echo_server(uid: int | None) -> tuple[subprocess.Popen, int]:
    """A TCP echo server in a process of its own, as `uid` (None: ours); and its port."""
    code = ("import socket, sys\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "print(s.getsockname()[1], flush=True)\n"
            "while True:\n    c, _ = s.accept()\n    d = c.recv(65536)\n"
            "    while d:\n        c.sendall(d); d = c.recv(65536)\n    c.close()\n")
    argv = [sys.executable, "-c", code]
    if uid is not None:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd="/")
    return proc, int(proc.stdout.readline())


@pytest.fixture
def echo():
    uid = 65534 if os.geteuid() == 0 else None
    proc, port = echo_server(uid)
    yield (os.geteuid() if uid is None else uid), port
    proc.kill()
    proc.wait()
    proc.stdout.close()


async def test_connect_reaches_the_jobs_listener_and_refuses_anothers(echo):
    uid, port = echo
    stream = await forward.connect(port, uid, [])
    async with stream:
        await stream.send_all(b"ping")
        assert await stream.receive_some(10) == b"ping"
    with pytest.raises(ForwardRefused, match=f"port {port} is served by uid {uid}, not by the job") as refused:
        await forward.connect(port, uid + 1, [])
    assert refused.value.code == "forward_target"
    with pytest.raises(ForwardRefused, match="runs as root") as refused:
        await forward.connect(port, 0, [])
    assert refused.value.code == "forward_root"


async def test_connect_to_a_port_nothing_listens_on_says_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(NothingListens, match=f"nothing listens on port {port}"):
            await forward.connect(port, 65534, [])


# --- the pipe ---------------------------------------------------------------------------

class MemEnd(End):
    """An end fed by the test: `feed(b"")` is its EOF; what the pipe wrote to it is `got`."""

    def __init__(self) -> None:
        super().__init__()
        self.send_in, self.recv_in = trio.open_memory_channel[bytes](math.inf)
        self.got = bytearray()
        self.eof = False
        self.asked: list[int] = []
        self.fail = False

    def feed(self, data: bytes) -> None:
        self.send_in.send_nowait(data)

    async def _receive(self, n: int) -> bytes:
        self.asked.append(n)
        data = await self.recv_in.receive()
        if self.fail:
            raise forward.Broken("reset by peer")
        return data

    async def send(self, data: bytes) -> None:
        assert not self.eof, "nothing is sent after the end"
        self.got += data

    async def send_eof(self) -> None:
        self.eof = True


async def test_bytes_cross_both_ways_and_each_end_is_passed_on_as_a_half_close():
    a, b = MemEnd(), MemEnd()
    a.feed(b"request")
    a.feed(b"")  # the client is done sending: the server still answers
    b.feed(b"answer")
    b.feed(b"")
    piped = await pipe(a, b)
    assert (bytes(b.got), bytes(a.got), a.eof, b.eof) == (b"request", b"answer", True, True)
    assert (piped.sent, piped.received, piped.why) == (7, 6, "closed")


async def test_reads_are_at_most_64_KiB_and_leftover_goes_first():
    a, b = MemEnd(), MemEnd()
    a.leftover = b"x" * (CHUNK + 10)  # what a client sent before the answer
    a.feed(b"")
    b.feed(b"")
    await pipe(a, b)
    assert bytes(b.got) == b"x" * (CHUNK + 10) and set(a.asked + b.asked) == {CHUNK}


async def test_a_silent_pipe_is_closed_after_the_idle_timeout(autojump_clock):
    a, b = MemEnd(), MemEnd()
    start = trio.current_time()

    async def talk_then_stop() -> None:
        await trio.sleep(IDLE_TIMEOUT - 1)
        a.feed(b"still here")  # resets the clock

    async with trio.open_nursery() as n:
        n.start_soon(talk_then_stop)
        piped = await pipe(a, b)
    assert piped.why == f"idle for {IDLE_TIMEOUT:g} s" and bytes(b.got) == b"still here"
    assert trio.current_time() - start == pytest.approx(2 * IDLE_TIMEOUT - 1, abs=1)


async def test_a_broken_end_and_the_jobs_end_stop_the_pipe(autojump_clock):
    a, b = MemEnd(), MemEnd()
    b.fail = True
    b.feed(b"x")
    assert (await pipe(a, b)).why == "broken: reset by peer"
    stop = trio.Event()
    stop.set()
    assert (await pipe(MemEnd(), MemEnd(), stop=stop)).why == "the job's ranks ended"


# --- a host's forwards ----------------------------------------------------------------

def test_forwards_only_for_a_running_job_at_most_16_and_they_end_with_it():
    f = Forwards()
    key = ("coord", "0123456789ab")
    with pytest.raises(ForwardRefused) as refused:
        with f.slot(key):
            pass
    assert refused.value.code == "not_running"
    f.running(key, 61185)
    assert f.uid(key) == 61185
    with contextlib.ExitStack() as stack:
        events = [stack.enter_context(f.slot(key)) for _ in range(MAX_PER_JOB)]
        with pytest.raises(ForwardRefused, match=f"already has {MAX_PER_JOB} forwards") as refused:
            stack.enter_context(f.slot(key))
        assert refused.value.code == "too_many_forwards" and f.open(key) == MAX_PER_JOB
        f.ended(key)
        assert all(e.is_set() for e in events), "every forward of the job is told it ended"
        assert f.uid(key) is None
    with pytest.raises(ForwardRefused):
        with f.slot(key):
            pass


def test_one_coordinators_jobs_together_stay_under_the_per_coordinator_cap():
    """Four jobs of one coordinator cannot hold 64 forwards (every stream the gossip guard lets
    that peer have to this host): its starts and cancels keep room."""
    forwards = Forwards(per_job=16, per_coordinator=24)
    for j in range(4):
        forwards.running(("coord", f"job{j}"), 61184 + j)
    forwards.running(("other", "job9"), 61190)
    with contextlib.ExitStack() as held:
        for n in range(24):
            held.enter_context(forwards.slot(("coord", f"job{n % 4}")))
        with pytest.raises(ForwardRefused, match="already have 24 forwards") as refused:
            held.enter_context(forwards.slot(("coord", "job0")))
        assert refused.value.code == "too_many_forwards"
        held.enter_context(forwards.slot(("other", "job9")))  # another coordinator is not counted


async def test_a_port_with_none_of_the_jobs_listeners_is_refused_without_connecting(echo, monkeypatch):
    """The daemon never opens a connection to a listener that is not the job's (sshd, say)."""
    uid, port = echo

    def no_socket(*args, **kwargs):
        raise AssertionError("the daemon connected to a listener that is not the job's")

    monkeypatch.setattr(trio.socket, "socket", no_socket)
    with pytest.raises(ForwardRefused, match=f"port {port} is served by uid {uid}, not by the job") as refused:
        await forward.connect(port, uid + 1, [])
    assert refused.value.code == "forward_target"
