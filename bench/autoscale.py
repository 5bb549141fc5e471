"""Autoscaling (issue 28; needs root): one compressed trace replayed, in one 4-host lab, against
a fixed count, our reactive scaler, reactive plus predictive, and Ray Serve's autoscaler (its
defaults, and its windows compressed as ours are) in a Ray job on the same hosts.

The lab is tests/netlab/test_serve.py's: h1 is 40 ms from everyone, h2-h4 5 ms from each
other. Requests enter at h1 only; replicas run on h2-h4 (pinned: `--host`, and the Ray job
on those three), each on its own host (as swarmd's replicas must be; Ray Serve's
max_replicas_per_node=1), so every replica is 40 ms from where the load enters, the same
for both systems.

- The replica: a request holds one of K=2 slots for SERVICE_S=200 ms (asyncio sleep: the
  machine's 2 cores are shared by the four daemons), later ones queue in the replica, so
  one replica serves 10 req/s and its latency grows with its queue, as a model server's
  does. Ray Serve runs the same code as a deployment (max_ongoing_requests left at its
  default, 5: up to 5 wait in the replica, Ray's router holds the rest; our gateway sends a
  replica up to 64).
- The trace (``trace``, pure, seeded): SEASONS compressed "days" of SEASON_S each: BASE
  req/s, a daily peak rising to PEAK req/s (a sin² bump over 40 % of the season), and in the
  last season an unforecast BURST (BURST req/s for BURST_S, in the quiet hours before
  the peak).
  Arrivals are Poisson (thinning), the same seed for every variant: the very same request
  times. An open-loop client (aiohttp, keep-alive pool) sends each at its time: to h1's
  gateway from h1's namespace, to Ray Serve's proxy (on the Ray head, one of h2-h4) through
  `swarmctl jobs forward` on h1, as a user reaches a Ray job.
- Per run: requests over the SLO (latency over SLO_MS, or failed), their p50/p99;
  replica-seconds (the live replica count sampled every second: ours from h1's `serve.show`,
  rows with a job, starting and draining ones included; Ray's from the driver printing
  `serve.status()`'s replica states, all states counted) integrated over the trace; scaling
  events (changes of the count the scaler decided: ours `autoscale.replicas`; Ray's, changes
  of its replica count, which is what its decisions show as).
- Compression: a day is SEASON_S here (1,440 times shorter than a real one), but a replica
  still takes its 2-3 s to start, so windows cannot shrink as much: every window is divided
  by COMPRESS (20): ours stable 3 s, panic 0.3 s, down-delay 30 s (half a season, against
  0.7 % of a real day); Ray Serve runs twice, its defaults untouched (look-back 30 s,
  upscale delay 30 s, downscale delay 600 s, metrics every 10 s) and with the same windows
  divided by COMPRESS. Target in flight per replica: 2 for all (Ray's default
  target_ongoing_requests). Our p99 SLO step is off in these rows (Ray's autoscaler has none;
  variant reactive_slo turns it on, run apart). The fixed variant runs MAX_REPLICAS (3: what
  the peak needs).
- Demand placement: the reactive scaler once more for one season, unpinned (any of the 4
  hosts, 1-4 replicas): replicas placed by where requests enter may go to h1 itself. Its
  replicas' demand-weighted RTT (``serve.show``'s ``demand_rtt_ms``, averaged over replica
  time) against the pinned run's (40 ms by construction: placement there cannot follow the
  demand), and the clients' p50 and SLO violations in that season.

Knobs: SWARMD_BENCH_AUTOSCALE_SEASON_S (60), SWARMD_BENCH_AUTOSCALE_VARIANTS (fixed,reactive,
predictive,ray,ray_compressed,demand: which run; reactive_slo and ray_fixed besides).

    python -m bench.autoscale
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from sim.netlab import lab as labmod
from sim.netlab import topology
from swarmd.compute.spec import build
from swarmd.compute.workdir import pack
from swarmd.rpc.client import Client

OUT = Path(".bench")
HOSTS = ("h1", "h2", "h3", "h4")
REPLICA_HOSTS = ("h2", "h3", "h4")
SEASON_S = float(os.environ.get("SWARMD_BENCH_AUTOSCALE_SEASON_S", "60"))
SEASONS = 3
BASE, PEAK = 3.0, 20.0  # req/s
BURST, BURST_AT, BURST_S = 22.0, 0.38, 9.0  # req/s, phase of the last season, seconds
SEED = 28
SERVICE_S, SLOTS = 0.2, 2  # a replica: 200 ms a request, 2 at a time: 10 req/s
SLO_MS = 500.0
TARGET_INFLIGHT = 2.0  # Ray Serve's default target_ongoing_requests
MAX_REPLICAS = 3
COMPRESS = 20.0
OURS = {"stable_s": 60.0 / COMPRESS, "panic_s": 6.0 / COMPRESS, "down_delay_s": 600.0 / COMPRESS, "idle_s": 600.0}
RAY_COMPRESSED = {"look_back_period_s": 30.0 / COMPRESS, "upscale_delay_s": 30.0 / COMPRESS,
                  "downscale_delay_s": 600.0 / COMPRESS, "metrics_interval_s": 10.0 / COMPRESS}
# besides (run apart, see the README): reactive_slo, the reactive scaler with the 500 ms p99 SLO
# step on; ray_fixed, Ray Serve with 3 replicas and no autoscaling (its path's own latency)
VARIANTS = os.environ.get("SWARMD_BENCH_AUTOSCALE_VARIANTS",
                          "fixed,reactive,predictive,ray,ray_compressed,demand").split(",")
FORWARD_PORT = 18410

APP = textwrap.dedent(f"""
    import asyncio, os
    from aiohttp import web
    slots = asyncio.Semaphore({SLOTS})
    async def work(request):
        async with slots:
            await asyncio.sleep({SERVICE_S})
        return web.Response(text="ok")
    async def health(request):
        return web.Response(text="ok")
    app = web.Application()
    app.router.add_get("/healthz", health)
    app.router.add_route("*", "/{{tail:.*}}", work)
    web.run_app(app, host="0.0.0.0", port=int(os.environ["PORT"]), print=None, access_log=None)
