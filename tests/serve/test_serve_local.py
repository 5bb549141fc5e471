"""Services on one daemon on loopback (no root, no mesh): `serve up` to a request answered
through the gateway, `serve ls|show|logs|scale|down`, and what a bad request gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import wait_until
from sim.netlab.lab import job_user

APP = r'''
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = ("replica %s of %s saw %s" % (os.environ["SWARM_REPLICA"], os.environ["SWARM_SERVICE"],
                                            self.path)).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
print("listening on", os.environ["PORT"], flush=True)
http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), H).serve_forever()
'''


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from conftest import Daemon

    base = tmp_path_factory.mktemp("serve")
    jobs_dir = Path(tempfile.mkdtemp(prefix="swarmd-test-jobs-"))
    jobs_dir.chmod(0o711)
    args = ["--jobs-dir", str(jobs_dir), "--gateway-listen", "127.0.0.1:0", "--serve-ports", "30100-30199",
            "--job-slots", "4"]
    args += ["--job-user", job_user()] if os.geteuid() == 0 else []
    d = Daemon(state_dir=base / "state", socket=base / "swarmd.sock", log=base / "swarmd.log", args=args).start()
    try:
        d.call("swarm.init")
        wait_until(lambda: d.call("status").get("record"), 10, "the node's own record")
        yield d
    finally:
        d.kill()
        subprocess.run(["rm", "-rf", str(jobs_dir)], check=False)


def swarmctl(d, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmctl.main", "--socket", str(d.socket), *args],
                          capture_output=True, text=True, timeout=timeout)


def gateway(d) -> str:
    wait_until(lambda: ":" in str(d.call("status")["serve"]["gateway"].get("listen") or "")
               and not d.call("status")["serve"]["gateway"]["listen"].endswith(":0"), 30, "the gateway listening")
    return d.call("status")["serve"]["gateway"]["listen"]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_service_is_deployed_reached_through_the_gateway_shown_and_taken_down(node, tmp_path):
    (tmp_path / "app.py").write_text(APP)
    r = swarmctl(node, "serve", "up", "web", "--workdir", str(tmp_path), "--health", "/healthz", "--", "python",
                 "app.py")
    assert r.returncode == 0, r.stderr
    assert "web: up, 1 replica(s)" in r.stdout
    wait_until(lambda: any(x.get("healthy") for x in node.call("serve.show", name="web")["replicas"]), 60,
               "a healthy replica", detail=lambda: node.call("serve.show", name="web"))
    where = gateway(node)
    wait_until(lambda: get(f"http://{where}/web/hello?x=1")[0] == 200, 20, "the gateway routing to it")
    assert get(f"http://{where}/web/hello?x=1") == (200, "replica 0 of web saw /hello?x=1")
    assert get(f"http://{where}/nosuch/")[0] == 404 and get(f"http://{where}/Bad..Name/")[0] == 404
    ls = json.loads(swarmctl(node, "serve", "ls", "--json").stdout)["services"]
    assert [(s["name"], s["serving"], s["replicas"], s["mine"]) for s in ls] == [("web", 1, 1, True)]
    # the gateway's figures reach the daemon with its next poll
    shown = wait_until(lambda: (s := node.call("serve.show", name="web"))["replicas"][0].get("requests") and s, 10,
                       "the gateway's figures")
    assert shown["replicas"][0]["requests"] >= 2 and shown["replicas"][0]["path"] == "local"
    assert shown["gateway"]["requests"] >= 2 and shown["gateway"]["p50_ms"] > 0
    text = swarmctl(node, "serve", "show", "web").stdout
    assert "1 healthy of 1 wanted" in text and "healthy" in text
    assert "listening on 301" in swarmctl(node, "serve", "logs", "web").stdout
    # a second deploy with a changed command rolls out: a new replica, then the old one drains
    r = swarmctl(node, "serve", "up", "web", "--replicas", "1", "--workdir", str(tmp_path), "--health", "/healthz",
                 "--env", "X=1", "--", "python", "app.py")
    assert r.returncode == 0 and "rolling out" in r.stdout and "generation 2" in r.stdout, r.stdout + r.stderr

    def rolled() -> bool:
        rows = node.call("serve.show", name="web")["replicas"]
        return [(x["generation"], x["healthy"]) for x in rows if not x.get("draining")] == [(2, True)]

    wait_until(rolled, 60, "the new generation serving alone", detail=lambda: node.call("serve.show", name="web"))
    assert get(f"http://{where}/web/x")[0] == 200
    r = swarmctl(node, "serve", "down", "web")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: node.call("serve.ls")["services"] == [], 60, "the service gone",
               detail=lambda: node.call("serve.ls"))
    jobs = node.call("jobs.ls")["jobs"]
    assert jobs and all(j["state"] in ("cancelled", "succeeded", "failed") for j in jobs), jobs
    wait_until(lambda: get(f"http://{where}/web/")[0] == 404, 10, "the gateway forgetting it")


def test_bad_requests_are_refused_naming_what_is_wrong(node, tmp_path):
    r = swarmctl(node, "serve", "up", "Bad_Name", "--", "true")
    assert r.returncode != 0 and "not a service name" in r.stderr
    r = swarmctl(node, "serve", "up", "ok", "--health", "healthz", "--", "true")
    assert r.returncode != 0 and "health" in r.stderr
    r = swarmctl(node, "serve", "up", "ok")
    assert r.returncode == 2 and "command is missing" in r.stderr
    for params, words in (({"name": "ok", "template": {"cmd": ["x"], "nodes": 3}}, "template"),
                          ({"name": "ok", "template": {"cmd": ["x"]}, "replicas": 65}, "replicas"),
                          ({"name": "ok", "template": {"cmd": ["x"]}, "access": "token"}, "token_sha256"),
                          ({"name": "ok", "template": {"cmd": ["x"]}, "workdir": "0" * 64}, "not uploaded")):
        with pytest.raises(Exception, match=words):
            node.call("serve.up", **params)
    with pytest.raises(Exception, match="no service"):
        node.call("serve.scale", name="nosuch", replicas=2)
    assert node.call("status")["serve"]["controlled"] == []


def test_a_gateway_whose_daemon_is_killed_outright_goes_too(tmp_path):
    """SIGKILL sends the gateway no SIGTERM: it notices that its parent is gone and exits, so a
    daemon started again binds the gateway's port anew."""
    from conftest import Daemon

    d = Daemon(state_dir=tmp_path / "state", socket=tmp_path / "swarmd.sock", log=tmp_path / "swarmd.log",
               args=["--gateway-listen", "127.0.0.1:0"]).start()
    try:
        d.call("swarm.init")
        pid = wait_until(lambda: d.call("status")["serve"]["gateway"]["pid"], 30, "the gateway started")
        os.kill(pid, 0)
    finally:
        d.kill()

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as f:  # exited, not yet reaped by init: gone as well
            return f.read().split(")")[-1].split()[0] == "Z"

    wait_until(gone, 10, "the gateway exiting after its daemon's SIGKILL")


