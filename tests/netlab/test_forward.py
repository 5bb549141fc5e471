"""`swarmctl jobs forward` across the swarm: the coordinator (h1) forwards to a job whose first
host is another member (h2), over the job protocol's libp2p stream, as a user would run it; and
the owner's daemon still does once a successor coordinates the job (issue 26)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from .support import call, handed_over_and_back, job_logs, swarmctl, three_hosts, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]

SERVER = """
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("hello from %s uid %d" % (os.environ["SWARM_JOB_ID"], os.getuid())).encode() + b"." * 300_000
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H)
print("serving", flush=True)
s.serve_forever()
"""


@pytest.fixture(scope="module")
def fl():
    with three_hosts("f", mesh=False) as lab:
        yield lab


@contextlib.contextmanager
def forwarding(lab, host: str, job: str, port: int = 8000):
    """`swarmctl jobs forward JOB LOCAL:port` run by the owner on `host`, as a user runs it: (the
    process, the local port, its first line); stopped with Ctrl-C (or killed) on leaving."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        local = probe.getsockname()[1]
    env = {**os.environ, "SWARMD_SOCKET": lab.state.host(host).socket}
    fw = subprocess.Popen([sys.executable, "-m", "swarmctl.main", "jobs", "forward", job, f"{local}:{port}"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        yield fw, local, fw.stdout.readline()
    finally:
        if fw.poll() is None:
            fw.kill()
            fw.wait()
        fw.stdout.close()
        fw.stderr.close()


def server_job(lab, tmp_path, *args: str) -> str:
    """SERVER as a detached job submitted from h1 with `args`; returned once it serves."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "server.py").write_text(SERVER)
    r = swarmctl(lab, "h1", "jobs", "run", "--detach", *args, "--workdir", str(work), "--", "python", "server.py")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    until(lambda: "serving" in job_logs(lab, "h1", job), 90, "the job's server up")
    return job


def get(local: int, timeout: float = 30) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=timeout) as got:
        return got.read()


def test_a_forward_reaches_a_job_on_another_host_and_ends_with_it(fl, tmp_path):
    call(fl, "h2", "labels.set", labels={"forward": "head"})
    until(lambda: any(p.get("labels", {}).get("forward") == "head" for p in call(fl, "h1", "peers")["peers"]),
          30, "h1 sees h2's label")
    job = server_job(fl, tmp_path, "--label", "forward=head")
    h2 = call(fl, "h2", "status")["peer_id"]
    assert call(fl, "h1", "jobs.show", id=job)["nodes"] == [h2]

    with forwarding(fl, "h1", job) as (fw, local, line):
        assert line.startswith(f"forwarding 127.0.0.1:{local} -> job {job} on host ") and \
            f"({h2[-8:]}) port 8000" in line
        for _ in range(3):
            body = get(local)
            assert body.startswith(f"hello from {job} uid ".encode()) and len(body) > 300_000, body[:100]

        def fetch(_: int) -> bool:
            return get(local, timeout=60).startswith(f"hello from {job}".encode())

        # a load generator's burst: 16 new connections at once, all to a head on another host
        # (whose cap on one peer's unchecked streams is 4) each answered
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            assert all(pool.map(fetch, range(16)))
        call(fl, "h1", "jobs.cancel", id=job)
        until(lambda: call(fl, "h1", "jobs.show", id=job)["state"] == "cancelled", 30, "the job cancelled")
        try:
            get(local)
            raise AssertionError("the job is gone, yet it answered")
        except (OSError, urllib.error.URLError):
            pass
        fw.send_signal(signal.SIGINT)
        assert fw.wait(20) == 0
        err = fw.stderr.read()
        assert f"job {job} is not running (cancelled)" in err, err


def test_the_owner_forwards_to_its_job_after_a_successor_took_it_over(fl, tmp_path):
    """Submitted from h1, which then crashed: a replica coordinates the job; h1 comes back and
    follows it, and its owner reaches the job's port through h1 (its head lets the job's origin
    forward at any epoch) and cancels it there."""
    h2 = fl.state.host("h2").peer_id
    job = server_job(fl, tmp_path, "--host", h2)
    handed_over_and_back(fl, job)
    with forwarding(fl, "h1", job) as (fw, local, line):
        assert f"({h2[-8:]}) port 8000" in line, (line, fw.stderr.read() if fw.poll() is not None else "")
        assert get(local).startswith(f"hello from {job} uid ".encode())
    assert swarmctl(fl, "h1", "jobs", "cancel", job).returncode == 0
    until(lambda: call(fl, "h1", "jobs.show", id=job)["state"] == "cancelled", 60, "the job cancelled from h1",
          interval=0.5, detail=lambda: call(fl, "h1", "jobs.show", id=job))
