"""Job figures (needs root): a 3-host lab with the mesh, jobs submitted as swarmctl does.

- A trivial job on 3 hosts: time from `jobs.run` to every rank started (the job `running`)
  and to the job's end, with a workdir new to every host (cold: packed, uploaded, shipped)
  and with the same workdir again (cached: nothing shipped). Median of RUNS each.
- The demo's test accuracy and training throughput (samples/s) on 1 host and on 3 hosts over
  the mesh: the accuracy should not depend on the number of hosts.
- A coordinator that never reads (the lab's intruder, a certified member on h3, starts a job
  on h1 whose rank prints as fast as it can and never reads the stream, for NO_READ_S): h1's
  daemon RSS before and at its peak, and the lines left off the stream (kept in the log).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from sim.netlab import lab as labmod
from sim.netlab import topology
from swarmd.compute.workdir import pack
from swarmd.rpc.client import Client

RUNS = 5
NO_READ_S = 20
EXAMPLES = Path(__file__).parents[1] / "examples"


def _upload(c: Client, root: Path) -> str:
    packed = pack(root)
    c.call("jobs.upload", digest=packed.digest, offset=0, size=len(packed.data), data=packed.data)
    return packed.digest


def _run(c: Client, spec: dict, workdir: str | None) -> tuple[float, float, list[str]]:
    """Seconds to running and to the end, and rank 0's output."""
    t0 = time.monotonic()
    to_running = None
    lines: list[str] = []
    for event in c.stream("jobs.run", spec=spec, workdir=workdir):
        if "job" in event and event["job"]["state"] == "running" and to_running is None:
            to_running = time.monotonic() - t0
        if "out" in event:
            lines += [text for rank, text in event["out"] if rank == 0]
        if "end" in event:
            if event["end"]["state"] != "succeeded":
                raise RuntimeError(f"bench job failed: {event['end']['reason']}")
            end = time.monotonic() - t0
            return to_running if to_running is not None else end, end, lines
    raise RuntimeError("the job stream ended without an end")


def _accuracy_and_throughput(lines: list[str]) -> tuple[float, float]:
    for line in lines:  # "test accuracy 0.9600 (432/450); 67607 samples/s over 1 rank(s)"
        if line.startswith("test accuracy"):
            return float(line.split()[2]), float(line.split("; ")[1].split()[0])
    raise RuntimeError(f"no accuracy line in {lines}")


def measure() -> dict[str, float]:
    results: dict[str, float] = {}
    name = "benchj"
    hosts, links = topology.plan(3, topology.uniform(10.0))
    lab = labmod.Lab.up(name, hosts, links, mesh=True)
    try:
        lab.wait_formed()
        trivial = {"cmd": ["python", "-c", "import os; print(os.environ['RANK'])"], "nodes": 3}
        with Client(lab.state.host("h1").socket, timeout=120) as c, tempfile.TemporaryDirectory() as tmp:
            cold_start, cold_end, warm_start, warm_end = [], [], [], []
            for _ in range(RUNS):
                work = Path(tmp) / uuid.uuid4().hex
                work.mkdir()
                (work / "payload.bin").write_bytes(uuid.uuid4().bytes * 65536)  # 1 MiB, new to every host
                t0 = time.monotonic()
                digest = _upload(c, work)
                upload = time.monotonic() - t0
                start, end, _ = _run(c, trivial, digest)
                cold_start.append(upload + start)
                cold_end.append(upload + end)
                start, end, _ = _run(c, trivial, digest)
                warm_start.append(start)
                warm_end.append(end)
            results |= {"job_run_to_running_cold_s": statistics.median(cold_start),
                        "job_run_to_end_cold_s": statistics.median(cold_end),
                        "job_run_to_running_cached_s": statistics.median(warm_start),
                        "job_run_to_end_cached_s": statistics.median(warm_end)}
            demo = _upload(c, EXAMPLES)
            for nodes in (1, 3):
                spec = {"cmd": ["python", "ddp_digits.py", "--epochs", "10"], "nodes": nodes}
                _, _, lines = _run(c, spec, demo)
                accuracy, speed = _accuracy_and_throughput(lines)
                results |= {f"demo_accuracy_{nodes}_hosts": accuracy, f"demo_samples_per_s_{nodes}_hosts": speed}
        results |= _never_reads(lab)
    finally:
        labmod.down(name)
    return results


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _never_reads(lab: labmod.Lab) -> dict[str, float]:
    victim, attacker = lab.state.host("h1"), lab.state.host("h3")
    with Client(victim.socket, timeout=30) as c:
        dropped = c.call("status")["jobs"]["output_dropped"]
    before = peak = _rss_mb(victim.pid)
    proc = subprocess.Popen(
        ["ip", "netns", "exec", attacker.netns, sys.executable, "-m", "sim.netlab.intruder", "job-no-read",
         "--target", f"/ip4/{victim.address}/tcp/{labmod.SWARMD_PORT}/p2p/{victim.peer_id}",
         "--owner-dir", victim.state_dir, "--seconds", str(NO_READ_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + NO_READ_S + 90
    while proc.poll() is None and time.monotonic() < deadline:
        peak = max(peak, _rss_mb(victim.pid))
        time.sleep(0.2)
    _, err = proc.communicate(timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"the intruder failed: {err[-2000:]}")
    time.sleep(2)  # the host notices the stream gone and counts what it left off
    with Client(victim.socket, timeout=30) as c:
        lost = c.call("status")["jobs"]["output_dropped"] - dropped
    return {"no_read_coordinator_rss_before_mb": before, "no_read_coordinator_rss_peak_mb": peak,
            "no_read_coordinator_lines_dropped": float(lost)}
