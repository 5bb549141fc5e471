"""Membership figures on a 5-host country lab (DE US JP BR IN): time to a full view, capacity
change convergence, kill -9 detection, gossip load and RSS per daemon; then a lossy soak
(5 % loss on every link) counting false dead declarations, and the bytes a daemon received
there by kind beside the simulator's twin of that lab (``soak_recv_*`` and ``soak_twin_recv_*``).
Needs root.

Convergence is timed by polling every receiver's `peers` over its control socket (a round
of polls every few ms), so figures carry that resolution. The target for a change is
"p99 < 100 ms + one-way path delay": ``change_excess`` is the time beyond the longest
one-way delay from the changed host, the part the daemon is responsible for.
"""

from __future__ import annotations

import os
import signal
import statistics
import time

import psutil

from sim.netlab import lab as labmod
from sim.netlab import topology
from sim.swarm import twin_received_by_kind
from swarmd.rpc.client import Client

COUNTRIES = ["DE", "US", "JP", "BR", "IN"]
CHANGES = 30
KILLS = 8
LOAD_WINDOW = 30.0
SOAK_SECONDS = float(os.environ.get("SWARMD_BENCH_SOAK_SECONDS", "300"))
BYTES_AFTER_S = 20.0  # the soak's bytes by kind are counted from then on (tests/netlab/test_gossip.py's)


def _call(lab: labmod.Lab, host: str, method: str, **params):
    with Client(lab.state.host(host).socket, timeout=10) as c:
        return c.call(method, **params)


def _states(lab: labmod.Lab, host: str) -> dict[str, str]:
    return {p["peer"]: p["state"] for p in _call(lab, host, "peers")["peers"]}


def _wait(predicate, timeout: float) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"bench: condition not met within {timeout} s")
        time.sleep(0.002)
    return time.monotonic() - t0


def _all_alive(lab: labmod.Lab) -> bool:
    ids = {h.peer_id for h in lab.state.hosts}
    return all(_states(lab, h.name) == {p: "alive" for p in ids if p != h.peer_id} for h in lab.state.hosts)


def _pct(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1] if len(samples) > 1 else samples[0]


def _by_kind(lab: labmod.Lab, names: list[str]) -> dict[str, int]:
    """Bytes received by kind, summed over the daemons (``status``'s ``gossip.received_by_kind``)."""
    total: dict[str, int] = {}
    for h in names:
        for kind, size in _call(lab, h, "status")["gossip"]["received_by_kind"].items():
            total[kind] = total.get(kind, 0) + size
    return total


def _lab(name: str, rtt, loss: float = 0.0, countries=None) -> tuple[labmod.Lab, float]:
    labmod.down(name)
    hosts, links = topology.plan(5, rtt, loss_pct=loss, countries=countries)
    t0 = time.monotonic()
    lab = labmod.Lab.up(name, hosts, links, mesh=False)  # membership alone; the mesh has its own figures
    _wait(lambda: _all_alive(lab), 60)
    return lab, time.monotonic() - t0


