"""Ray jobs on a 3-host lab (issue 14): one Ray cluster per job over the real mesh, each node
in its job's sandbox, driven by the real `swarmctl jobs run --ray` as a user would."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from .support import (call, handed_over_and_back, in_netns, job_logs, rank_lines, swarmctl, three_hosts, until,
                      workdir)

pytestmark = [pytest.mark.netlab, pytest.mark.slow]
EXAMPLES = Path(__file__).parents[2] / "examples"

SPREAD = """
import json, os, socket, sys
import ray
ray.init()
nodes = [n for n in ray.nodes() if n["Alive"]]
@ray.remote(num_cpus=1)
def where():
    import time
    time.sleep(0.5)
    return ray.util.get_node_ip_address(), os.getuid()
seen = ray.get([where.options(scheduling_strategy="SPREAD").remote() for _ in range(9)])
print("RESULT " + json.dumps({"nodes": sorted(n["NodeManagerAddress"] for n in nodes),
      "cpus": sorted(n["Resources"].get("CPU", 0) for n in nodes), "ips": sorted({ip for ip, _ in seen}),
      "uids": sorted({uid for _, uid in seen}), "driver_uid": os.getuid(), "address": os.environ["RAY_ADDRESS"]}),
      flush=True)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


HOLD = """
import json, os, time
import ray
ray.init()
print("RESULT " + json.dumps({"address": os.environ["RAY_ADDRESS"], "uid": os.getuid()}), flush=True)
time.sleep(600)
"""

GCS_CLIENT = """
import sys
from ray._raylet import GcsClient
try:
    print("ANSWERED", len(GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5)))
except Exception as exc:
    print("REFUSED", type(exc).__name__, str(exc)[:200])
"""

INTRUDER = """
import json, os, socket, sys
host, port = sys.argv[1].rsplit(":", 1)
try:
    socket.create_connection((host, int(port)), timeout=3).close()
    tcp = "connected"
except OSError as exc:
    tcp = type(exc).__name__
try:
    from ray._raylet import GcsClient
    GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5)
    ray = "answered"
except Exception as exc:
    ray = type(exc).__name__
me = os.environ["SWARM_NODE_IPS"].split(",")[int(os.environ["NODE_RANK"])]
print("INTRUDER " + json.dumps({"me": me, "tcp": tcp, "ray": ray}), flush=True)
"""

CONNECT = """
import socket, sys
host, port = sys.argv[1].rsplit(":", 1)
try:
    socket.create_connection((host, int(port)), timeout=3).close()
    print("CONNECTED")
except OSError as exc:
    print("REFUSED", type(exc).__name__)
"""


@pytest.fixture(scope="module")
def rl():
    with three_hosts("r", mesh=True) as lab:
        yield lab


def result(stdout: str) -> dict:
    line = next(t for texts in rank_lines(stdout).values() for t in texts if t.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_a_ray_job_gets_a_cluster_of_its_hosts_and_its_drivers_exit_code(rl, tmp_path):
    r = swarmctl(rl, "h1", "jobs", "run", "--ray", "--nodes", "3", "--env", "EXIT=3",
                 "--workdir", str(workdir(tmp_path, SPREAD)), "--", "python", "job.py")
    assert r.returncode == 3, r.stdout[-4000:] + r.stderr[-3000:]
    got = result(r.stdout)
    overlay = sorted(call(rl, h.name, "status")["mesh"]["address"] for h in rl.state.hosts)
    assert got["nodes"] == overlay, "one Ray node per host, on its overlay address"
    assert got["cpus"] == [1.0, 1.0, 1.0], "Ray counts the share of cores the job has on each host"
    assert got["ips"] == overlay, "tasks ran on every node"
    assert 0 not in got["uids"] and got["driver_uid"] != 0, "Ray runs as the job's uid, never root"
    assert got["address"].split(":")[0] in overlay


def job_uid_processes() -> list[str]:
    """Processes of any job uid (the lab's hosts draw theirs from 61184-65519)."""
    ps = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if 61184 <= int(line.split()[0]) <= 65519]


