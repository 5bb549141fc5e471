"""`swarmctl jobs forward` across the swarm: the coordinator (h1) forwards to a job whose first
host is another member (h2), over the job protocol's libp2p stream, as a user would run it."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from .support import call, job_logs, swarmctl, three_hosts, until

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


def test_a_forward_reaches_a_job_on_another_host_and_ends_with_it(fl, tmp_path):
    call(fl, "h2", "labels.set", labels={"forward": "head"})
    until(lambda: any(p.get("labels", {}).get("forward") == "head" for p in call(fl, "h1", "peers")["peers"]),
          30, "h1 sees h2's label")
    work = tmp_path / "work"
    work.mkdir()
    (work / "server.py").write_text(SERVER)
    r = swarmctl(fl, "h1", "jobs", "run", "--detach", "--label", "forward=head", "--workdir", str(work), "--",
                 "python", "server.py")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    until(lambda: "serving" in job_logs(fl, "h1", job), 90, "the job's server up")
    h2 = call(fl, "h2", "status")["peer_id"]
    assert call(fl, "h1", "jobs.show", id=job)["nodes"] == [h2]

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        local = probe.getsockname()[1]
    env = {**os.environ, "SWARMD_SOCKET": fl.state.host("h1").socket}
    fw = subprocess.Popen([sys.executable, "-m", "swarmctl.main", "jobs", "forward", job, f"{local}:8000"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = fw.stdout.readline()
        assert line.startswith(f"forwarding 127.0.0.1:{local} -> job {job} on host ") and f"({h2[-8:]}) port 8000" in line
        for _ in range(3):
            with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=30) as got:
                body = got.read()
            assert body.startswith(f"hello from {job} uid ".encode()) and len(body) > 300_000, body[:100]

        def fetch(_: int) -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=60) as got:
                return got.read().startswith(f"hello from {job}".encode())

        # a load generator's burst: 16 new connections at once, all to a head on another host
        # (whose cap on one peer's unchecked streams is 4) each answered
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            assert all(pool.map(fetch, range(16)))
        call(fl, "h1", "jobs.cancel", id=job)
        until(lambda: call(fl, "h1", "jobs.show", id=job)["state"] == "cancelled", 30, "the job cancelled")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=30) as got:
                got.read()
            raise AssertionError("the job is gone, yet it answered")
        except (OSError, urllib.error.URLError):
            pass
        fw.send_signal(signal.SIGINT)
        assert fw.wait(20) == 0
        err = fw.stderr.read()
        assert f"job {job} is not running (cancelled)" in err, err
    finally:
        if fw.poll() is None:
            fw.kill()
            fw.wait()
        fw.stdout.close()
        fw.stderr.close()
