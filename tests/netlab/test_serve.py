"""Services across a lab of real daemons (issue 27): a 3-replica service on 4 hosts, reached
through the gateways of different members over the WireGuard mesh, nearest replicas first; a
replica host crashed under load costs (almost) no request and is replaced; `serve down` leaves
nothing.

The topology keeps the controller apart: h1 is 40 ms from everyone, h2-h4 are 5 ms from each
other. Whichever host is left without a replica (the spare) has replicas 5 ms away that are
not the controller's host, so its gateway's traffic goes to them, and the crash of one lands
its replacement on the spare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from sim.netlab import lab as labmod
from sim.netlab import topology

from sim.netlab.lab import SWARMD_PORT

from .support import call, swarmctl, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]
HOSTS = ("h1", "h2", "h3", "h4")
APP = r'''
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        body = ("%s %s" % (os.environ["SWARM_NODE_IPS"], self.path)).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
print("listening on", os.environ["PORT"], flush=True)
http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), H).serve_forever()
'''
# A closed-loop client inside a host's namespace: WORKERS threads, each one keep-alive connection
# to the gateway there, request after request for SECONDS; prints {overlay IP: answers, "failed": n}
CLIENT = r'''
import collections, http.client, json, sys, threading, time
port, workers, seconds, count = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
seen, lock, failures = collections.Counter(), threading.Lock(), []
end = time.monotonic() + seconds
def work():
    c, n = http.client.HTTPConnection("127.0.0.1", port, timeout=90), 0
    while (time.monotonic() < end) if seconds else n < count:
        n += 1
        try:
            c.request("GET", "/web/ping"); r = c.getresponse(); body = r.read().decode()
            with lock:
                if r.status == 200: seen[body.split()[0]] += 1
                else: failures.append(f"{r.status} {body[:80]}")
        except OSError as exc:
            with lock: failures.append(repr(exc))
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=90)
threads = [threading.Thread(target=work) for _ in range(workers)]
[t.start() for t in threads]; [t.join() for t in threads]
print(json.dumps({"seen": dict(seen), "failed": len(failures), "failures": failures[:5]}))
'''


def rtt(a, b) -> float:
    return 40.0 if "h1" in (a.name, b.name) else 5.0


@pytest.fixture(scope="module")
def sl():
    if os.geteuid() != 0:
        pytest.skip("netlab needs root (network namespaces); CI runs as root")
    name = f"sv{uuid.uuid4().hex[:6]}"
    hosts, links = topology.plan(len(HOSTS), rtt)
    lab = labmod.Lab.up(name, hosts, links, mesh=True, daemon_args=["--gateway-listen", "127.0.0.1:8080"])
    try:
        lab.wait_formed()
        yield lab
    finally:
        labmod.down(name)


def overlay_names(lab) -> dict[str, str]:
    return {call(lab, h, "status")["mesh"]["address"]: h for h in HOSTS if not lab.state.host(h).crashed}


def load(lab, host: str, *, workers: int = 1, seconds: float = 0, count: int = 0,
         names: dict[str, str] | None = None) -> dict:
    done = subprocess.run(["ip", "netns", "exec", lab.state.host(host).netns, sys.executable, "-c", CLIENT, "8080",
                           str(workers), str(seconds), str(count)], capture_output=True, text=True,
                          timeout=seconds + 300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    names = names or overlay_names(lab)
    out["seen"] = {names.get(ip, ip): n for ip, n in out["seen"].items()}
    return out


def healthy(lab, host: str, want: int) -> list[str] | None:
    """The hosts of `want` healthy replicas of web as `host`'s registry shows them, or None."""
    try:
        rows = call(lab, host, "serve.show", name="web")["replicas"]
    except Exception:
        return None
    hosts = [r["host"] for r in rows if r.get("healthy") and not r.get("draining")]
    return hosts if len(hosts) == want else None