""")
# The same replica as a Ray Serve deployment; the driver prints its replica states every second
RAY_APP = textwrap.dedent(f"""
    import asyncio, json, signal, sys, threading, time
    import ray
    from ray import serve
    from starlette.responses import PlainTextResponse
    given = json.loads(sys.argv[1])
    options = ({{"num_replicas": given["fixed"]}} if "fixed" in given else
               {{"autoscaling_config": {{"min_replicas": 1, "max_replicas": {MAX_REPLICAS}, **given}}}})
    ray.init()
    serve.start(proxy_location="HeadOnly", http_options={{"host": "0.0.0.0", "port": 8000}})
    @serve.deployment(ray_actor_options={{"num_cpus": 0}}, max_replicas_per_node=1, **options)
    class Work:
        def __init__(self):
            self.slots = asyncio.Semaphore({SLOTS})
        async def __call__(self, request):
            async with self.slots:
                await asyncio.sleep({SERVICE_S})
            return PlainTextResponse("ok")
    serve.run(Work.bind(), name="work", route_prefix="/work")
    print("options", json.dumps(options), flush=True)
    print("serving on port 8000", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        try:
            states = serve.status().applications["work"].deployments["Work"].replica_states
            states = {{str(getattr(k, "value", k)): v for k, v in states.items()}}
            print(f"REPLICAS {{time.time():.2f}} {{sum(states.values())}} {{json.dumps(states)}}", flush=True)
        except Exception as exc:
            print(f"REPLICAS? {{exc!r}}", flush=True)
""")
# An open-loop client: each request at its time from the start, whatever the answers before it
CLIENT = textwrap.dedent("""
    import asyncio, json, sys, time
    import aiohttp
    url, arrivals, out = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
    rows = []
    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=30)) as s:
            async def one(at):
                began = time.monotonic()
                try:
                    async with s.get(url) as r:
                        await r.read()
                        status = r.status
                except Exception:
                    status = 0
                rows.append((round(at, 4), round(time.monotonic() - began, 4), status))
            t0, start = time.monotonic(), time.time()
            tasks = []
            for at in arrivals:
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(at)))
            await asyncio.gather(*tasks)
        json.dump({"start": start, "rows": rows}, open(out, "w"))
    asyncio.run(main())
