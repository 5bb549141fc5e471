"""Netlab figures: `lab up` time for 5 and 10 hosts, RTT accuracy on a country-drawn
5-host lab, and the idle CPU of a 10-host lab (every helper and daemon). Needs root."""

from __future__ import annotations

import re
import subprocess
import time

import psutil

from sim.netlab import lab as labmod
from sim.netlab import topology

COUNTRIES = ["DE", "US", "JP", "BR", "IN", "FR", "GB", "AU", "ZA", "SG"]


def _up(name: str, n: int) -> tuple[labmod.Lab, float]:
    table = topology.country_table()
    hosts, links = topology.plan(n, topology.from_countries(table), countries=COUNTRIES[:n])
    t0 = time.monotonic()
    lab = labmod.Lab.up(name, hosts, links, mesh=False)  # the mesh has its own figures (bench/mesh.py)
    return lab, time.monotonic() - t0


def _min_rtt(lab: labmod.Lab, src: str, addr: str) -> float:
    out = subprocess.run(["ip", "netns", "exec", lab.state.host(src).netns, "ping", "-n", "-q", "-c", "5",
                          "-i", "0.2", addr], capture_output=True, text=True).stdout
    return float(re.search(r"= ([\d.]+)/", out).group(1))


def measure() -> dict[str, float]:
    results: dict[str, float] = {}
    labmod.down("bench5")
    lab, took = _up("bench5", 5)
    try:
        results["lab_up_5_hosts_s"] = took
        errors = [abs(_min_rtt(lab, l.a, lab.state.host(l.b).address) - l.rtt_ms) / l.rtt_ms * 100
                  for l in lab.state.links]
        results["rtt_error_max_pct"] = max(errors)
        results["rtt_error_mean_pct"] = sum(errors) / len(errors)
    finally:
        labmod.down("bench5")
    labmod.down("bench10")
    lab, took = _up("bench10", 10)
    try:
        results["lab_up_10_hosts_s"] = took
        time.sleep(20)  # let the daemons settle after start: joins, syncs, mesh grafts
        marker = lab.state.dir + "/"
        procs = [psutil.Process(p) for p in labmod._pids_mentioning(marker)]
        cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
        time.sleep(10)
        cpu1 = sum(sum(p.cpu_times()[:2]) for p in procs)
        results["lab_10_idle_cpu_pct_of_a_core"] = (cpu1 - cpu0) * 10
        results["lab_10_processes"] = len(procs)
    finally:
        labmod.down("bench10")
    return results
