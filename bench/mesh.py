"""WireGuard mesh figures (needs root): the overlay's cost and how fast a mesh forms.

- Two hosts joined by a 1 ms link: ping RTT and a 16 MB gloo all-reduce (2 ranks, bus
  bandwidth) over the raw underlay (the pair's segment) and over the overlay, side by side,
  and their ratio. Both paths cross the same vde2 link, so the ratio is WireGuard's cost.
- Time from the start of `lab up` to a full mesh (every host lists every other as a peer with
  a completed handshake) for N = 3, 5, 8.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from sim.netlab import lab as labmod
from sim.netlab import topology
from sim.netlab.lab import mesh_interface
from swarmd.rpc.client import Client

SIZES = (3, 5, 8)
ALLREDUCE_MB = 16


def _ns(lab: labmod.Lab, host: str, *argv: str, timeout: float = 120) -> str:
    out = subprocess.run(["ip", "netns", "exec", lab.state.host(host).netns, *argv], capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"bench: {' '.join(argv)} on {host} failed: {out.stderr[-2000:]}")
    return out.stdout


def _full_mesh(lab: labmod.Lab) -> bool:
    n = len(lab.state.hosts)
    for h in lab.state.hosts:
        dump = subprocess.run(["ip", "netns", "exec", h.netns, "wg", "show", mesh_interface(lab.state.name, h.name),
                               "dump"], capture_output=True, text=True).stdout.splitlines()[1:]
        if len(dump) != n - 1 or any(line.split("\t")[4] == "0" for line in dump):
            return False
    return True


def _wait(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"bench: {what} not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def _ping_ms(lab: labmod.Lab, src: str, addr: str) -> float:
    out = _ns(lab, src, "ping", "-n", "-q", "-c", "20", "-i", "0.1", addr)
    return float(re.search(r"= [\d.]+/([\d.]+)/", out).group(1))  # the mean


def _allreduce(lab: labmod.Lab, master: str, ifaces: dict[str, str]) -> float:
    procs = [subprocess.Popen(
        ["ip", "netns", "exec", lab.state.host(h).netns, sys.executable, "-m", "sim.netlab.allreduce",
         "--rank", str(rank), "--world", "2", "--master", master, "--iface", ifaces[h], "--mb", str(ALLREDUCE_MB)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank, h in enumerate(("h1", "h2"))]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"bench: all-reduce rank failed: {err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    if any(r["sum"] != 3.0 for r in results):
        raise RuntimeError(f"bench: all-reduce returned a wrong sum: {results}")
    return min(r["busbw_mb_s"] for r in results)


def _mesh_lab(name: str, n: int, rtt) -> tuple[labmod.Lab, float]:
    labmod.down(name)
    hosts, links = topology.plan(n, rtt)
    t0 = time.monotonic()
    # the sandbox off: the all-reduce here runs as root beside the daemons, to measure WireGuard
    # against the underlay; with it on, only a job's own sockets answer over the mesh
    lab = labmod.Lab.up(name, hosts, links, mesh=True, daemon_args=["--sandbox", "off"])
    try:
        _wait(lambda: _full_mesh(lab), 120, f"a full mesh of {n}")
    except BaseException:
        labmod.down(name)
        raise
    return lab, time.monotonic() - t0


def measure() -> dict[str, float]:
    results: dict[str, float] = {}
    lab, _ = _mesh_lab("benchm", 2, topology.uniform(1.0))
    try:
        link = lab.state.link("h1", "h2")
        with Client(lab.state.host("h1").socket, timeout=10) as c:
            over1 = c.call("status")["mesh"]["address"]
        with Client(lab.state.host("h2").socket, timeout=10) as c:
            over2 = c.call("status")["mesh"]["address"]
            results["mesh_backend_is_userspace"] = float(c.call("status")["mesh"]["backend"] == "userspace")
        under_ms, over_ms = _ping_ms(lab, "h1", link.b_addr), _ping_ms(lab, "h1", over2)
        results |= {"ping_underlay_ms": under_ms, "ping_overlay_ms": over_ms, "ping_overlay_over_underlay": over_ms / under_ms}
        under = _allreduce(lab, link.a_addr, {"h1": "to-h2", "h2": "to-h1"})
        over = _allreduce(lab, over1, {h: mesh_interface(lab.state.name, h) for h in ("h1", "h2")})
        results |= {"allreduce_16mb_underlay_mb_s": under, "allreduce_16mb_overlay_mb_s": over,
                    "allreduce_overlay_over_underlay": over / under}
    finally:
        labmod.down("benchm")
    for n in SIZES:
        lab, took = _mesh_lab(f"benchm{n}", n, topology.uniform(20.0))
        labmod.down(lab.state.name)
        results[f"lab_up_to_full_mesh_{n}_hosts_s"] = took
    return results


if __name__ == "__main__":
    for key, value in measure().items():
        print(f"{key:40} {value:10.3f}")