""")


# --- the trace and the figures (pure) ------------------------------------------------------------

def rate(t: float, season_s: float = SEASON_S, seasons: int = SEASONS) -> float:
    """Requests per second at t: the base, the daily peak (a sin² bump over phases 0.55-0.95,
    highest at 0.75), and in the last season the burst (phases 0.38-0.53 of a 60 s season:
    after the down-delay has let the last peak's replicas go, before the next peak)."""
    phase = (t % season_s) / season_s
    r = BASE
    if 0.55 <= phase < 0.95:
        r += (PEAK - BASE) * math.sin(math.pi * (phase - 0.55) / 0.4) ** 2
    last = (seasons - 1) * season_s
    if last + BURST_AT * season_s <= t < last + BURST_AT * season_s + BURST_S:
        r = max(r, BURST)
    return r


def trace(season_s: float = SEASON_S, seasons: int = SEASONS, seed: int = SEED) -> list[float]:
    """Poisson arrival times (s from the start) at ``rate``, by thinning: the same for every run."""
    rng, top, t, out = random.Random(seed), max(PEAK, BURST), 0.0, []
    end = season_s * seasons
    while True:
        t += rng.expovariate(top)
        if t >= end:
            return out
        if rng.random() < rate(t, season_s, seasons) / top:
            out.append(round(t, 4))


def integrate(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """∫ count dt over [start, end], each sample holding until the next (the first from start)."""
    total = 0.0
    inside = sorted((t, n) for t, n in samples if t < end)
    for i, (t, n) in enumerate(inside):
        nxt = inside[i + 1][0] if i + 1 < len(inside) else end
        lo, hi = max(t, start), min(nxt, end)
        if hi > lo:
            total += n * (hi - lo)
    return total


def changes(counts: list[float]) -> int:
    return sum(1 for a, b in zip(counts, counts[1:]) if a != b)


def figures(rows: list[list[float]], t0: float = 0.0, t1: float = float("inf")) -> dict[str, float]:
    """The clients' rows (arrival, latency s, status) with arrival in [t0, t1)."""
    got = [(lat, status) for at, lat, status in rows if t0 <= at < t1]
    ok = sorted(lat * 1000 for lat, status in got if status == 200)
    over = sum(1 for lat, status in got if status != 200 or lat * 1000 > SLO_MS)
    q = (lambda p: statistics.quantiles(ok, n=100, method="inclusive")[p - 1]) if len(ok) > 1 else (lambda p: math.nan)
    return {"requests": float(len(got)), "over_slo": float(over), "over_slo_pct": 100.0 * over / max(len(got), 1),
            "failed": float(sum(1 for _, s in got if s != 200)), "p50_ms": q(50), "p99_ms": q(99)}


# --- the lab -------------------------------------------------------------------------------------

def statuses(rows: list[list[float]]) -> dict[str, int]:
    """How the requests ended: a count per HTTP status (0: no answer)."""
    out: dict[str, int] = {}
    for _, _, status in rows:
        out[str(int(status))] = out.get(str(int(status)), 0) + 1
    return out


def ray_replicas(logs: str) -> list[tuple[float, float]]:
    """(time, replicas) from the Ray driver's `REPLICAS <time> <count> <states>` lines, as
    `swarmctl jobs logs` prints them (`[rank 0] …`); anything else is skipped."""
    out = []
    for line in logs.splitlines():
        words = line.split("] ", 1)[-1].split(" ", 3)
        if len(words) >= 3 and words[0] == "REPLICAS":
            try:
                out.append((float(words[1]), float(words[2])))
            except ValueError:
                continue
    return out


def _rtt(a, b) -> float:
    return 40.0 if "h1" in (a.name, b.name) else 5.0


def _call(lab: labmod.Lab, host: str, method: str, **params: Any) -> Any:
    with Client(lab.state.host(host).socket, timeout=15) as c:
        return c.call(method, **params)


def _swarmctl(lab: labmod.Lab, host: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "SWARMD_SOCKET": lab.state.host(host).socket, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "swarmctl.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _until(predicate, timeout: float, what: str, interval: float = 0.5) -> float:
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except Exception:  # noqa: BLE001 - a daemon busy: the next look
            pass
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"bench: not within {timeout:g} s: {what}")
        time.sleep(interval)


def _client(lab: labmod.Lab, netns_of: str | None, url: str, arrivals: Path, out: Path) -> dict:
    argv = [sys.executable, "-c", CLIENT, url, str(arrivals), str(out)]
    if netns_of is not None:
        argv = ["ip", "netns", "exec", lab.state.host(netns_of).netns, *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=SEASON_S * SEASONS + 120)
    if done.returncode != 0:
        raise RuntimeError(f"bench: the client: {done.stderr[-2000:]}")
    return json.loads(out.read_text())


class Sampler:
    """h1's `serve.show` of a service every second, in a thread, while the load runs."""

    def __init__(self, lab: labmod.Lab, name: str) -> None:
        self.lab, self.name, self.rows = lab, name, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                shown = _call(self.lab, "h1", "serve.show", name=self.name)
            except Exception:  # noqa: BLE001 - a busy daemon: the next second
                shown = None
            if shown is not None:
                live = [r for r in shown["replicas"] if r.get("job")]
                a = shown.get("autoscale") or {}
                self.rows.append({"at": time.time(), "live": len(live),
                                  "healthy": sum(1 for r in live if r.get("healthy") and not r.get("draining")),
                                  "wanted": a.get("replicas", shown.get("replicas_wanted")),
                                  "mode": (a.get("decision") or {}).get("mode"),
                                  "demand_rtt_ms": [r.get("demand_rtt_ms") for r in live if r.get("host")],
                                  "in_flight": [r.get("in_flight") for r in live],  # at h1's gateway
                                  "hosts": [r.get("host") for r in live]})
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - began)))


