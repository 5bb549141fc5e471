"""Elastic restarts (needs root): a host of a training job powers off silently, and the time
until training runs again.

For each link RTT in RTTS and each mode, CRASHES crashes, each of a fresh job (the demo,
`ddp_digits.py`, logging every epoch, checkpointing every epoch):
- replace: a 4-host lab, `--nodes 3 --max-restarts 1`: the spare host takes the lost one's place;
- shrink: a 3-host lab, `--nodes 2:3 --max-restarts 1`: the job goes on with the two survivors.
A crash waits until a checkpoint of the job is held by two hosts, then `lab crash` takes a
job host that is not the coordinator (h1) off the network and kills its processes. Timestamps
(one clock: the lab's namespaces share it): t0 the crash → t1 the coordinator noticed →
t2 the new gang committed → t3 the newest checkpoint on every host of the new attempt →
t4 every rank running → t5 the first training step of the new attempt done (the example
prints it with its time). Also: epochs lost (the newest checkpoint any host had at t0 minus
the one the job resumed from; the epoch under way is always lost too), and throughput in
samples/s over the epochs before the crash and after the resume.

Beside it, stock torchrun in the same kind of lab (bench/elastic_torchrun.py): how long its
survivors hang after a silent death, capped.
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from sim.netlab import lab as labmod
from sim.netlab import topology
from swarmd.rpc.client import Client

from .jobs import EXAMPLES, _upload

RTTS = (10.0, 100.0)
CRASHES = int(os.environ.get("SWARMD_BENCH_ELASTIC_CRASHES", "10"))
SAMPLES_PER_EPOCH = 1347  # the digits training split
MODES = {"replace": (4, "3"), "shrink": (3, "2:3")}
FIRST_STEP = re.compile(r"first step at ([0-9.]+)")
EPOCH = re.compile(r"epoch +([0-9]+) ")


class _Follower(threading.Thread):
    """A job's output as it arrives, each line with its arrival time."""

    def __init__(self, socket: str, job: str) -> None:
        super().__init__(daemon=True)
        self.socket, self.job = socket, job
        self.lines: list[tuple[float, int, str]] = []

    def run(self) -> None:
        with Client(self.socket, timeout=600) as c:
            for event in c.stream("jobs.logs", id=self.job, follow=True):
                now = time.time()
                self.lines += [(now, rank, text) for rank, text in event.get("out", [])]


def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench: not within {timeout:g} s: {what}")
        time.sleep(0.05)


def _epoch_rate(stamps: list[tuple[float, int]]) -> float | None:
    """samples/s from (arrival time, epoch) of consecutive epoch lines."""
    if len(stamps) < 2:
        return None
    (t_a, e_a), (t_b, e_b) = stamps[0], stamps[-1]
    return (e_b - e_a) * SAMPLES_PER_EPOCH / (t_b - t_a) if t_b > t_a and e_b > e_a else None


