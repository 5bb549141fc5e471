"""The console's API and its guard against one real daemon (no lab, no browser): what a script
or a hostile local client gets from `swarmctl console`, and the Python client (swarmd.client)
running, following and cancelling a job. The page in a real browser: tests/netlab/test_console.py."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from conftest import Daemon, wait_until
from sim.netlab.lab import job_user
from swarmd.client import Job, LogLine, RemoteError, SpecError, Swarm
from swarmd.console import openapi
from swarmd.console.app import API, make_app


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    base = tmp_path_factory.mktemp("console")
    jobs_dir = Path(tempfile.mkdtemp(prefix="swarmd-test-jobs-"))
    jobs_dir.chmod(0o711)
    args = ["--jobs-dir", str(jobs_dir)] + (["--job-user", job_user()] if os.geteuid() == 0 else [])
    d = Daemon(state_dir=base / "state", socket=base / "swarmd.sock", log=base / "swarmd.log", args=args).start()
    d.call("swarm.init")
    wait_until(lambda: d.call("status").get("record"), 10, "the node's own record")
    yield d
    d.kill()
    subprocess.run(["rm", "-rf", str(jobs_dir)], check=False)


class Console:
    def __init__(self, url: str, proc: subprocess.Popen[str]) -> None:
        self.url, self.proc = url, proc
        parts = urlsplit(url)
        self.port = parts.port
        self.token = parts.query.removeprefix("token=")

    def request(self, method: str, path: str, *, token: str | None = "bearer", host: str | None = None,
                headers: dict[str, str] | None = None, body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        h = {"Host": f"127.0.0.1:{self.port}" if host is None else host, **(headers or {})}
        if token == "bearer":
            h["Authorization"] = f"Bearer {self.token}"
        elif token is not None:
            h["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        conn.close()
        return out

    def get(self, path: str, **kw) -> tuple[int, dict]:
        status, _, body = self.request("GET", path, **kw)
        return status, json.loads(body)


@pytest.fixture(scope="module")
def console(node):
    proc = subprocess.Popen([sys.executable, "-m", "swarmctl.main", "--socket", str(node.socket), "console", "--url",
                             "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line.startswith("http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")
    yield Console(line, proc)
    proc.terminate()
    proc.communicate(timeout=10)


def test_every_request_needs_the_token_and_the_login_sets_it_as_a_strict_cookie(console):
    for path in ("/", "/static/app.js", f"{API}/swarm", f"{API}/jobs", f"{API}/events", f"{API}/openapi.json"):
        status, _, body = console.request("GET", path, token=None)
        assert status == 401 and b"swarmctl console --url" in body, (path, status, body)
        assert console.request("GET", path, token="x" * 43)[0] == 401, path
    assert console.request("GET", "/login?token=wrong", token=None)[0] == 401
    login = urlsplit(console.url)
    status, headers, _ = console.request("GET", f"{login.path}?{login.query}", token=None)
    assert status == 303 and headers["location"] == "/"
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and console.token in cookie
    status, headers, body = console.request("GET", "/", token=None, headers={"Cookie": cookie.split(";")[0]})
    assert status == 200 and b"<title>swarmd console</title>" in body
    csp = headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"


def test_a_page_elsewhere_rebinding_its_name_to_loopback_gets_nothing(console):
    for host in ("evil.example:%d" % console.port, "127.0.0.1:1", "10.0.0.1:%d" % console.port, ""):
        status, body = console.get(f"{API}/swarm", host=host)
        assert status == 421 and "loopback" in body["error"], host
    assert console.get(f"{API}/swarm", host=f"localhost:{console.port}")[0] == 200


def test_a_change_needs_the_consoles_own_origin(console, node):
    job = Swarm(node.socket).run(["python", "-c", "import time; time.sleep(60)"])
    cookie = {"Cookie": f"swarmd_console={console.token}"}
    for origin in ({}, {"Origin": "http://evil.example"}, {"Origin": "null"}):
        status, _, body = console.request("POST", f"{API}/jobs/{job}/cancel", token=None, headers={**cookie, **origin})
        assert status == 403 and b"Origin" in body, origin
    assert node.call("jobs.show", id=job)["state"] not in ("cancelled",)
    status, _, body = console.request("POST", f"{API}/jobs/{job}/cancel", token=None,
                                      headers={**cookie, "Origin": f"http://127.0.0.1:{console.port}"})
    assert status == 200, body
    wait_until(lambda: node.call("jobs.show", id=job)["state"] == "cancelled", 30, "the job cancelled")


def test_malformed_ids_names_and_counts_are_refused_naming_what_is_wrong(console):
    for path, word in ((f"{API}/jobs/ABC", "job id"), (f"{API}/jobs/%3Cimg%3E/logs", "job id"),
                       (f"{API}/jobs/{'a' * 13}", "job id"), (f"{API}/services/-x", "service name"),
                       (f"{API}/services/a_b", "service name"), (f"{API}/jobs/abc/logs?tail=0", "tail"),
                       (f"{API}/jobs/abc/logs?tail=99999", "tail"), (f"{API}/jobs/abc/logs?tail=-1", "tail")):
        status, body = console.get(path)
        assert status == 400 and word in body["error"], (path, status, body)
    status, body = console.get(f"{API}/jobs/zzzzzzzzzzzz")
    assert status == 404 and "no job" in body["error"], body
    status, body = console.get(f"{API}/services/nothing")
    assert status == 404 and "no service" in body["error"], body
    for raw in (b"three", b"[3]", b'{"replicas": "3"}', b'{"replicas": -1}', b'{"replicas": 257}',
                b'{"replicas": true}', b'{"replicas": 2.5}', b"{}"):
        status, _, body = console.request("POST", f"{API}/services/web/scale", body=raw,
                                          headers={"Content-Type": "application/json"})
        assert status == 400 and b"replicas" in body, (raw, status, body)
    status, _, body = console.request("POST", f"{API}/services/web/scale", body=b'{"replicas": 2}',
                                      headers={"Content-Type": "application/json"})
    assert status == 404 and b"no service" in body, body
    status, _, body = console.request("POST", f"{API}/services/web/scale", body=b"x" * 70_000)
    assert status == 413, (status, body[:200])


def test_what_the_api_answers_is_what_its_openapi_description_says(console, node):
    job = Swarm(node.socket).run(["python", "-c", "print('hello'); print('<b>bold</b>')"])
    wait_until(lambda: node.call("jobs.show", id=job)["state"] == "succeeded", 60, "the job done")
    status, spec = console.get(f"{API}/openapi.json")
    assert status == 200 and spec == json.loads(json.dumps(openapi.SPEC))
    routes = {re.sub(r"\{[a-z]+\}", "{x}", r.resource.canonical.removeprefix(API))
              for r in make_app(Swarm("/nonexistent"), "t" * 32, port=1).router.routes()
              if r.resource is not None and r.resource.canonical.startswith(API)}
    assert routes == {re.sub(r"\{[a-z]+\}", "{x}", p) for p in spec["paths"]}
    checked = {"/swarm": "/swarm", "/jobs": "/jobs", "/jobs/{id}": f"/jobs/{job}",
               "/jobs/{id}/logs": f"/jobs/{job}/logs", "/services": "/services", "/node": "/node"}
    for path, concrete in checked.items():
        status, body = console.get(API + concrete)
        assert status == 200, (concrete, body)
        schema = spec["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)
    status, body = console.get(f"{API}/jobs/{job}/logs?tail=1")
    assert body["lines"] == [[0, "<b>bold</b>"]] and body["truncated"] is True
    status, body = console.get(f"{API}/jobs/zzzzzzzzzzzz")
    schema = spec["paths"]["/jobs/{id}"]["get"]["responses"][str(status)]["content"]["application/json"]["schema"]
    jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)


def test_the_event_stream_sends_a_snapshot_at_once_and_the_jobs_output_as_it_is_written(console, node):
    status, headers, body = _read_stream(console, f"{API}/events", until=b"\n\n")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    event, data = _event(body)
    assert event == "snapshot" and set(data) == {"swarm", "jobs", "services", "node"}
    jsonschema.validate(data, openapi.SPEC["paths"]["/events"]["get"]["x-event-schema"],
                        cls=jsonschema.Draft202012Validator)
    assert data["swarm"]["me"]["peer"] == node.call("status")["peer_id"]
    job = Swarm(node.socket).run(["python", "-c", "import time\nfor i in range(3):\n print('line', i, flush=True); "
                                                  "time.sleep(0.5)"])
    status, _, body = _read_stream(console, f"{API}/jobs/{job}/logs/follow", until=b"event: end")
    lines = [line for chunk in body.split(b"\n\n") if chunk.startswith(b"event: lines")
             for line in json.loads(chunk.split(b"data: ", 1)[1])]
    assert lines == [[0, "line 0"], [0, "line 1"], [0, "line 2"]]


def _read_stream(console, path: str, until: bytes, timeout: float = 30) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", console.port, timeout=timeout)
    conn.request("GET", path, headers={"Host": f"127.0.0.1:{console.port}", "Authorization": f"Bearer {console.token}"})
    r = conn.getresponse()
    got, deadline = b"", time.monotonic() + timeout
    while until not in got and time.monotonic() < deadline:
        chunk = r.read1(65536)
        if not chunk:
            break
        got += chunk
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, got


def _event(body: bytes) -> tuple[str, dict]:
    head, _, rest = body.partition(b"\n")
    return head.decode().removeprefix("event: "), json.loads(rest.split(b"data: ", 1)[1].split(b"\n")[0])


def test_the_python_client_runs_a_job_follows_its_output_and_cancels_another(node, tmp_path):
    swarm = Swarm(node.socket)
    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text("import sys\nfor i in range(int(sys.argv[1])):\n    print('step', i, flush=True)\n")
    job = swarm.run(["python", "job.py", "3"], workdir=work, name="from-python")
    assert list(swarm.logs(job, follow=True)) == [LogLine(0, "step 0"), LogLine(0, "step 1"), LogLine(0, "step 2")]
    done = swarm.job(job)
    assert isinstance(done, Job)
    assert (done.state, done.exit_code, done.name, done.over) == ("succeeded", 0, "from-python", True)
    assert job in [j.id for j in swarm.jobs()]
    sleeper = swarm.run(["python", "-c", "import time; time.sleep(120)"])
    wait_until(lambda: swarm.job(sleeper).state == "running", 30, "the second job running")
    assert swarm.cancel(sleeper).state in ("running", "cancelled")
    wait_until(lambda: swarm.job(sleeper).state == "cancelled", 30, "the second job cancelled")
    with pytest.raises(SpecError, match="nodes"):
        swarm.run(["python"], nodes="three")
    with pytest.raises(RemoteError, match="no job"):
        swarm.job("zzzzzzzzzzzz")
    assert swarm.peers() == [] and swarm.status()["peer_id"].startswith("12D3")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runs the console as other users)")
def test_a_users_console_lists_and_cancels_only_that_users_jobs(make_daemon):
    """Two members of the daemon's group, each with a console of their own: neither sees nor
    cancels the other's job through it (the daemon's rule, met by the console's own uid)."""
    from test_rpc_access import MEMBER, OTHER_MEMBER, group_daemon, submit

    d, jobs_dir = group_daemon(make_daemon)
    mine, theirs = submit(d, MEMBER), submit(d, OTHER_MEMBER)
    proc = subprocess.Popen([sys.executable, "-m", "swarmctl.main", "--socket", str(d.socket), "console", "--url"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, user=MEMBER, group=MEMBER,
                            extra_groups=[d.gid], env={**os.environ, "HOME": "/"})
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("http://"), proc.stderr.read() if proc.poll() is not None else line
        c = Console(line, proc)
        status, body = c.get(f"{API}/jobs")
        assert status == 200 and [j["id"] for j in body["jobs"]] == [mine]
        status, body = c.get(f"{API}/jobs/{theirs}")
        assert status in (403, 404), body
        status, _, raw = c.request("POST", f"{API}/jobs/{theirs}/cancel")
        assert status in (403, 404), raw
        assert d.call("jobs.show", id=theirs)["state"] not in ("cancelled",)
        status, _, raw = c.request("POST", f"{API}/jobs/{mine}/cancel")
        assert status == 200, raw
        wait_until(lambda: d.call("jobs.show", id=mine)["state"] == "cancelled", 30, "the member's own job cancelled",
                   detail=lambda: d.call("jobs.show", id=mine))
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
        for job in (mine, theirs):
            d.call("jobs.cancel", id=job)
        subprocess.run(["rm", "-rf", str(jobs_dir)], check=False)


def test_a_client_opening_stream_after_stream_gets_a_503_past_the_bound_and_the_console_serves_on(console):
    from swarmd.console.app import MAX_STREAMS

    opened = []
    try:
        for _ in range(MAX_STREAMS):
            conn = http.client.HTTPConnection("127.0.0.1", console.port, timeout=30)
            conn.request("GET", f"{API}/events", headers={"Host": f"127.0.0.1:{console.port}",
                                                          "Authorization": f"Bearer {console.token}"})
            assert conn.getresponse().status == 200
            opened.append(conn)
        status, headers, body = console.request("GET", f"{API}/events")
        assert status == 503 and headers["retry-after"] == "5" and b"event streams" in body
        assert console.get(f"{API}/swarm")[0] == 200, "the rest of the API still answers"
    finally:
        for conn in opened:
            conn.close()
    wait_until(lambda: _read_stream(console, f"{API}/events", until=b"\n\n", timeout=5)[0] == 200, 20,
               "a stream again once the others closed")


# Generated requests (schemathesis) against the live console, every operation but the two event
# streams (which never end): no answer is a 5xx, and every status, content type and body is one
# the description names. Last in the module: a generated id may be a prefix of a job above.
API_SCHEMA = schemathesis.openapi.from_dict(json.loads(json.dumps(openapi.SPEC)))


@API_SCHEMA.exclude(path_regex=r"/(events|follow)$").parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_the_api_holds_to_its_description_under_generated_requests(case, console):
    case.call_and_validate(base_url=f"http://127.0.0.1:{console.port}/api/v1",
                           headers={"Authorization": f"Bearer {console.token}",
                                    "Host": f"127.0.0.1:{console.port}"})