def _upload(lab: labmod.Lab, work: Path) -> str:
    packed = pack(work)
    with Client(lab.state.host("h1").socket, timeout=60) as c:
        c.call("jobs.upload", digest=packed.digest, offset=0, size=len(packed.data), data=packed.data)
    return packed.digest


def _serve_up(lab: labmod.Lab, name: str, digest: str, *, fixed: int | None, autoscale: dict | None,
              pinned: bool) -> None:
    hosts = [lab.state.host(h).peer_id for h in REPLICA_HOSTS] if pinned else None
    fields = {"cmd": ["python", "app.py"], **({"hosts": hosts} if hosts else {})}
    template = {k: v for k, v in build(fields, {}).to_wire().items() if k in fields}
    params = {"name": name, "template": template, "workdir": digest, "health": "/healthz", "access": "members",
              **({"autoscale": autoscale} if autoscale else {"replicas": fixed})}
    _call(lab, "h1", "serve.up", **params)


def _healthy(lab: labmod.Lab, name: str, want: int) -> bool:
    shown = _call(lab, "h1", "serve.show", name=name)
    ready = sum(1 for r in shown["replicas"]
                if r.get("healthy") and not r.get("draining") and r.get("ejected") is False)
    return ready >= want


def _serve_down(lab: labmod.Lab, name: str) -> None:
    _call(lab, "h1", "serve.down", name=name)
    _until(lambda: all(s["name"] != name for s in _call(lab, "h1", "serve.ls")["services"]), 120,
           f"{name} gone from h1's registry")
    _until(lambda: all(j["state"] in ("cancelled", "failed", "succeeded") for j in _call(lab, "h1", "jobs.ls")["jobs"]),
           60, "every replica's job ended")


def run_ours(lab: labmod.Lab, variant: str, digest: str, arrivals: Path, work: Path) -> tuple[dict, dict]:
    if variant == "demand":  # one season of the trace
        first = [a for a in json.loads(arrivals.read_text()) if a < SEASON_S]
        arrivals = work / "arrivals_demand.json"
        arrivals.write_text(json.dumps(first))
    name = f"as{variant.replace('_', '')[:10]}"
    season = SEASON_S
    pinned = variant != "demand"
    autoscale = None
    if variant != "fixed":
        autoscale = {"min": 1, "max": MAX_REPLICAS if pinned else len(HOSTS), "target_inflight": TARGET_INFLIGHT,
                     **OURS, "predictive": variant == "predictive", "season_s": season,
                     **({"slo_p99_ms": SLO_MS} if variant == "reactive_slo" else {})}
    _serve_up(lab, name, digest, fixed=MAX_REPLICAS if variant == "fixed" else None, autoscale=autoscale,
              pinned=pinned)
    want = MAX_REPLICAS if variant == "fixed" else 1
    _until(lambda: _healthy(lab, name, want), 180, f"{name}: {want} replica(s) healthy and routed at h1")
    got = None
    try:
        with Sampler(lab, name) as sampler:
            got = _client(lab, "h1", f"http://127.0.0.1:8080/{name}/work", arrivals, work / f"{name}.json")
        shown = _call(lab, "h1", "serve.show", name=name)
    finally:
        _serve_down(lab, name)
    return _summarise_ours(variant, got, sampler.rows, shown)