SLOW_APP = APP.replace("def do_GET(self):", "def do_GET(self):\n        import time; time.sleep(0.3 if self.path != '/healthz' else 0)")


def test_an_autoscaled_service_grows_under_load_through_the_gateway_and_says_why(node, tmp_path):
    """The whole loop on one daemon: the gateway's figures become this node's demand entry in its
    own record, the controller sums it, the scaler sees 8 requests in flight for a target of 2
    per replica and adds replicas at once (panic), and `serve show` says why."""
    import threading

    (tmp_path / "app.py").write_text(SLOW_APP)
    r = swarmctl(node, "serve", "up", "auto", "--replicas", "1:3", "--target-inflight", "2", "--workdir",
                 str(tmp_path), "--health", "/healthz", "--", "python", "app.py")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: any(x.get("healthy") for x in node.call("serve.show", name="auto")["replicas"]), 60,
               "a healthy replica")
    where = gateway(node)
    wait_until(lambda: get(f"http://{where}/auto/healthz")[0] == 200, 20, "the gateway routing to it")
    stop = threading.Event()
    failed: list[tuple[int, str]] = []

    def client() -> None:
        while not stop.is_set():
            status, body = get(f"http://{where}/auto/work")
            if status != 200:
                failed.append((status, body[:100]))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        shown = wait_until(lambda: (s := node.call("serve.show", name="auto"))["autoscale"]["replicas"] == 3 and s,
                           60, "the service scaled to 3", detail=lambda: node.call("serve.show", name="auto"))
        assert shown["autoscale"]["demand"]["in_flight"] >= 4, shown["autoscale"]["demand"]
        assert shown["autoscale"]["events"] and "in-flight" in shown["autoscale"]["events"][0]["reason"]
        wait_until(lambda: sum(1 for x in node.call("serve.show", name="auto")["replicas"] if x.get("healthy")) == 3,
                   60, "three replicas serving")
        assert node.call("serve.show", name="auto")["autoscale"]["measured_starts"] >= 1
        text = swarmctl(node, "serve", "show", "auto").stdout
        assert "1-3 replicas, 2 in flight each" in text and "scaling" in text and "→ 3" in text, text
        # down to a fixed 1 under the same load: two replicas drain, and no request is lost
        r = swarmctl(node, "serve", "scale", "auto", "1")
        assert r.returncode == 0 and "auto: 1 replica(s)" in r.stdout, r.stdout + r.stderr
        wait_until(lambda: len(node.call("serve.show", name="auto")["replicas"]) == 1, 60, "two replicas drained",
                   detail=lambda: node.call("serve.show", name="auto"))
        time.sleep(1.0)  # the load goes on a second against the one left: not a wait for anything
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=15)
    assert not failed, "\n".join(map(str, failed[:3]))
    assert node.call("serve.show", name="auto")["autoscale"]["policy"] is None, "a fixed count: autoscaling off"
    r = swarmctl(node, "serve", "scale", "auto", "1:x")
    assert r.returncode == 2 and "MIN:MAX" in r.stderr
    r = swarmctl(node, "serve", "up", "other", "--target-inflight", "2", "--", "true")
    assert r.returncode == 2 and "--replicas MIN:MAX" in r.stderr
    swarmctl(node, "serve", "down", "auto")
