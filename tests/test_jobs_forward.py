"""`swarmctl jobs forward` on one daemon on loopback (root not needed): a job's HTTP server
answers through the forward, a listener that is not the job's is refused saying why and the
forward keeps serving, Ctrl-C ends it with 0, a job that is not running, or not the
caller's, is refused before anything listens; the local port serves only its user (another
uid's connection is closed unread), and an address another program has is an error."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from conftest import port_to_give, root_only, wait_until
from swarmd.compute.coordinator.run import TERMINAL
from test_jobs_local import node, swarmctl  # noqa: F401 - the fixture

SERVER = """
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("hello from the job, uid %d, path %s" % (os.getuid(), self.path)).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print("serving", s.server_address[1], flush=True)
s.serve_forever()
"""


class Forward:
    """`swarmctl jobs forward ARGS` in the background: its first line, its stderr as it comes."""

    def __init__(self, d, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "swarmctl.main", "--socket", str(d.socket), "jobs",
                                      "forward", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.err: list[str] = []
        self.reader = threading.Thread(target=lambda: self.err.extend(iter(self.proc.stderr.readline, "")), daemon=True)
        self.reader.start()

    def first_line(self) -> str:
        return self.proc.stdout.readline()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(20)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.reader.join(5)
        self.proc.stderr.close()


def get(port: int, path: str = "/") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as r:
        return r.read().decode()


def refused_through(port: int) -> bytes:
    """What a client reads through a forward whose daemon side refused: nothing, then the end
    (a reset: what it sent was not read)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
        c.sendall(b"GET / HTTP/1.0\r\n\r\n")
        try:
            return c.recv(1024)
        except ConnectionResetError:
            return b""


@pytest.fixture
def server_job(node, tmp_path):  # noqa: F811
    job, port = start_server(node, tmp_path)
    yield job, port
    node.call("jobs.cancel", id=job)