def _summarise_ours(variant: str, got: dict, samples: list[dict], shown: dict) -> tuple[dict, dict]:
    start = got["start"]
    end = start + (SEASON_S if variant == "demand" else SEASON_S * SEASONS)
    out = figures(got["rows"])
    out["quiet_p50_ms"] = figures(got["rows"], 0.0, 0.3 * SEASON_S)["p50_ms"]  # one replica, the base load
    inside = [s for s in samples if start <= s["at"] < end]
    out["replica_s"] = integrate([(s["at"], s["live"]) for s in samples], start, end)
    events = [e for e in (shown.get("autoscale") or {}).get("events") or [] if start <= e["at"] < end]
    # the daemon keeps the last 20 events: the sampled count's changes when more happened
    out["events"] = float(max(sum(e["mode"] != "move" for e in events), changes([s["wanted"] for s in inside])))
    out["moves"] = float(sum(e["mode"] == "move" for e in events))
    out["max_replicas"] = float(max((s["live"] for s in inside), default=0))
    weighted = [(rtt, 1) for s in inside for rtt in s["demand_rtt_ms"] if rtt is not None]
    if weighted:
        out["demand_rtt_ms"] = statistics.fmean(r for r, _ in weighted)
    raw = {"figures": out, "samples": samples, "statuses": statuses(got["rows"]), "rows": got["rows"],
           "events": (shown.get("autoscale") or {}).get("events"),
           "scaler": (shown.get("autoscale") or {}).get("scaler"), "start": start}
    return out, raw


# --- Ray Serve -----------------------------------------------------------------------------------