def test_a_service_answers_through_any_gateway_nearest_replica_first_and_outlives_a_crashed_host(sl, tmp_path):
    (tmp_path / "app.py").write_text(APP)
    r = swarmctl(sl, "h1", "serve", "up", "web", "--replicas", "3", "--workdir", str(tmp_path), "--health",
                 "/healthz", "--", "python", "app.py")
    assert r.returncode == 0, r.stderr
    peer = {sl.state.host(h).peer_id: h for h in HOSTS}
    until(lambda: all(healthy(sl, h, 3) for h in HOSTS), 120, "3 healthy replicas in every member's registry",
          interval=1.0, detail=lambda: replica_detail(sl, "web"))
    replicas = {peer[p] for p in healthy(sl, "h1", 3)}
    assert len(replicas) == 3, "one replica per host"
    spare = next(h for h in HOSTS if h not in replicas)
    # nearest first: each gateway's answers come from its nearest replicas (its own host's, or
    # those 5 ms away rather than 40 ms), whichever member the request entered at
    served = set()
    for gateway in sorted({"h1", "h4", spare}):
        # the gateway's own table (its figures list what it routes to; it polls every second)
        until(lambda: sum(r.get("ejected") is False for r in call(sl, gateway, "serve.show", name="web")["replicas"])
              == 3, 30, f"{gateway}'s gateway routing to 3 replicas", interval=0.5)
        got = load(sl, gateway, count=40)
        assert got["failed"] == 0, got
        mine = {gateway} if gateway in replicas else {h for h in replicas if rtt(sl.state.host(gateway),
                                                                                 sl.state.host(h)) == min(
            rtt(sl.state.host(gateway), sl.state.host(x)) for x in replicas)}
        near = sum(n for h, n in got["seen"].items() if h in mine)
        assert near >= 38, (gateway, mine, got)
        served |= set(got["seen"])
    assert len(served) >= 2, served
    text = swarmctl(sl, spare, "serve", "show", "web").stdout
    assert "healthy" in text and "via" not in text, text  # a mesh of public hosts: every path direct

    # a replica host dies under load: the spare's gateway sends to the two replicas 5 ms away;
    # one of them is crashed, requests in flight there are retried on the other
    victim = sorted(h for h in replicas if h != "h1")[0]
    result: dict = {}
    names = overlay_names(sl)

    def run_load() -> None:
        result.update(load(sl, spare, workers=4, seconds=30, names=names))

    loader = threading.Thread(target=run_load)
    loader.start()
    time.sleep(5)  # load under way (its requests are counted when it ends)
    sl.crash(victim)
    victim_id = sl.state.host(victim).peer_id
    until(lambda: any(p["peer"] == victim_id and p["state"] == "dead" for p in call(sl, "h1", "peers")["peers"]),
          60, f"{victim} declared dead", interval=0.2)
    since = time.monotonic()
    until(lambda: (hosts := healthy(sl, "h1", 3)) and victim_id not in hosts, 60, "a replacement replica healthy",
          interval=0.25, detail=lambda: call(sl, "h1", "serve.show", name="web"))
    replaced = time.monotonic() - since
    loader.join(timeout=200)
    print("the spare's gateway after the crash:", json.dumps(call(sl, spare, "serve.show", name="web")["replicas"]))
    total = sum(result["seen"].values()) + result["failed"]
    print(f"crash under load: {total} requests, {result['failed']} failed, answered by {result['seen']}; "
          f"replacement healthy {replaced:.1f} s after the death was declared")
    assert total > 200 and result["failed"] <= total // 1000, result
    assert replaced < 20, f"{replaced:.1f} s"  # the bench's figure; 10 s is the target on an idle machine
    assert spare in {peer[p] for p in healthy(sl, "h1", 3)}, "the replacement went to the host without one"