def test_a_ray_cluster_is_its_jobs_alone_and_cancel_leaves_nothing(rl, tmp_path):
    shm_before = set(Path("/dev/shm").iterdir())
    r = swarmctl(rl, "h1", "jobs", "run", "--ray", "--nodes", "2", "--detach",
                 "--workdir", str(workdir(tmp_path, HOLD)), "--", "python", "job.py")
    assert r.returncode == 0, r.stderr[-3000:]
    job = r.stdout.split()[-1]
    until(lambda: "RESULT " in job_logs(rl, "h1", job), 90, "the driver connected", interval=1)
    got = result(swarmctl(rl, "h1", "jobs", "logs", job).stdout)
    shown = call(rl, "h1", "jobs.show", id=job)
    addresses = {h.name: call(rl, h.name, "status")["mesh"]["address"] for h in rl.state.hosts}
    members = {h.name: call(rl, h.name, "status")["peer_id"] for h in rl.state.hosts}
    inside = [name for name, peer in members.items() if peer in shown["nodes"]]
    outside = next(name for name in members if name not in inside)
    head = next(name for name, peer in members.items() if peer == shown["nodes"][0])
    assert got["address"] == f"{addresses[head]}:{got['address'].rsplit(':', 1)[1]}"

    # `jobs show` lists the Ray nodes: host, overlay address, what Ray was given
    text = swarmctl(rl, "h1", "jobs", "show", job).stdout
    assert "Ray nodes" in text and f"{addresses[head]} (head): 1 CPU" in text, text
    assert all(shown["hosts"][members[n]]["ray"]["address"] == addresses[n] for n in inside)

    # a driver without the job's token is refused, on the head's own host (root, past the firewall)
    wrong = in_netns(rl, head, "env", "RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN=" + "0" * 64,
                     str(Path(__import__("sys").executable)), "-c", GCS_CLIENT, got["address"])
    none = in_netns(rl, head, "env", "-u", "RAY_AUTH_MODE", str(Path(__import__("sys").executable)), "-c",
                    GCS_CLIENT, got["address"])
    assert "REFUSED" in wrong.stdout and "ANSWERED" not in wrong.stdout, wrong.stdout + wrong.stderr
    assert "REFUSED" in none.stdout and "ANSWERED" not in none.stdout, none.stdout + none.stderr

    # a host outside the job reaches none of its ports, over the overlay or the underlay
    for target in (got["address"], f"{rl.state.host(head).address}:{got['address'].rsplit(':', 1)[1]}"):
        out = in_netns(rl, outside, str(Path(__import__("sys").executable)), "-c", CONNECT, target)
        assert "REFUSED" in out.stdout, (target, out.stdout, out.stderr)

    # another job's process on every host: Ray refuses it (no token) everywhere; the firewall
    # refuses its TCP on the head's host and on a host outside the job. From a host the two jobs
    # share, TCP gets through to the overlay: the sandbox's known gap (overlay addresses name
    # hosts, not jobs; README), which the token closes for Ray.
    other = swarmctl(rl, "h1", "jobs", "run", "--nodes", "3", "--workdir", str(workdir(tmp_path, INTRUDER)),
                     "--", "python", "job.py", got["address"])
    assert other.returncode == 0, other.stderr[-2000:]
    tries = {t["me"]: t for t in (json.loads(x.removeprefix("INTRUDER ")) for texts in
                                  rank_lines(other.stdout).values() for x in texts if x.startswith("INTRUDER "))}
    assert set(tries) == set(addresses.values()), other.stdout
    assert all(t["ray"] != "answered" for t in tries.values()), tries
    assert tries[addresses[head]]["tcp"] == "ConnectionRefusedError", tries
    assert tries[addresses[outside]]["tcp"] in ("TimeoutError", "ConnectionRefusedError"), tries

    # cancel: no process of the job left anywhere, nothing in /dev/shm
    assert swarmctl(rl, "h1", "jobs", "cancel", job).returncode == 0
    until(lambda: call(rl, "h1", "jobs.show", id=job)["state"] == "cancelled", 30, "the Ray job cancelled")
    until(lambda: not job_uid_processes(), 15, "no process of a job uid left", detail=job_uid_processes)
    assert set(Path("/dev/shm").iterdir()) <= shm_before