def run_ray(lab: labmod.Lab, variant: str, work: Path, arrivals: Path) -> tuple[dict, dict]:
    config = {"ray": {}, "ray_compressed": RAY_COMPRESSED, "ray_fixed": {"fixed": MAX_REPLICAS}}[variant]
    hosts = ",".join(lab.state.host(h).peer_id for h in REPLICA_HOSTS)
    r = _swarmctl(lab, "h1", "jobs", "run", "--ray", "--nodes", "3", "--host", hosts, "--detach", "--workdir",
                  str(work), "--", "python", "ray_app.py", json.dumps(config))
    if r.returncode != 0:
        raise RuntimeError(f"bench: the Ray Serve job: {r.stderr[-2000:]}")
    job = r.stdout.split()[-1]
    forward = None
    try:
        _until(lambda: "serving on port 8000" in _swarmctl(lab, "h1", "jobs", "logs", job).stdout, 300,
               "Ray Serve's app deployed", interval=2)
        env = {**os.environ, "SWARMD_SOCKET": lab.state.host("h1").socket}
        forward = subprocess.Popen([sys.executable, "-m", "swarmctl.main", "jobs", "forward", job,
                                    f"{FORWARD_PORT}:8000"], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        first = forward.stdout.readline() if forward.stdout else ""
        if "forwarding" not in first:
            raise RuntimeError(f"bench: jobs forward: {first}")
        import urllib.request

        url = f"http://127.0.0.1:{FORWARD_PORT}/work"
        _until(lambda: urllib.request.urlopen(url, timeout=10).status == 200, 60, "Ray Serve answering")
        got = _client(lab, None, url, arrivals, work / f"{variant}.json")
        logs = _swarmctl(lab, "h1", "jobs", "logs", job).stdout
    finally:
        if forward is not None:
            forward.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                forward.communicate(timeout=10)
            if forward.poll() is None:
                forward.kill()
        _swarmctl(lab, "h1", "jobs", "cancel", job)
        with contextlib.suppress(RuntimeError):
            _until(lambda: _call(lab, "h1", "jobs.show", id=job)["state"] in ("cancelled", "failed", "succeeded"),
                   90, "the Ray Serve job ended")
    samples = ray_replicas(logs)
    start, end = got["start"], got["start"] + SEASON_S * SEASONS
    out = figures(got["rows"])
    out["quiet_p50_ms"] = figures(got["rows"], 0.0, 0.3 * SEASON_S)["p50_ms"]  # one replica, the base load
    out["replica_s"] = integrate(samples, start, end)
    out["events"] = float(changes([n for t, n in samples if start <= t < end]))
    out["max_replicas"] = float(max((n for t, n in samples if start <= t < end), default=0))
    config_line = next((ln.split("] options ", 1)[1] for ln in logs.splitlines() if "] options " in ln), None)
    return out, {"figures": out, "samples": samples, "options": config_line, "start": start,
                 "statuses": statuses(got["rows"]), "rows": got["rows"]}


# --- all of it -----------------------------------------------------------------------------------

def measure() -> dict[str, float]:
    results: dict[str, float] = {}
    raw: dict[str, Any] = {"season_s": SEASON_S, "seasons": SEASONS, "slo_ms": SLO_MS, "service_s": SERVICE_S,
                           "slots": SLOTS, "ours": OURS, "ray_compressed": RAY_COMPRESSED, "runs": {}}
    arrivals = trace()
    raw["requests"] = len(arrivals)
    name = "benchas"
    hosts, links = topology.plan(len(HOSTS), _rtt)
    lab = labmod.Lab.up(name, hosts, links, mesh=True, daemon_args=["--gateway-listen", "127.0.0.1:8080"])
    try:
        lab.wait_formed()
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            os.chmod(work, 0o755)
            (work / "app.py").write_text(APP)
            (work / "ray_app.py").write_text(RAY_APP)
            (work / "arrivals.json").write_text(json.dumps(arrivals))
            digest = _upload(lab, work)
            for variant in VARIANTS:
                print(f"  autoscale: {variant}, {SEASONS if variant != 'demand' else 1} season(s) of "
                      f"{SEASON_S:g} s...", flush=True)
                try:
                    if variant.startswith("ray"):
                        out, raw["runs"][variant] = run_ray(lab, variant, work, work / "arrivals.json")
                    else:
                        out, raw["runs"][variant] = run_ours(lab, variant, digest, work / "arrivals.json", work)
                except Exception as exc:  # noqa: BLE001 - one variant failing: the others still run
                    print(f"  autoscale: {variant} failed: {exc}", file=sys.stderr, flush=True)
                    raw["runs"][variant] = {"error": str(exc)}
                    continue
                print(f"  autoscale: {variant}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
                results |= {f"autoscale_{variant}_{k}": v for k, v in out.items()}
    finally:
        labmod.down(name)
    results |= _comparisons(results)
    OUT.mkdir(exist_ok=True)
    (OUT / "autoscale.json").write_text(json.dumps({"results": results, "raw": raw}, indent=2))
    return results


def _comparisons(r: dict[str, float]) -> dict[str, float]:
    """The issue's target: SLO violations against Ray Serve's defaults (fewer, in %), replica-seconds
    over them (in %)."""
    out = {}
    for ours in ("reactive", "predictive"):
        a, b = r.get(f"autoscale_{ours}_over_slo"), r.get("autoscale_ray_over_slo")
        if a is not None and b:
            out[f"autoscale_{ours}_fewer_violations_than_ray_pct"] = 100.0 * (b - a) / b
        a, b = r.get(f"autoscale_{ours}_replica_s"), r.get("autoscale_ray_replica_s")
        if a is not None and b:
            out[f"autoscale_{ours}_more_replica_s_than_ray_pct"] = 100.0 * (a - b) / b
    return out


def table(r: dict[str, float]) -> str:
    rows = ["| run | requests | over the SLO (500 ms) | p50 / p99 ms | replica-s | scaling events |",
            "| --- | --- | --- | --- | --- | --- |"]
    for v in ("fixed", "reactive", "reactive_slo", "predictive", "ray_fixed", "ray", "ray_compressed"):
        if f"autoscale_{v}_requests" not in r:
            continue
        g = lambda k: r[f"autoscale_{v}_{k}"]  # noqa: E731
        rows.append(f"| {v} | {g('requests'):.0f} | {g('over_slo'):.0f} ({g('over_slo_pct'):.1f} %) | "
                    f"{g('p50_ms'):.0f} / {g('p99_ms'):.0f} | {g('replica_s'):.0f} | {g('events'):.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    got = measure()
    print(json.dumps(got, indent=2))
    print(table(got))
