"""Sandbox overhead (needs root): the same 3-host lab with the mesh, once with the sandbox
(`--sandbox auto`: every part this machine has) and once without (`--sandbox off`),
side by side in one run.

- Time from `jobs.run` to every rank running, and to the job's end, for a trivial job on 3
  hosts with its workdir cached (median of RUNS): the sandbox's cost is what it adds (a uid,
  a cgroup, bubblewrap's namespaces, a firewall chain per job per host, and their teardown).
- The demo's training throughput (samples/s) on 3 hosts, which the sandbox should not change
  beyond noise (its CPU quota is the node's share when a job asks for none).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from sim.netlab import lab as labmod
from sim.netlab import topology
from swarmd.rpc.client import Client

from .jobs import EXAMPLES, _accuracy_and_throughput, _run, _upload

RUNS = 7


def _one(mode: str) -> dict[str, float]:
    name = f"benchs{mode[:2]}"
    hosts, links = topology.plan(3, topology.uniform(10.0))
    lab = labmod.Lab.up(name, hosts, links, mesh=True, daemon_args=["--sandbox", mode])
    try:
        lab.wait_formed()
        trivial = {"cmd": ["python", "-c", "import os; print(os.environ['RANK'])"], "nodes": 3}
        with Client(lab.state.host("h1").socket, timeout=120) as c:
            demo = _upload(c, EXAMPLES)
            _run(c, trivial, demo)  # ships the workdir: the runs below find it cached
            starts, ends = [], []
            for _ in range(RUNS):
                start, end, _ = _run(c, trivial, demo)
                starts.append(start)
                ends.append(end)
            _, _, lines = _run(c, {"cmd": ["python", "ddp_digits.py", "--epochs", "10"], "nodes": 3}, demo)
            _, speed = _accuracy_and_throughput(lines)
            parts = c.call("status")["sandbox"]
    finally:
        labmod.down(name)
    if mode != "off" and not parts.get("active"):
        raise RuntimeError(f"the sandbox is not active in the lab: {parts}")
    return {f"sandbox_{mode}_run_to_running_s": statistics.median(starts),
            f"sandbox_{mode}_run_to_end_s": statistics.median(ends),
            f"sandbox_{mode}_demo_samples_per_s_3_hosts": speed}


def measure() -> dict[str, float]:
    results = _one("off") | _one("auto")
    results["sandbox_added_to_running_ms"] = (results["sandbox_auto_run_to_running_s"]
                                              - results["sandbox_off_run_to_running_s"]) * 1e3
    results["sandbox_added_to_end_ms"] = (results["sandbox_auto_run_to_end_s"]
                                          - results["sandbox_off_run_to_end_s"]) * 1e3
    return results
