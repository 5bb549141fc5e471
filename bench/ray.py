"""Ray jobs (issue 14; needs root): a 3-host lab with the mesh (10 ms links), Ray jobs
submitted with the real `swarmctl jobs run --ray`, each Ray node one CPU of its host.

1. Start-up: `jobs run --ray --nodes 3` of a driver that prints the time right after
   `ray.init()`, until that time (the clocks are one: the lab's namespaces share the
   machine's), median of RUNS; beside it the head's own `[swarmd] Ray cluster up ... in X s`.
   Anchor, in the same lab: stock Ray started by hand as root in the hosts' namespaces
   (`ray start --head --block` on h1, `ray start --address` on h2 and h3 as soon as the
   head's GCS port answers, every port pinned to a block the swarm does not use, a temp dir
   of its own), until a driver on h1 that waits for 3 alive nodes is connected; and from
   SIGTERM to its three `ray start --block` leaders until all have exited. Stock Ray
   runs on the hosts' underlay addresses: the mesh interface answers only jobs' sockets
   (the job firewall), and root is no job.
2. Idle: a detached Ray job on 3 hosts whose driver sleeps; after SETTLE_S, CPU (% of one
   core over WINDOW_S) and RSS / PSS summed over the processes of the job's uid on each
   host (found by network namespace), the head's host without the driver (shown apart),
   the workers' mean. The same for the stock cluster of the last anchor run (root's Ray
   processes there; no driver left by then).
3. The Tune example (`tune_digits.py --trials 12 --max-epochs 6`) on 1 host and on 3:
   wall time of `swarmctl jobs run` and the example's own `N trials in X s`.
4. Serve: `serve_digits.py` on 3 hosts, detached, reached through `swarmctl jobs forward`;
   `examples/load.py --concurrency 16 --duration LOAD_S --json` against /batched and
   /plain, LOAD_ROUNDS rounds in alternating order: req/s, p50, p99 (means of the rounds),
   errors (all rounds), and the connections `jobs forward` refused (it says why on stderr).
   The forward, the load generator and the lab share the machine's cores.

Knobs: SWARMD_BENCH_RAY_RUNS (3), SWARMD_BENCH_RAY_SETTLE (20 s), SWARMD_BENCH_RAY_LOAD_S
(10 s), SWARMD_BENCH_RAY_LOAD_ROUNDS (2), SWARMD_BENCH_RAY_STEPS (connect,stock,idle,tune,serve: which of them run).
Stock Ray is stopped by the pids it started (SIGTERM, then SIGKILL), never `ray stop`,
which kills every Ray process on the machine.

    python -m bench.ray
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from sim.netlab import lab as labmod
from sim.netlab import topology

RUNS = int(os.environ.get("SWARMD_BENCH_RAY_RUNS", "3"))
SETTLE_S = float(os.environ.get("SWARMD_BENCH_RAY_SETTLE", "20"))
WINDOW_S = 10.0
LOAD_S = float(os.environ.get("SWARMD_BENCH_RAY_LOAD_S", "10"))
LOAD_ROUNDS = int(os.environ.get("SWARMD_BENCH_RAY_LOAD_ROUNDS", "2"))
CONCURRENCY = 16
STEPS = os.environ.get("SWARMD_BENCH_RAY_STEPS", "connect,stock,idle,tune,serve").split(",")
TUNE_ARGS = ("--trials", "12", "--max-epochs", "6")
JOB_UIDS = range(61184, 65520)  # the lab hosts' job uids
EXAMPLES = Path(__file__).parents[1] / "examples"
OUT = Path(".bench")
FORWARD_PORT = 18400
STOCK_GCS = 31000  # stock Ray's ports: above the swarm's ray_ports (20000-29999), below the ephemeral ones
STOCK_BLOCK = (31001, 100)
STOCK_OBJECT_STORE = 200 * 2**20  # three object stores in one /dev/shm

CONNECT = """
import time
import ray
ray.init()
print(f"CONNECTED {time.time():.3f}", flush=True)
"""

HOLD = CONNECT + "time.sleep(3600)\n"

STOCK_DRIVER = """
import sys, time
from ray._raylet import GcsClient
address, want = sys.argv[1], int(sys.argv[2])
while True:
    try:
        if sum(1 for n in GcsClient(address=address).get_all_node_info(timeout=2).values() if n.state == 0) >= want:
            break
    except Exception:
        pass
    time.sleep(0.2)