def measure() -> dict[str, float]:
    results: dict[str, float] = {}
    lab, took = _lab("benchg", topology.from_countries(topology.country_table()), countries=COUNTRIES)
    try:
        results["gossip_up_to_full_view_5_hosts_s"] = took
        names = [h.name for h in lab.state.hosts]

        took_all, excess = [], []
        for i in range(CHANGES):
            src = names[i % len(names)]
            others = [h for h in names if h != src]
            one_way = max(lab.state.link(src, o).rtt_ms for o in others) / 2e3
            value = f"v{i}"
            peer = lab.state.host(src).peer_id
            t0 = time.monotonic()
            _call(lab, src, "labels.set", labels={"bench": value})

            pending = set(others)
            t = 0.0
            while pending:  # each receiver polled every few ms: light enough not to delay the daemons
                for o in list(pending):
                    rows = {p["peer"]: p for p in _call(lab, o, "peers")["peers"]}
                    if rows[peer]["labels"].get("bench") == value:
                        pending.discard(o)
                        t = time.monotonic() - t0
                if time.monotonic() - t0 > 10:
                    raise RuntimeError(f"bench: change from {src} not seen by {sorted(pending)} in 10 s")
                time.sleep(0.003)
            took_all.append(t * 1e3)
            excess.append((t - one_way) * 1e3)
            time.sleep(0.3)  # publishes are rate-limited to 4/s per node: measure single changes
        results |= {"change_seen_by_all_p50_ms": _pct(took_all, 50), "change_seen_by_all_p99_ms": _pct(took_all, 99),
                    "change_excess_p50_ms": _pct(excess, 50), "change_excess_p99_ms": _pct(excess, 99)}

        detect = []
        for i in range(KILLS):
            victim = names[1 + i % (len(names) - 1)]
            peer = lab.state.host(victim).peer_id
            others = [h for h in names if h != victim]
            _wait(lambda: _all_alive(lab), 30)
            t0 = time.monotonic()
            lab.kill(victim, signal.SIGKILL)
            _wait(lambda: all(_states(lab, o).get(peer) == "dead" for o in others), 30)
            detect.append(time.monotonic() - t0)
            lab.start(victim)
        _wait(lambda: _all_alive(lab), 30)
        results |= {"kill_detected_by_all_p50_s": _pct(detect, 50), "kill_detected_by_all_p99_s": _pct(detect, 99)}

        procs = [psutil.Process(lab.state.host(h).pid) for h in names]
        time.sleep(10)  # settle after the last restart
        before = {h: _call(lab, h, "status")["gossip"] for h in names}
        cpu0, w0 = [sum(p.cpu_times()[:2]) for p in procs], time.monotonic()
        time.sleep(LOAD_WINDOW)
        cpu1, w1 = [sum(p.cpu_times()[:2]) for p in procs], time.monotonic()
        after = {h: _call(lab, h, "status")["gossip"] for h in names}
        results["daemon_cpu_pct_with_membership_mean"] = statistics.mean(
            100 * (b - a) / (w1 - w0) for a, b in zip(cpu0, cpu1))
        msgs = [(after[h]["messages_in"] + after[h]["messages_out"] - before[h]["messages_in"]
                 - before[h]["messages_out"]) / LOAD_WINDOW for h in names]
        size = [(after[h]["bytes_in"] + after[h]["bytes_out"] - before[h]["bytes_in"]
                 - before[h]["bytes_out"]) / LOAD_WINDOW for h in names]
        rss = [psutil.Process(lab.state.host(h).pid).memory_info().rss / 2**20 for h in names]
        results |= {"gossip_msgs_per_s_per_daemon": statistics.mean(msgs),
                    "gossip_bytes_per_s_per_daemon": statistics.mean(size),
                    "daemon_rss_with_membership_max_mb": max(rss)}
    finally:
        labmod.down("benchg")

    if SOAK_SECONDS > 0:
        lab, _ = _lab("benchs", topology.uniform(30.0), loss=5.0)
        try:
            names = [h.name for h in lab.state.hosts]
            time.sleep(BYTES_AFTER_S)  # a new daemon republishes as its RTTs and coordinate settle: the twin does not
            before, t0 = _by_kind(lab, names), time.monotonic()
            time.sleep(max(0.0, SOAK_SECONDS - BYTES_AFTER_S))
            after, took = _by_kind(lab, names), time.monotonic() - t0
            twin = twin_received_by_kind(len(names), 30.0, 0.05, warm_s=BYTES_AFTER_S, seconds=took)
            for kind, want in twin.items():  # what a daemon received by kind, beside its simulated twin's
                results[f"soak_recv_{kind}_per_daemon_s"] = (after.get(kind, 0) - before.get(kind, 0)) / len(names) / took
                results[f"soak_twin_recv_{kind}_per_node_s"] = want
            dead = suspect = 0
            for h in lab.state.hosts:
                with open(h.log) as log:
                    for line in log:
                        dead += '"event": "member dead"' in line
                        suspect += '"event": "member suspect"' in line
            results |= {"soak_seconds": SOAK_SECONDS, "soak_false_dead": dead, "soak_suspicions_refuted": suspect}
        finally:
            labmod.down("benchs")
    return results