def test_the_tune_example_spreads_its_trials_over_every_node(rl):
    # 6 trials, not 12: each node has one CPU and a trial takes one, so the first 3 run one per
    # node whatever Tune's placement; 6 leave TPE 2 guided trials after its 4 random ones
    # (best 0.947 here). 61-62 s, was 109 s: most of a trial is its actor's start-up
    r = swarmctl(rl, "h1", "jobs", "run", "--ray", "--nodes", "3", "--workdir", str(EXAMPLES), "--",
                 "python", "tune_digits.py", "--trials", "6", "--max-epochs", "6", timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    text = "\n".join(t for texts in rank_lines(r.stdout).values() for t in texts)
    by_node = dict(kv.split("=") for kv in text.split("trials by node: ", 1)[1].splitlines()[0].split(", "))
    overlay = {call(rl, h.name, "status")["mesh"]["address"] for h in rl.state.hosts}
    # a str, not a tuple: pytest prints a message whole only then (CI's failure showed 200 characters)
    assert set(by_node) == overlay and sum(map(int, by_node.values())) == 6, f"{by_node}\n{text[-4000:]}"
    accuracy = float(text.split("best test accuracy: ", 1)[1].split()[0])
    assert accuracy > 0.85, text[-2000:]


# An epoch costs the same 25-35 s whatever the batch: it is Ray Data running the pipeline over
# the nodes again (train 13-20 s, test 8-14 s), not the steps. So 2 epochs (the stream runs
# twice) of global batch 32, not 5 of 128: 4 times the steps per epoch, 0.907 after the first
# and 0.951 after the second here, where 5 x 128 reached 0.953 (and 3 x 128 only 0.876).
# 117-143 s, was 245-300 s (the suite's 300 s limit once cut it)
def test_the_data_example_streams_into_a_torch_trainer_on_every_node(rl):
    r = swarmctl(rl, "h1", "jobs", "run", "--ray", "--nodes", "3", "--workdir", str(EXAMPLES), "--",
                 "python", "data_train.py", "--epochs", "2", "--global-batch", "32", timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    text = "\n".join(t for texts in rank_lines(r.stdout).values() for t in texts)
    by_node = dict(kv.split("=") for kv in text.split("train workers by node: ", 1)[1].splitlines()[0].split(", "))
    overlay = {call(rl, h.name, "status")["mesh"]["address"] for h in rl.state.hosts}
    assert set(by_node) == overlay, by_node
    assert "2 epochs on 3 worker(s)" in text, text[-2000:]  # the stream ran again for the second
    assert float(text.split("test accuracy: ", 1)[1].split()[0]) > 0.85, text[-2000:]


def test_the_serve_example_answers_through_jobs_forward_with_replicas_on_several_nodes(rl, tmp_path):
    # a 1 M-weight model, not the example's 34 M: each remote replica pulls it from the head's
    # object store, and 134 MB twice through three wireguard-go tunnels starved this 2-core lab
    # past the deadline (the replicas took 110 s to start, at 07a8a61 as now); Serve's path
    # through the forward is what is tested here, not its throughput
    r = swarmctl(rl, "h1", "jobs", "run", "--ray", "--nodes", "3", "--detach", "--workdir", str(EXAMPLES), "--",
                 "python", "serve_digits.py", "--hidden", "1024", "--layers", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    job = r.stdout.split()[-1]
    try:
        until(lambda: "serving on port 8000" in job_logs(rl, "h1", job), 240,
              "the Serve app deployed", interval=2,
              detail=lambda: job_logs(rl, "h1", job)[-3000:])
        text = swarmctl(rl, "h1", "jobs", "logs", job).stdout
        by_node = dict(kv.split("=") for kv in text.split("replicas by node: ", 1)[1].splitlines()[0].split(", "))
        assert len(by_node) >= 2, by_node
        env = {**__import__("os").environ, "SWARMD_SOCKET": rl.state.host("h1").socket}
        forward = subprocess.Popen([__import__("sys").executable, "-m", "swarmctl.main", "jobs", "forward", job,
                                    "18000:8000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert "forwarding 127.0.0.1:18000" in forward.stdout.readline()
            import urllib.request
            for path in ("batched", "plain"):
                answer = json.loads(urllib.request.urlopen(f"http://127.0.0.1:18000/{path}?i=7", timeout=30).read())
                assert answer["digit"] == answer["label"], answer
            load = subprocess.run([__import__("sys").executable, str(EXAMPLES / "load.py"),
                                   "http://127.0.0.1:18000/batched", "--concurrency", "4", "--requests", "40"],
                                  capture_output=True, text=True, timeout=120)
            assert load.returncode == 0 and "40 requests" in load.stdout and "errors 0" in load.stdout, load.stdout
        finally:
            forward.terminate()
            forward.wait(10)
    finally:
        swarmctl(rl, "h1", "jobs", "cancel", job)
    until(lambda: call(rl, "h1", "jobs.show", id=job)["state"] == "cancelled", 30, "the Serve job cancelled")
    until(lambda: not job_uid_processes(), 15, "no process of a job uid left", detail=job_uid_processes)


TICKS = """
import os, time
import ray
ray.init()
@ray.remote(num_cpus=1)
def square(i):
    return i * i
for i in range(600):
    print("tick", i, ray.get(square.remote(i)), flush=True)
    time.sleep(0.5)
"""


def test_a_ray_jobs_coordinator_crashes_and_a_replica_carries_the_cluster_on(rl, tmp_path):
    """Last in the module (it crashes h1). A detached Ray job submitted from h1 on h2 and h3;
    h1 crashes: a replica takes the job over, the Ray cluster and its driver go on untouched;
    h1 comes back, follows the job (every tick once) and cancels it, leaving nothing."""
    hosts = [arg for h in ("h2", "h3") for arg in ("--host", rl.state.host(h).peer_id)]
    r = swarmctl(rl, "h1", "jobs", "run", "--ray", "--nodes", "2", "--detach", *hosts,
                 "--workdir", str(workdir(tmp_path, TICKS)), "--", "python", "job.py")
    assert r.returncode == 0, r.stderr[-3000:]
    job = r.stdout.split()[-1]
    until(lambda: "tick 3 " in job_logs(rl, "h1", job), 120, "the driver running tasks", interval=1,
          detail=lambda: job_logs(rl, "h1", job)[-2000:])
    handed_over_and_back(rl, job)

    def ticks() -> list[int]:
        return [int(t.split()[1]) for texts in rank_lines(job_logs(rl, "h1", job)).values() for t in texts
                if t.startswith("tick ")]

    seen = max(ticks())
    until(lambda: max(ticks()) >= seen + 6, 60, "the driver ticking on after the hand-over", interval=1)
    got = ticks()
    assert got == list(range(len(got))), f"every tick once and in order, none lost: {got}"
    shown = call(rl, "h1", "jobs.show", id=job)
    assert shown["state"] == "running" and len(shown["attempts"]) == 1, "the Ray cluster was never restarted"
    assert swarmctl(rl, "h1", "jobs", "cancel", job).returncode == 0
    until(lambda: call(rl, "h1", "jobs.show", id=job)["state"] == "cancelled", 60, "the Ray job cancelled from h1",
          interval=0.5, detail=lambda: call(rl, "h1", "jobs.show", id=job))
    until(lambda: not job_uid_processes(), 30, "no process of a job uid left", detail=job_uid_processes)