import ray
ray.init(address=address)
print(f"CONNECTED {time.time():.3f}", flush=True)
"""

WAIT_THEN_EXEC = """
import os, socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
while True:
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        break
    except OSError:
        time.sleep(0.2)
os.execv(sys.argv[2], sys.argv[2:])
"""

CLUSTER_UP = re.compile(r"\[swarmd\] Ray cluster up: (\d+) node\(s\), head \S+, in ([0-9.]+) s")
TRIALS_IN = re.compile(r"^(\d+) trials in ([0-9.]+) s$")


# --- reading the output (pure) -------------------------------------------------------------------

def rank_lines(stdout: str) -> dict[int, list[str]]:
    """A job's output as swarmctl prints it (`[rank K] text`), by rank."""
    out: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        if line.startswith("[rank "):
            head, _, text = line.partition("] ")
            try:
                out.setdefault(int(head[6:]), []).append(text)
            except ValueError:
                continue
    return out


def connected_at(lines: Iterable[str]) -> float | None:
    """The time the driver printed right after ray.init()."""
    for line in lines:
        words = line.split()
        if len(words) == 2 and words[0] == "CONNECTED":
            try:
                return float(words[1])
            except ValueError:
                return None
    return None


def cluster_up(lines: Iterable[str]) -> tuple[int, float] | None:
    """(nodes, seconds) from the head's `[swarmd] Ray cluster up: …` line."""
    for line in lines:
        if m := CLUSTER_UP.search(line):
            return int(m.group(1)), float(m.group(2))
    return None


def trials_in(lines: Iterable[str]) -> tuple[int, float] | None:
    """(trials, seconds) from tune_digits.py's `N trials in X s`."""
    for line in lines:
        if m := TRIALS_IN.match(line.strip()):
            return int(m.group(1)), float(m.group(2))
    return None


# --- the lab -------------------------------------------------------------------------------------