def _crash_once(lab: labmod.Lab, c: Client, digest: str, nodes: str) -> dict[str, Any]:
    spec = {"cmd": ["python", "ddp_digits.py", "--epochs", "1000", "--log-every", "1"], "nodes": nodes,
            "max_restarts": 1, "env": {"TORCH_CPP_LOG_LEVEL": "ERROR"}}
    job = list(c.stream("jobs.run", spec=spec, workdir=digest, detach=True))[0]["submitted"]
    follower = _Follower(lab.state.host("h1").socket, job)
    follower.start()
    try:
        _until(lambda: any(len(k["holders"]) >= 2 for k in c.call("jobs.show", id=job)["checkpoints"])
               and sum(1 for _, _, x in follower.lines if EPOCH.match(x)) >= 3, 180,
               "a checkpoint on two hosts and three epochs (the throughput before)")
        before = c.call("jobs.show", id=job)
        newest = max(int(k["name"][6:10]) for k in before["checkpoints"])
        victim = next(h for h in lab.state.hosts if h.peer_id in before["nodes"] and h.name != "h1")
        t0 = time.time()
        lab.crash(victim.name)
        _until(lambda: any(t > t0 and FIRST_STEP.match(x) for t, _, x in follower.lines)
               or c.call("jobs.show", id=job)["state"] in ("failed", "succeeded", "cancelled"), 180,
               "the first step after the restart")
        j = c.call("jobs.show", id=job)
        if len(j["attempts"]) != 2 or j["state"] != "running":
            raise RuntimeError(f"bench: the job did not restart: {j['state']}: {j['reason']}")
        first_step = next(float(FIRST_STEP.match(x).group(1)) for t, _, x in follower.lines
                          if t > t0 and FIRST_STEP.match(x))
        after_resume = len(follower.lines)
        _until(lambda: sum(1 for _, _, x in follower.lines[after_resume:] if EPOCH.match(x)) >= 3, 180,
               "three epochs after the resume")
        one, two = j["attempts"]
        resumed = int(two["resumed_from"][6:10]) if two["resumed_from"] else -1
        epochs = [(t, int(EPOCH.match(x).group(1))) for t, _, x in follower.lines if EPOCH.match(x)]
        return {"t1": one["detected"] - t0, "t2": two["reserved"] - t0, "t3": two["checkpoints_ready"] - t0,
                "t4": two["started"] - t0, "t5": first_step - t0, "epochs_lost": newest - resumed,
                "before": _epoch_rate([e for e in epochs if e[0] < t0][-4:]),
                "after": _epoch_rate([e for e in epochs if e[0] > first_step][:3]),
                "nodes_after": len(two["nodes"])}
    finally:
        c.call("jobs.cancel", id=job)
        _until(lambda: c.call("jobs.show", id=job)["state"] in ("failed", "succeeded", "cancelled"), 60, "cancel")
        for h in lab.state.hosts:
            if h.crashed:
                lab.revive(h.name)
        lab.wait_formed(timeout=120)


def _mode(mode: str, rtt: float) -> dict[str, float]:
    hosts_n, nodes = MODES[mode]
    name = f"benche{mode[:2]}{int(rtt)}"
    hosts, links = topology.plan(hosts_n, topology.uniform(rtt))
    lab = labmod.Lab.up(name, hosts, links, mesh=True)
    runs = []
    try:
        lab.wait_formed()
        with Client(lab.state.host("h1").socket, timeout=120) as c:
            digest = _upload(c, EXAMPLES)
            for i in range(CRASHES):
                runs.append(_crash_once(lab, c, digest, nodes))
                print(f"  {mode} {rtt:g} ms, crash {i + 1}/{CRASHES}: t5 {runs[-1]['t5']:.2f} s", flush=True)
    finally:
        labmod.down(name)
    key = f"elastic_{mode}_{int(rtt)}ms"
    t5 = [r["t5"] for r in runs]
    out = {f"{key}_t5_p50_s": statistics.median(t5), f"{key}_t5_p95_s": _p95(t5), f"{key}_crashes": float(len(runs))}
    for step in ("t1", "t2", "t3", "t4"):
        out[f"{key}_{step}_p50_s"] = statistics.median(r[step] for r in runs)
    out[f"{key}_epochs_lost_mean"] = statistics.fmean(r["epochs_lost"] for r in runs)
    for side in ("before", "after"):
        rates = [r[side] for r in runs if r[side]]
        if rates:
            out[f"{key}_samples_per_s_{side}"] = statistics.median(rates)
    out[f"{key}_nodes_after"] = statistics.median(r["nodes_after"] for r in runs)
    return out


def _p95(xs: list[float]) -> float:
    if len(xs) < 2:
        return xs[0]
    return statistics.quantiles(xs, n=20, method="inclusive")[18]


def measure() -> dict[str, float]:
    results: dict[str, float] = {}
    for rtt in RTTS:
        for mode in MODES:
            results |= _mode(mode, rtt)
    from . import elastic_torchrun

    results |= {f"elastic_{k}": v for k, v in elastic_torchrun.measure().items()}
    return results


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=2))