def start_server(daemon, tmp_path: Path) -> tuple[str, int]:
    """A detached job serving HTTP on a port of its host, once it says it serves: its id and the
    port. The job picks the port (bound to 0): a port a test found free may be another test's
    connection's by the time the job binds it (seen under two workers: the job failed)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "server.py").write_text(SERVER)
    r = swarmctl(daemon, "jobs", "run", "--detach", "--workdir", str(work), "--", "python", "server.py")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()

    def up() -> int | None:
        shown = daemon.call("jobs.show", id=job)
        out = swarmctl(daemon, "jobs", "logs", job).stdout
        assert shown["state"] not in TERMINAL, (shown["state"], shown["reason"], out[-2000:])  # not a minute's wait
        said = re.search(r"serving (\d+)", out)
        return int(said.group(1)) if said else None

    port = wait_until(up, 60, "the job's server up", detail=lambda: daemon.call("jobs.show", id=job))
    return job, port


def test_a_jobs_http_server_answers_through_the_forward(node, server_job):  # noqa: F811
    job, port = server_job
    local = port_to_give()
    fw = Forward(node, job[:6], f"{local}:{port}")
    try:
        line = fw.first_line()
        me = node.call("status")["peer_id"]
        assert line.startswith(f"forwarding 127.0.0.1:{local} -> job {job} on host ") and \
            line.rstrip().endswith(f"({me[-8:]}) port {port}; Ctrl-C to stop"), line
        answers: list[str] = []
        threads = [threading.Thread(target=lambda i=i: answers.append(get(local, f"/{i}"))) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(a.rsplit(" ", 1)[1] for a in answers) == ["/0", "/1", "/2", "/3"], (answers, fw.err)
        assert all(a.startswith("hello from the job, uid ") for a in answers)
        assert fw.stop() == 0, fw.err
    finally:
        fw.kill()


def test_a_port_the_job_does_not_own_is_refused_and_the_forward_keeps_serving(node, server_job):  # noqa: F811
    job, port = server_job
    daemon_port = next(int(a.split("/")[4]) for a in node.call("status")["listen_addrs"] if "/tcp/" in a)
    local = port_to_give()
    fw = Forward(node, job, f"{local}:{daemon_port}")
    try:
        assert fw.first_line().startswith(f"forwarding 127.0.0.1:{local} -> job {job}")
        assert refused_through(local) == b""
        wait_until(lambda: any("refused" in e for e in fw.err), 20, "the refusal told")
        why = next(e for e in fw.err if "refused" in e)
        assert "jobs.forward" in why and (f"port {daemon_port} is this daemon's own" in why
                                          or f"port {daemon_port} is served by uid {os.geteuid()}, not by the job"
                                          in why), why
        assert fw.proc.poll() is None, "a refused connection does not end the forward"
    finally:
        assert fw.stop() == 0
        fw.kill()
    if os.geteuid() == 0:  # a listener of another uid than the job's (the test's own: root)
        with socket.socket() as mine:
            mine.bind(("127.0.0.1", 0))
            mine.listen()
            fw = Forward(node, job, f"{local}:{mine.getsockname()[1]}")
            try:
                fw.first_line()
                assert refused_through(local) == b""
                wait_until(lambda: any("served by uid 0, not by the job" in e or "runs as root" in e for e in fw.err),
                           20, "the refusal told")
                assert get_through_same(fw, local, port) is None
            finally:
                fw.stop()
                fw.kill()


def get_through_same(fw: Forward, local: int, port: int) -> None:
    """The forward still accepts after a refusal (it answers the next connection)."""
    with socket.create_connection(("127.0.0.1", local), timeout=20):
        pass
    assert fw.proc.poll() is None


def test_a_job_that_is_not_running_and_bad_ports_are_refused_before_listening(node, tmp_path):  # noqa: F811
    r = swarmctl(node, "jobs", "run", "--", "python", "-c", "pass")
    assert r.returncode == 0, r.stderr
    job = node.call("jobs.ls")["jobs"][0]["id"]
    r = swarmctl(node, "jobs", "forward", job, "8000", timeout=30)
    assert r.returncode == 1 and f"jobs.forward: job {job} is not running (succeeded)" in r.stderr, r.stderr
    r = swarmctl(node, "jobs", "forward", "nosuchjob", "8000", timeout=30)
    assert r.returncode == 1 and "no job 'nosuchjob'" in r.stderr, r.stderr
    for bad in ("0", "65536", "http", "8000:", "8000:0", "-1", ""):
        r = swarmctl(node, "jobs", "forward", job, bad, timeout=30)
        assert r.returncode == 2 and "must be a port number from 1 to 65535" in r.stderr, (bad, r.stderr)


@root_only()
def test_another_users_job_cannot_be_forwarded(make_daemon):
    from test_rpc_access import MEMBER, OTHER_MEMBER, _group, as_user, let_others_reach

    from sim.netlab.lab import job_user

    group = _group()
    d = make_daemon(args=["--job-user", job_user(), "--socket-group", group.gr_name])
    let_others_reach(d.socket)
    d.call("swarm.init")
    wait_until(lambda: d.call("status").get("record"), 10, "the node's own record")
    outcome = as_user(d, MEMBER, [group.gr_gid], "jobs.run", spec={"cmd": ["sleep", "600"]}, detach=True)
    assert outcome[0] == "ok", outcome
    job = outcome[1]["submitted"]
    try:
        wait_until(lambda: d.call("jobs.show", id=job)["state"] == "running", 60, "the member's job running")
        outcome = as_user(d, OTHER_MEMBER, [group.gr_gid], "jobs.forward", id=job, port=8000, check=True)
        assert outcome[0] == "refused" and outcome[2].startswith(
            f"jobs.forward: job {job} belongs to uid {MEMBER}; uid {OTHER_MEMBER} may act only on its own"), outcome
        outcome = as_user(d, MEMBER, [group.gr_gid], "jobs.forward", id=job, port=8000, check=True)
        assert outcome[0] == "ok" and outcome[1]["id"] == job and outcome[1]["port"] == 8000, outcome
    finally:
        d.call("jobs.cancel", id=job)


def test_a_forward_is_its_connections_only_call_and_a_check_leaves_it_a_frame_connection(node, server_job):  # noqa: F811
    from swarmd.rpc.framing import FrameDecoder, encode_frame
    from swarmd.rpc.protocol import ErrorCode

    job, port = server_job
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(str(node.socket))
        decoder = FrameDecoder(bounded=False)

        def receive() -> dict:
            while (m := decoder.next_message()).__class__ is not dict:
                decoder.feed(s.recv(65536))
            return m

        s.sendall(encode_frame({"id": 1, "method": "jobs.forward", "params": {"id": job, "port": port, "check": True}}))
        assert receive()["result"]["id"] == job
        s.sendall(encode_frame({"id": 2, "method": "status.watch", "params": {"interval": 5.0}}))
        assert receive()["id"] == 2  # a stream under way on this connection
        s.sendall(encode_frame({"id": 3, "method": "jobs.forward", "params": {"id": job, "port": port}}))
        while (m := receive())["id"] != 3:
            pass
        assert m["error"] == {"code": ErrorCode.BUSY, "message": "jobs.forward must be the only call on its connection"}

    with socket.socket(socket.AF_UNIX) as s:  # alone on its connection: the answer, then the job's bytes
        s.settimeout(20)
        s.connect(str(node.socket))
        s.sendall(encode_frame({"id": 7, "method": "jobs.forward", "params": {"id": job, "port": port}})
                  + b"GET /early HTTP/1.0\r\n\r\n")  # sent before the answer: still the job's
        decoder = FrameDecoder(bounded=False)
        while (m := decoder.next_message()).__class__ is not dict:
            decoder.feed(s.recv(65536))
        assert m == {"id": 7, "result": {"id": job, "peer": node.call("status")["peer_id"], "address": m["result"]["address"],
                                         "port": port}, "final": True}
        raw = decoder.rest()
        while chunk := s.recv(65536):
            raw += chunk
        assert raw.startswith(b"HTTP/1.0 200") and raw.endswith(b"path /early"), raw


def test_without_the_sandbox_the_job_users_listener_is_forwarded_and_never_roots(make_daemon, tmp_path):
    """No per-job uid: the job's ranks run as the job user (root's daemon) or as the daemon's own
    user; that uid's listener is forwarded, root's never."""
    from sim.netlab.lab import job_user

    user = job_user() if os.geteuid() == 0 else ""
    import tempfile

    jobs_dir = Path(tempfile.mkdtemp(prefix="swarmd-test-jobs-"))  # outside pytest's 0700 dirs: the job user's
    jobs_dir.chmod(0o711)
    d = make_daemon(args=["--sandbox", "off", "--jobs-dir", str(jobs_dir)] + (["--job-user", user] if user else []))
    d.call("swarm.init")
    wait_until(lambda: d.call("status").get("record"), 10, "the node's own record")
    local = port_to_give()
    job, port = start_server(d, tmp_path)
    try:
        fw = Forward(d, job, f"{local}:{port}")
        try:
            fw.first_line()
            if os.geteuid() == 0 and not user:  # nobody cannot run this checkout's python: the job runs as root
                assert refused_through(local) == b""
                wait_until(lambda: any("runs as root on this host" in e for e in fw.err), 20, "the refusal told")
            else:
                import pwd

                uid = pwd.getpwnam(user).pw_uid if user else os.geteuid()
                assert get(local, "/x") == f"hello from the job, uid {uid}, path /x"
            assert fw.stop() == 0
        finally:
            fw.kill()
    finally:
        d.call("jobs.cancel", id=job)
        subprocess.run(["rm", "-rf", str(jobs_dir)], check=False)


# --- the local port serves its user only (issue 23, finding 14) ----------------------------

CLIENT = """
import socket, sys
c = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=20)
c.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
try:
    got = c.recv(1024)