def test_a_member_claiming_the_service_or_announcing_replicas_of_it_gets_no_request(sl, tmp_path):
    """A certified member (the intruder, in a host's namespace) claims `web` with a backdated
    creation and announces replicas of it, one under the real controller's name: every
    gateway keeps sending every request to the real replicas, and shows the claim as a
    contender."""
    ensure_web(sl, tmp_path)
    h1 = sl.state.host("h1")
    inside = next(h for h in ("h2", "h3", "h4") if not sl.state.host(h).crashed)  # the crash test's victim is off
    intruder = subprocess.Popen(
        ["ip", "netns", "exec", sl.state.host(inside).netns, sys.executable, "-m", "sim.netlab.intruder",
         "serve-hijack", "--target", f"/ip4/{h1.address}/tcp/{SWARMD_PORT}/p2p/{h1.peer_id}",
         "--owner-dir", h1.state_dir, "--about", h1.peer_id, "--service", "web", "--seconds", "25"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        until(lambda: call(sl, "h4", "serve.show", name="web")["contenders"], 30, "the intruder's claim seen by h4",
              interval=0.5)
        assert len(call(sl, "h4", "serve.show", name="web")["contenders"]) == 1
        assert call(sl, "h4", "status")["serve"]["unassigned"] >= 2, "both of its replica entries refused"
        for gateway in ("h1", "h4"):
            got = load(sl, gateway, count=30)
            assert got["failed"] == 0 and set(got["seen"]) <= set(HOSTS), got
        shown = call(sl, "h4", "serve.show", name="web")
        members = {sl.state.host(h).peer_id for h in HOSTS}
        assert shown["controller"] == h1.peer_id and {r["host"] for r in shown["replicas"]} <= members, shown
        assert "claims the name too" in swarmctl(sl, "h4", "serve", "show", "web").stdout
    finally:
        out, err = intruder.communicate(timeout=120)
    assert intruder.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["records"] >= 5


# Through a gateway in the root of a host's namespace: the embedding's answer, and the generation's
# events with the time each arrived (they must arrive one by one, not at the end)
MODEL_CLIENT = r'''
import http.client, json, sys, time
c = http.client.HTTPConnection("127.0.0.1", 8080, timeout=120)
def post(path, body):  # as a client honouring Retry-After: the gateway learns of a replica within its next poll
    for _ in range(10):
        c.request("POST", path, body=json.dumps(body)); r = c.getresponse()
        if r.status != 503: return r
        r.read(); time.sleep(float(r.getheader("Retry-After") or 1))
    return r
r = post("/embed/embed", {"texts": ["a cat sat on the mat", "a kitten on a rug"]})
embed = json.loads(r.read()) if r.status == 200 else {"status": r.status}
r = post("/chat/generate", {"prompt": "What is the capital of France?", "max_new_tokens": 16})
events, began = [], time.monotonic()
while r.status == 200:
    line = r.readline()
    if not line: break
    if line.startswith(b"data: "): events.append([time.monotonic() - began, json.loads(line[6:])])
    if events and events[-1][1].get("done"): break
print(json.dumps({"embed": embed, "events": events, "status": r.status,
                  "body": "" if r.status == 200 else r.read().decode(errors="replace")[:500]}))
'''
EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_model_examples_answer_through_a_gateway_on_another_host_and_tokens_stream(sl):
    pytest.importorskip("transformers", reason="the models extra (make setup installs it)")
    # embed on another host than h1's gateway, chat on a second host, each where a slot is free
    # (each host has 2 job slots; web holds one of most: once in CI h4 ran 2 ranks nobody there
    # coordinated, and embed pinned to it waited 180 s; status's `holding` says whose they are)
    where: list[str] = []

    def two_free() -> bool:
        where[:] = [h for h in ("h4", "h3", "h2", "h1") if not sl.state.host(h).crashed
                    and call(sl, h, "status")["jobs"]["slots_free"] >= 1][:2]
        return len(where) == 2 and where[0] != "h1"

    until(two_free, 60, "a free slot on two hosts, one of them not h1", interval=1.0,
          detail=lambda: {h: call(sl, h, "status")["jobs"] for h in HOSTS if not sl.state.host(h).crashed})
    try:
        for host, (name, script, extra) in zip(where, (("embed", "serve_embed.py", ["--int8"]),
                                                       ("chat", "serve_generate.py", []))):
            r = swarmctl(sl, "h1", "serve", "up", name, "--host", sl.state.host(host).peer_id, "--workdir",
                         str(EXAMPLES), "--health", "/healthz", "--", "python", script, *extra)
            assert r.returncode == 0, r.stderr
        for name in ("embed", "chat"):
            until(lambda: healthy_of(sl, "h1", name), 180, f"{name} healthy (its model loaded)", interval=2.0,
                  detail=lambda: replica_detail(sl, name))
        answered(sl)
    finally:  # a failure here must not leave the models' replicas to the next tests (serve down's saw them)
        for name in ("embed", "chat"):
            swarmctl(sl, "h1", "serve", "down", name)


def replica_detail(lab, name: str) -> dict:
    """A service that does not come up: its controller's view, each replica's job as its
    coordinator shows it, which jobs hold the hosts' slots (twice a replica of embed was never
    placed on h4 here, host None for 180 s), and each host's log lines on those jobs, on members
    and on failed handlers (once in CI chat's job stream to h3 closed as it started: say why)."""
    shown = call(lab, "h1", "serve.show", name=name)
    out = {"service": shown, "jobs": {}, "slots": {}}
    for r in shown.get("replicas") or []:
        for h in HOSTS:
            try:
                out["jobs"][r["job"]] = call(lab, h, "jobs.show", id=r["job"])
                break
            except Exception as exc:  # not this host's job
                out["jobs"][r["job"]] = repr(exc)[:200]
    for h in HOSTS:
        try:
            out["slots"][h] = call(lab, h, "status").get("jobs")
        except Exception as exc:
            out["slots"][h] = repr(exc)[:200]
    marks = (*out["jobs"], '"member ', "handler failed", '"level": "error"')
    out["logs"] = {}
    for h in HOSTS:
        with open(lab.state.host(h).log, errors="replace") as f:
            out["logs"][h] = [line.strip()[:400] for line in f if any(m in line for m in marks)][-12:]
    return out


def answered(sl) -> None:
    """Both models answer through h1's gateway, and the tokens stream."""
    done = subprocess.run(["ip", "netns", "exec", sl.state.host("h1").netns, sys.executable, "-c", MODEL_CLIENT],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    vectors = got["embed"]["embeddings"]
    assert len(vectors) == 2 and len(vectors[0]) == 384
    assert sum(a * b for a, b in zip(*vectors)) > 0.5, "two sentences about a cat are near"
    assert got["status"] == 200, got
    tokens = [(t, e["token"]) for t, e in got["events"] if "token" in e]
    assert got["events"][-1][1].get("done") and len(tokens) >= 5, got["events"]
    assert tokens[0][0] < got["events"][-1][0] - 0.2, "the first token came well before the end: it streamed"
    assert "".join(t for _, t in tokens).strip(), tokens


def healthy_of(lab, host: str, name: str) -> bool:
    try:
        return any(r.get("healthy") for r in call(lab, host, "serve.show", name=name)["replicas"])
    except Exception:
        return False


# Hostile clients of h1's gateway, beside an honest one: a head sent a byte a second, a body
# announced at 1 GiB; the honest client's 20 requests are all answered meanwhile
HOSTILE_CLIENTS = r'''
import http.client, json, socket, threading, time
out = {}
def slow():
    s = socket.create_connection(("127.0.0.1", 8080)); began = time.monotonic()
    try:
        for ch in b"GET /web/ HTTP/1.1\r\nHost: x\r\n":
            s.sendall(bytes([ch])); time.sleep(1.0)
        out["slow"] = "not cut off"
    except OSError:
        out["slow"] = "cut off after %.0f s" % (time.monotonic() - began)
def huge():
    c = http.client.HTTPConnection("127.0.0.1", 8080, timeout=30)
    c.putrequest("POST", "/web/upload"); c.putheader("Content-Length", str(1 << 30)); c.endheaders()
    c.send(b"x" * 65536); r = c.getresponse(); out["huge"] = r.status
t1, t2 = threading.Thread(target=slow), threading.Thread(target=huge); t1.start(); t2.start()
c, ok = http.client.HTTPConnection("127.0.0.1", 8080, timeout=30), 0
for _ in range(20):
    c.request("GET", "/web/ping"); r = c.getresponse(); r.read(); ok += r.status == 200
out["honest_ok"] = ok
t2.join(); t1.join(timeout=60)
print(json.dumps(out))
'''


def test_hostile_clients_of_a_gateway_are_bounded_and_others_are_served(sl, tmp_path):
    ensure_web(sl, tmp_path)
    done = subprocess.run(["ip", "netns", "exec", sl.state.host("h1").netns, sys.executable, "-c", HOSTILE_CLIENTS],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert got["honest_ok"] == 20 and got["huge"] == 413 and got["slow"].startswith("cut off"), got
    refused = call(sl, "h1", "status")["serve"]
    assert refused["gateway"]["state"] == "running", refused


def ensure_web(lab, tmp_path, replicas: int = 2) -> None:
    """Service web up with at least `replicas` healthy replicas (a test run alone deploys it)."""
    if not any(s["name"] == "web" for s in call(lab, "h1", "serve.ls")["services"]):
        (tmp_path / "app.py").write_text(APP)
        assert swarmctl(lab, "h1", "serve", "up", "web", "--replicas", str(replicas), "--workdir", str(tmp_path),
                        "--health", "/healthz", "--", "python", "app.py").returncode == 0
    until(lambda: healthy(lab, "h1", replicas) or healthy(lab, "h1", 3), 120, "healthy replicas", interval=1.0)


TIDE_APP = APP.replace("def do_GET(self):", "def do_GET(self):\n        import time; time.sleep(0.25 if self.path != '/healthz' else 0)")
# An open-loop client: requests at LOW per second, HIGH from FROM to TO seconds into each SEASON,
# for SECONDS, through the gateway at 127.0.0.1:8080; prints its start (wall clock), then its counts
TIDE = r'''
import http.client, json, queue, sys, threading, time
season, low, high, start, end, seconds = map(float, sys.argv[1:7])
tickets, counts, lock, failures = queue.Queue(), {"ok": 0, "failed": 0}, threading.Lock(), []
def get(c):
    c.request("GET", "/tide/x"); r = c.getresponse(); return r.status, r.read()
def worker():
    c = None
    while tickets.get() is not None:
        try:
            try:
                status, body = get(c) if c else (None, b"")
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                status = None  # an idle keep-alive connection the gateway closed: again on a new one, as urllib3
            if status is None:
                c = http.client.HTTPConnection("127.0.0.1", 8080, timeout=30)
                status, body = get(c)
            with lock:
                counts["ok" if status == 200 else "failed"] += 1
                if status != 200: failures.append((round(time.time() - t0, 1), status, body[:80].decode()))
        except (OSError, http.client.HTTPException) as exc:
            c = None
            with lock:
                counts["failed"] += 1; failures.append((round(time.time() - t0, 1), repr(exc)[:80]))
workers = [threading.Thread(target=worker, daemon=True) for _ in range(48)]
[w.start() for w in workers]
t0, due = time.time(), 0.0
print(json.dumps({"t0": t0}), flush=True)
while (now := time.time() - t0) < seconds:
    due += (high if start <= now % season < end else low) * 0.05
    while due >= 1:
        tickets.put(1); due -= 1
    time.sleep(0.05)
[tickets.put(None) for _ in workers]; [w.join(timeout=35) for w in workers]
print(json.dumps({**counts, "failures": failures[:20]}), flush=True)
'''
SEASON, PEAK_FROM, PEAK_TO = 60.0, 25.0, 43.0


def test_an_autoscaled_service_rises_before_its_forecast_peak_and_grows_where_requests_enter(sl, tmp_path):
    """A compressed day (60 s: 0.5 req/s, 12 req/s from 25 to 43 s) replayed through h1's gateway
    against a service controlled from another member (1-3 replicas, 1 request in flight each, 250 ms a
    request): the first day's peak is met reactively and teaches the forecast; on the second
    day the replicas rise before the peak, by the forecast; replicas added for the demand go
    to h1, where it enters."""
    (tmp_path / "app.py").write_text(TIDE_APP)
    ctl = next(h for h in ("h2", "h3", "h4") if not sl.state.host(h).crashed)  # the crash test's victim is off
    # h1, where the requests enter, needs room for what the demand adds: the earlier tests' web
    # service may hold both of its slots (seen: tide's replicas then went to h3 and h4 only)
    if any(s["name"] == "web" for s in call(sl, "h1", "serve.ls")["services"]):
        assert swarmctl(sl, "h1", "serve", "down", "web").returncode == 0
    until(lambda: call(sl, "h1", "status")["jobs"]["slots_free"] == call(sl, "h1", "status")["jobs"]["slots"], 60,
          "h1's slots free", interval=1.0, detail=lambda: call(sl, "h1", "status")["jobs"])
    r = swarmctl(sl, ctl, "serve", "up", "tide", "--replicas", "1:3", "--target-inflight", "1", "--predictive", "on",
                 "--season", f"{SEASON:g}s", "--workdir", str(tmp_path), "--health", "/healthz", "--", "python",
                 "app.py")
    assert r.returncode == 0, r.stderr
    # the day compressed 1440x: the windows too (Knative's 60 s and 6 s would span the whole day)
    call(sl, ctl, "serve.scale", name="tide", autoscale={"stable_s": 6.0, "panic_s": 2.0, "down_delay_s": 8.0})
    until(lambda: healthy_of(sl, "h1", "tide"), 120, "tide serving in h1's registry", interval=1.0)
    try:
        peer = {sl.state.host(h).peer_id: h for h in HOSTS}
        client = subprocess.Popen(["ip", "netns", "exec", sl.state.host("h1").netns, sys.executable, "-c", TIDE,
                                   str(SEASON), "0.5", "12", str(PEAK_FROM), str(PEAK_TO), str(SEASON + PEAK_FROM + 6)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            t0 = json.loads(client.stdout.readline())["t0"]
            timeline = []
            while client.poll() is None:
                shown = call(sl, ctl, "serve.show", name="tide")
                timeline.append((round(time.time() - t0), [(r["index"], peer.get(r.get("host"), "-"), r.get("healthy"),
                                                            r.get("draining")) for r in shown["replicas"]]))
                time.sleep(1.0)
            counts = json.loads(client.stdout.read().splitlines()[-1])
        finally:
            client.kill()
        shown = call(sl, ctl, "serve.show", name="tide")["autoscale"]
        events = [(round(e["at"] - t0, 1), e["from"], e["to"], e["mode"], e["reason"]) for e in shown["events"]]
        detail = json.dumps({"events": events, "counts": counts, "timeline": timeline[::3],
                             "scaler": shown["scaler"]}, default=str)[:6000]
        first_day = [e for e in events if PEAK_FROM - 5 <= e[0] < SEASON and e[2] > e[1]]
        assert first_day and first_day[0][3] in ("panic", "stable"), "the first day's peak is met reactively: " + detail
        ahead = [e for e in events if SEASON <= e[0] < SEASON + PEAK_FROM and e[2] > e[1] and e[3] == "forecast"]
        assert ahead, "on the second day the replicas rise before the peak, by the forecast: " + detail
        assert ahead[0][1] == 1 and "forecast:" in ahead[0][4], detail
        first_host: dict[int, str] = {}
        for _, rows in timeline:
            for index, host, _, _ in rows:
                if host != "-":
                    first_host.setdefault(index, host)
        # the first replica added for the demand goes to h1, where it enters (unless the first one,
        # placed for spread before any demand, happens to be there: a sibling is placed apart)
        if first_host.get(1) != "h1" and first_host.get(0) != "h1":
            slots = {h: call(sl, h, "status").get("jobs") for h in HOSTS if not sl.state.host(h).crashed}
            raise AssertionError(f"the first replica added is not on h1: {first_host}; "
                                 f"slots {json.dumps(slots, default=str)[:3000]} {detail}")
        assert shown["demand"] is not None and counts["failed"] <= 0.01 * counts["ok"], detail
        text = swarmctl(sl, ctl, "serve", "show", "tide").stdout
        print(text)
        assert "predictive (season 1m)" in text and "forecast" in text, text
    finally:  # a failure here must not leave tide up for the next test's registries
        assert swarmctl(sl, ctl, "serve", "down", "tide").returncode == 0


def test_serve_down_leaves_nothing(sl, tmp_path):
    ensure_web(sl, tmp_path)
    r = swarmctl(sl, "h1", "serve", "down", "web")
    assert r.returncode == 0, r.stderr
    alive = [h for h in HOSTS if not sl.state.host(h).crashed]
    until(lambda: all(call(sl, h, "serve.ls")["services"] == [] for h in alive), 60,
          "the service gone from every registry", interval=1.0)
    until(lambda: all(j["state"] in ("cancelled", "failed", "succeeded") for j in call(sl, "h1", "jobs.ls")["jobs"]),
          30, "every replica's job ended")
    status = call(sl, "h1", "status")["serve"]
    assert status["controlled"] == [] and not any(call(sl, h, "status")["serve"]["replicas_here"] for h in alive)
    ps = subprocess.run(["ps", "-eo", "uid=,args="], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if "app.py" in line and 61184 <= int(line.split()[0]) <= 65519]
    assert not list((Path(sl.state.host("h1").state_dir) / "services").glob("*.json"))