def _swarmctl(lab: labmod.Lab, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "SWARMD_SOCKET": lab.state.host("h1").socket, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "swarmctl.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _call(lab: labmod.Lab, method: str, **params):
    from swarmd.rpc.client import Client

    with Client(lab.state.host("h1").socket, timeout=30) as c:
        return c.call(method, **params)


def _until(predicate, timeout: float, what: str, interval: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench: not within {timeout:g} s: {what}")
        time.sleep(interval)


def _job_pids(lab: labmod.Lab) -> dict[str, list[int]]:
    """Each host's processes of a job uid."""
    out: dict[str, list[int]] = {}
    for h in lab.state.hosts:
        pids = []
        for pid in labmod.netns_pids(f"/run/netns/{h.netns}"):
            try:
                if psutil.Process(pid).uids().real in JOB_UIDS:
                    pids.append(pid)
            except psutil.Error:
                continue
        out[h.name] = pids
    return out


def _no_job_left(lab: labmod.Lab) -> None:
    _until(lambda: not any(_job_pids(lab).values()), 30, "no process of a job uid left")


def _all_lines(stdout: str) -> list[str]:
    return [t for texts in rank_lines(stdout).values() for t in texts]


def _ran(r: subprocess.CompletedProcess, what: str) -> list[str]:
    if r.returncode != 0:
        raise RuntimeError(f"bench: {what} exited {r.returncode}: {r.stdout[-3000:]} {r.stderr[-2000:]}")
    return _all_lines(r.stdout)


# --- usage of a set of processes -----------------------------------------------------------------

def usage(groups: dict[str, list[int]], window: float) -> dict[str, dict[str, float]]:
    """CPU (% of one core over `window`), RSS and PSS (MiB) summed over each group's processes
    (and their children, which may start meanwhile)."""
    def procs(pids: list[int]) -> dict[int, psutil.Process]:
        found: dict[int, psutil.Process] = {}
        for pid in pids:
            try:
                p = psutil.Process(pid)
                found[pid] = p
                found |= {c.pid: c for c in p.children(recursive=True)}
            except psutil.Error:
                continue
        return found

    def cpu(p: psutil.Process) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    before = {name: {pid: (p, cpu(p)) for pid, p in procs(pids).items()} for name, pids in groups.items()}
    t0 = time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - t0
    out = {}
    for name, pids in groups.items():
        now = procs(pids)
        used = sum(cpu(p) - before[name].get(pid, (p, 0.0))[1] for pid, p in now.items())
        rss = pss = 0
        for p in now.values():
            try:
                m = p.memory_full_info()
                rss, pss = rss + m.rss, pss + m.pss
            except psutil.Error:
                continue
        out[name] = {"cpu_pct": 100 * used / elapsed, "rss_mb": rss / 2**20, "pss_mb": pss / 2**20,
                     "processes": float(len(now))}
    return out


# --- 1. start-up ---------------------------------------------------------------------------------

def _connect_once(lab: labmod.Lab, work: Path) -> dict[str, float]:
    t0 = time.time()
    r = _swarmctl(lab, "jobs", "run", "--ray", "--nodes", "3", "--workdir", str(work), "--", "python", "connect.py")
    end = time.time()
    lines = _ran(r, "the connect job")
    at, up = connected_at(lines), cluster_up(lines)
    if at is None or up is None or up[0] != 3:
        raise RuntimeError(f"bench: no CONNECTED or cluster-up line: {r.stdout[-3000:]}")
    return {"connected": at - t0, "cluster_up": up[1], "end": end - t0}


def _nsenter(host, *argv: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{host.netns}", "--", *argv]


def _stock_argv(ip: str, temp: Path, head: str | None) -> list[str]:
    from swarmd.compute.host.raynode import layout

    p = layout(*STOCK_BLOCK)
    argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", f"--node-ip-address={ip}",
            f"--node-manager-port={p['node_manager']}", f"--object-manager-port={p['object_manager']}",
            f"--min-worker-port={p['min_worker']}", f"--max-worker-port={p['max_worker']}",
            f"--dashboard-agent-listen-port={p['agent_listen']}", f"--dashboard-agent-grpc-port={p['agent_grpc']}",
            f"--runtime-env-agent-port={p['runtime_env_agent']}", f"--metrics-export-port={p['metrics_export']}",
            "--num-cpus=1", f"--object-store-memory={STOCK_OBJECT_STORE}", f"--temp-dir={temp}",
            "--disable-usage-stats"]
    if head is None:
        return argv + ["--head", f"--port={STOCK_GCS}", f"--ray-client-server-port={p['client_server']}",
                       "--include-dashboard=false"]
    return [sys.executable, "-c", WAIT_THEN_EXEC, head, *argv, f"--address={head}"]


def _stock_env() -> dict[str, str]:
    from swarmd.compute.host.raynode import layout

    p = layout(*STOCK_BLOCK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return env | {"RAY_USAGE_STATS_ENABLED": "0", "AUTOSCALER_METRIC_PORT": str(p["autoscaler_metrics"]),
                  "DASHBOARD_METRIC_PORT": str(p["dashboard_metrics"])}


class StockRay:
    """Stock Ray by hand in the lab's namespaces, as root; stopped by the pids it started."""

    def __init__(self, lab: labmod.Lab, root: Path) -> None:
        self.lab, self.root = lab, root
        self.leaders: dict[str, subprocess.Popen[bytes]] = {}
        self.seen: set[int] = set()
        self.stopped_in: float | None = None  # SIGTERM to every leader exited (None: some had to be killed)
        self.before = {h.name: set(labmod.netns_pids(f"/run/netns/{h.netns}")) for h in lab.state.hosts}

    def start(self) -> float:
        """Seconds from the first `ray start` to a driver on h1 connected with every node alive."""
        hosts = self.lab.state.hosts
        head = f"{hosts[0].address}:{STOCK_GCS}"
        t0 = time.time()
        for i, h in enumerate(hosts):
            temp = self.root / h.name
            temp.mkdir(parents=True)
            with open(self.root / f"{h.name}.log", "wb") as log:
                self.leaders[h.name] = subprocess.Popen(
                    _nsenter(h, *_stock_argv(h.address, temp, None if i == 0 else head)), env=_stock_env(),
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd="/")
        driver = subprocess.run(_nsenter(hosts[0], sys.executable, "-c", STOCK_DRIVER, head, str(len(hosts))),
                                env=_stock_env(), capture_output=True, text=True, timeout=180, cwd="/")
        at = connected_at(driver.stdout.splitlines())
        self.note()
        if at is None:
            raise RuntimeError(f"bench: stock Ray's driver did not connect: {driver.stdout[-2000:]} "
                               f"{driver.stderr[-2000:]}")
        return at - t0

    def note(self) -> None:
        """Remember every process the leaders have started so far (they are what gets killed)."""
        for p in self.leaders.values():
            try:
                self.seen |= {p.pid} | {c.pid for c in psutil.Process(p.pid).children(recursive=True)}
            except psutil.Error:
                continue

    def groups(self) -> dict[str, list[int]]:
        return {name: [p.pid] for name, p in self.leaders.items()}

    def stop(self) -> None:
        self.note()
        for p in self.leaders.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        deadline = t0 + 30
        for p in self.leaders.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        if all(p.poll() is not None for p in self.leaders.values()):
            self.stopped_in = time.monotonic() - t0
        # anything left: what the leaders started, and root's Ray processes that appeared in
        # the lab's namespaces since (a worker reparented to init is no leader's child any more)
        left = set(self.seen)
        for h in self.lab.state.hosts:
            for pid in set(labmod.netns_pids(f"/run/netns/{h.netns}")) - self.before[h.name]:
                try:
                    proc = psutil.Process(pid)
                    if proc.uids().real == 0 and "ray" in " ".join(proc.cmdline()).lower():
                        left.add(pid)
                except psutil.Error:
                    continue
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.leaders.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.leaders.clear()


def _stock(lab: labmod.Lab, runs: int, idle: bool) -> tuple[list[float], list[float | None],
                                                              dict[str, dict[str, float]] | None]:
    took, stopped, used = [], [], None
    for i in range(runs):
        root = Path(tempfile.mkdtemp(prefix="swarmd-bench-ray-"))
        stock = StockRay(lab, root)
        try:
            took.append(stock.start())
            print(f"  stock Ray {i + 1}/{runs}: driver connected after {took[-1]:.1f} s", flush=True)
            if idle and i == runs - 1:
                time.sleep(SETTLE_S)
                stock.note()
                used = usage(stock.groups(), WINDOW_S)
        finally:
            stock.stop()
            stopped.append(stock.stopped_in)
            shutil.rmtree(root, ignore_errors=True)
    return took, stopped, used


# --- 2. idle -------------------------------------------------------------------------------------

def _idle(lab: labmod.Lab, work: Path) -> dict[str, float]:
    r = _swarmctl(lab, "jobs", "run", "--ray", "--nodes", "3", "--detach", "--workdir", str(work), "--",
                  "python", "hold.py")
    if r.returncode != 0:
        raise RuntimeError(f"bench: the idle job: {r.stderr[-2000:]}")
    job = r.stdout.split()[-1]
    try:
        _until(lambda: connected_at(_all_lines(_swarmctl(lab, "jobs", "logs", job).stdout)) is not None, 180,
               "the idle job's driver connected", interval=1)
        time.sleep(SETTLE_S)
        shown = _call(lab, "jobs.show", id=job)
        head = next(h.name for h in lab.state.hosts if h.peer_id == shown["nodes"][0])
        pids = _job_pids(lab)
        driver = [p for p in pids[head] if _is_driver(p)]
        groups = {name: [p for p in ps if p not in driver] for name, ps in pids.items()} | {"driver": driver}
        used = usage(groups, WINDOW_S)
    finally:
        _swarmctl(lab, "jobs", "cancel", job)
    _until(lambda: _call(lab, "jobs.show", id=job)["state"] == "cancelled", 60, "the idle job cancelled")
    _no_job_left(lab)
    workers = [used[h.name] for h in lab.state.hosts if h.name != head]
    out = {f"ray_idle_head_{k}": used[head][k] for k in ("cpu_pct", "rss_mb", "pss_mb", "processes")}
    out |= {f"ray_idle_worker_{k}": statistics.fmean(w[k] for w in workers)
            for k in ("cpu_pct", "rss_mb", "pss_mb", "processes")}
    out |= {"ray_idle_driver_rss_mb": used["driver"]["rss_mb"], "ray_idle_driver_pss_mb": used["driver"]["pss_mb"],
            "ray_idle_cpu_pct_all_hosts": sum(u["cpu_pct"] for u in used.values())}
    return out


def _is_driver(pid: int) -> bool:
    try:
        return "hold.py" in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False


# --- 3. Tune -------------------------------------------------------------------------------------

def _tune(lab: labmod.Lab, nodes: int) -> dict[str, float]:
    t0 = time.monotonic()
    r = _swarmctl(lab, "jobs", "run", "--ray", "--nodes", str(nodes), "--workdir", str(EXAMPLES), "--",
                  "python", "tune_digits.py", *TUNE_ARGS, timeout=900)
    wall = time.monotonic() - t0
    lines = _ran(r, f"tune_digits.py on {nodes} host(s)")
    trials = trials_in(lines)
    if trials is None:
        raise RuntimeError(f"bench: no `N trials in X s` line: {r.stdout[-3000:]}")
    accuracy = next((float(x.split(": ", 1)[1]) for x in lines if x.startswith("best test accuracy: ")), 0.0)
    hosts = "1_host" if nodes == 1 else f"{nodes}_hosts"
    return {f"ray_tune_{hosts}_wall_s": wall, f"ray_tune_{hosts}_trials_s": trials[1],
            f"ray_tune_{hosts}_best_accuracy": accuracy}


# --- 4. Serve ------------------------------------------------------------------------------------

def _load(path: str) -> dict:
    r = subprocess.run([sys.executable, str(EXAMPLES / "load.py"), f"http://127.0.0.1:{FORWARD_PORT}/{path}",
                        "--concurrency", str(CONCURRENCY), "--duration", f"{LOAD_S:g}", "--json"],
                       capture_output=True, text=True, timeout=LOAD_S + 120)
    if r.returncode != 0:
        raise RuntimeError(f"bench: load.py on /{path}: {r.stdout[-1000:]} {r.stderr[-1000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _serve(lab: labmod.Lab) -> tuple[dict[str, float], dict]:
    r = _swarmctl(lab, "jobs", "run", "--ray", "--nodes", "3", "--detach", "--workdir", str(EXAMPLES), "--",
                  "python", "serve_digits.py")
    if r.returncode != 0:
        raise RuntimeError(f"bench: the Serve job: {r.stderr[-2000:]}")
    job = r.stdout.split()[-1]
    raw: dict = {}
    try:
        t0 = time.monotonic()
        _until(lambda: "serving on port 8000" in _swarmctl(lab, "jobs", "logs", job).stdout, 300,
               "the Serve app deployed", interval=2)
        deployed = time.monotonic() - t0
        shown = _call(lab, "jobs.show", id=job)
        head = next(h.name for h in lab.state.hosts if h.peer_id == shown["nodes"][0])
        text = _swarmctl(lab, "jobs", "logs", job).stdout
        by_node = text.split("replicas by node: ", 1)[1].splitlines()[0] if "replicas by node: " in text else ""
        env = {**os.environ, "SWARMD_SOCKET": lab.state.host("h1").socket}
        forward = subprocess.Popen([sys.executable, "-m", "swarmctl.main", "jobs", "forward", job,
                                    f"{FORWARD_PORT}:8000"], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            first = forward.stdout.readline() if forward.stdout else ""
            if "forwarding" not in first:
                raise RuntimeError(f"bench: jobs forward: {first} {forward.stderr.read() if forward.stderr else ''}")
            import urllib.request

            for path in ("batched", "plain"):  # the first answers of a replica are slow (warm-up)
                for i in range(8):
                    urllib.request.urlopen(f"http://127.0.0.1:{FORWARD_PORT}/{path}?i={i}", timeout=60).read()
            # alternating, so that neither side always runs second (the machine's load drifts)
            order = [("batched", "plain") if i % 2 == 0 else ("plain", "batched") for i in range(LOAD_ROUNDS)]
            raw["rounds"] = [{path: _load(path) for path in paths} for paths in order]
        finally:
            forward.terminate()
            try:
                _, said = forward.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                forward.kill()
                _, said = forward.communicate()
            raw["forward_refused"] = [x for x in said.splitlines() if " refused: " in x]
    finally:
        _swarmctl(lab, "jobs", "cancel", job)
    _until(lambda: _call(lab, "jobs.show", id=job)["state"] == "cancelled", 60, "the Serve job cancelled")
    _no_job_left(lab)
    out = {"ray_serve_run_to_serving_s": deployed}
    for path in ("batched", "plain"):
        got = [r[path] for r in raw["rounds"]]
        out |= {f"ray_serve_{path}_req_per_s": statistics.fmean(g["req_per_s"] for g in got),
                f"ray_serve_{path}_p50_ms": statistics.fmean(g["p50_ms"] for g in got),
                f"ray_serve_{path}_p99_ms": statistics.fmean(g["p99_ms"] for g in got),
                f"ray_serve_{path}_errors": float(sum(g["errors"] for g in got))}
    out["ray_serve_forward_refused"] = float(len(raw["forward_refused"]))
    raw |= {"replicas_by_node": by_node, "head": head, "forward_refused": raw["forward_refused"][-5:]}
    return out, raw


# --- all of it -----------------------------------------------------------------------------------

def measure() -> dict[str, float]:
    results: dict[str, float] = {}
    raw: dict = {"runs": RUNS, "settle_s": SETTLE_S, "window_s": WINDOW_S, "load_s": LOAD_S, "load_rounds": LOAD_ROUNDS,
                 "concurrency": CONCURRENCY}
    name = "benchr"
    hosts, links = topology.plan(3, topology.uniform(10.0))
    lab = labmod.Lab.up(name, hosts, links, mesh=True)
    try:
        lab.wait_formed()
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            (work / "connect.py").write_text(CONNECT)
            (work / "hold.py").write_text(HOLD)
            if "connect" in STEPS:
                runs = []
                for i in range(RUNS):
                    runs.append(_connect_once(lab, work))
                    print(f"  jobs run --ray {i + 1}/{RUNS}: driver connected after {runs[-1]['connected']:.1f} s "
                          f"(cluster up on the head in {runs[-1]['cluster_up']:.1f} s)", flush=True)
                    _no_job_left(lab)
                raw["connect"] = runs
                results |= {"ray_run_to_driver_connected_p50_s": statistics.median(r["connected"] for r in runs),
                            "ray_head_cluster_up_p50_s": statistics.median(r["cluster_up"] for r in runs),
                            "ray_run_to_end_trivial_driver_p50_s": statistics.median(r["end"] for r in runs)}
            if "stock" in STEPS:
                took, stopped, used = _stock(lab, RUNS, idle="idle" in STEPS)
                raw |= {"stock_connect": took, "stock_sigterm_to_exit": stopped}
                results["ray_stock_start_to_driver_connected_p50_s"] = statistics.median(took)
                if all(x is not None for x in stopped):
                    results["ray_stock_sigterm_to_all_exited_p50_s"] = statistics.median(stopped)
                if used:
                    raw["stock_idle"] = used
                    head = used[lab.state.hosts[0].name]
                    workers = [used[h.name] for h in lab.state.hosts[1:]]
                    results |= {"ray_stock_idle_head_cpu_pct": head["cpu_pct"],
                                "ray_stock_idle_head_rss_mb": head["rss_mb"],
                                "ray_stock_idle_head_pss_mb": head["pss_mb"],
                                "ray_stock_idle_worker_cpu_pct": statistics.fmean(w["cpu_pct"] for w in workers),
                                "ray_stock_idle_worker_rss_mb": statistics.fmean(w["rss_mb"] for w in workers),
                                "ray_stock_idle_worker_pss_mb": statistics.fmean(w["pss_mb"] for w in workers)}
            if "idle" in STEPS:
                print(f"  idle: a Ray job that sleeps, {SETTLE_S:g} s to settle, {WINDOW_S:g} s measured", flush=True)
                results |= _idle(lab, work)
        if "tune" in STEPS:
            for nodes in (1, 3):
                got = _tune(lab, nodes)
                print(f"  tune_digits.py on {nodes} host(s): {got}", flush=True)
                results |= got
                _no_job_left(lab)
        if "serve" in STEPS:
            got, raw["serve"] = _serve(lab)
            print(f"  serve_digits.py: {got}", flush=True)
            results |= got
    finally:
        labmod.down(name)
    OUT.mkdir(exist_ok=True)
    (OUT / "ray.json").write_text(json.dumps({"results": results, "raw": raw}, indent=2))
    return results


if __name__ == "__main__":
    print(json.dumps(measure(), indent=2))