except ConnectionResetError:
    got = b""
print(repr(got), flush=True)
"""


def as_nobody(code: str, *args: str) -> subprocess.Popen:
    """`python -c code args` as uid and gid 65534, its stdout piped."""
    return subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code,
                             *args], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True, cwd="/")


@root_only()
def test_a_connection_of_another_uid_is_told_apart_from_the_users_own():
    from swarmctl.forward import peer_refusal

    hold = ("import socket, sys\nc = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
            "print('on', flush=True)\nsys.stdin.read()\n")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        other = as_nobody(hold, str(port))
        try:
            assert other.stdout.readline() == "on\n"
            conn, _ = listener.accept()
            with conn:
                assert peer_refusal(conn) == "it comes from uid 65534, and this forward serves only uid 0"
        finally:
            other.kill()
            other.wait()
            other.stdin.close()
            other.stdout.close()
        with socket.create_connection(("127.0.0.1", port)) as mine:
            conn, _ = listener.accept()
            with conn:
                assert peer_refusal(conn) is None


@root_only()
def test_another_users_connection_to_the_local_port_is_refused_and_the_users_own_served(node, server_job):  # noqa: F811
    job, port = server_job
    local = port_to_give()
    fw = Forward(node, job, f"{local}:{port}")
    try:
        assert fw.first_line().startswith(f"forwarding 127.0.0.1:{local} -> job {job}")
        other = as_nobody(CLIENT, str(local))
        try:
            assert other.communicate(timeout=30)[0] == "b''\n", "another user read through the forward"
        finally:
            other.kill()
        wait_until(lambda: any("refused" in e for e in fw.err), 20, "the refusal told")
        why = next(e for e in fw.err if "refused" in e)
        assert "refused: it comes from uid 65534, and this forward serves only uid 0" in why, why
        assert get(local, "/mine").startswith("hello from the job"), "the user's own connection still served"
        assert fw.stop() == 0
    finally:
        fw.kill()


def test_a_local_address_that_is_taken_fails_clearly_and_leaves_nothing_listening():
    from swarmctl.forward import UsageError, _listen

    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    with socket.socket(socket.AF_INET6) as taken:
        taken.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        taken.bind(("::1", 0))  # another program's [::1]:P: `localhost:P` could reach it instead of the job
        taken.listen()
        port = taken.getsockname()[1]
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
        except OSError:
            pytest.skip(f"127.0.0.1:{port} is someone's already")
        with pytest.raises(UsageError, match=rf"cannot listen on \[::1\]:{port}: Address already in use "
                                             r"\(another program has it: pick another LOCAL_PORT\)"):
            _listen(port)
        with socket.socket() as again:  # the 127.0.0.1 listener it had opened was closed
            again.bind(("127.0.0.1", port))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(UsageError, match=rf"cannot listen on 127.0.0.1:{taken.getsockname()[1]}: Address already"):
            _listen(taken.getsockname()[1])
