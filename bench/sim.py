"""Simulator figures (`make bench`, part `sim`): the membership core's cost per event and per
member, then `swarm-sim run` on the shipped scenarios, each in its own process so that its wall
time and peak RSS are its own.

- ``lab-5-countries`` beside the lab's own figures (part ``gossip`` of this run, or of the last
  bench.json): kill detection by all p50/p99 and a change's time to every node p50/p99.
- ``swarm-100``, ``swarm-1k``, ``swarm-2k`` (1 % loss) and ``swarm-2k-5pct``, ``swarm-5k``,
  ``swarm-10k``, ``swarm-20k`` (issue 30's "20k fits", the longest run): detection, false dead,
  change convergence beyond the longest one-way delay, bytes per node per second (by kind), wall
  time, peak RSS; over 1k-10k, the bytes' largest figure and its ratio to the smallest. A scenario whose n^2 member entries cannot fit in the
  memory available is skipped and the memory it would need recorded.
- ``disseminate-100k``: one record to 100,000 nodes over the gossipsub model.

``SWARMD_BENCH_SIM=lab-5-countries,swarm-2k`` runs only those. Reports and plots are kept in
``.bench/sim/<scenario>/``; the README's plots in ``docs/sim/`` are copies of one such run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sim import scenario
from sim.runner import fits

from . import core_cost

SCENARIOS = ("lab-5-countries", "swarm-100", "swarm-1k", "swarm-2k", "swarm-2k-5pct", "swarm-5k", "swarm-10k",
             "swarm-20k", "disseminate-100k")
ONLY = [s for s in os.environ.get("SWARMD_BENCH_SIM", ",".join(SCENARIOS)).split(",") if s in SCENARIOS]
OUT = Path(".bench/sim")
SHORT = {"lab-5-countries": "lab5", "swarm-100": "100", "swarm-1k": "1k", "swarm-2k": "2k", "swarm-2k-5pct": "2k_5pct",
         "swarm-5k": "5k", "swarm-10k": "10k", "swarm-20k": "20k", "disseminate-100k": "100k"}
SWEEP = ("1k", "2k", "5k", "10k")  # bytes per node per second: flat within 2x over these, at most 40 kB/s (issue 30)
def run(name: str) -> tuple[dict, float, float]:
    """(report.json, wall s, peak RSS in GB) of `swarm-sim run sim/scenarios/NAME.toml`."""
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "sim.cli", "run", f"sim/scenarios/{name}.toml", "--out", str(out)],
                            stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"swarm-sim run {name} failed (exit {proc.returncode})")
    return json.loads((out / "report.json").read_text()), wall, usage.ru_maxrss / 2**20  # KiB -> GiB


def _membership(key: str, report: dict) -> dict[str, float]:
    det, conv, traffic = report["detection"], report["convergence_s"], report["traffic"]
    out = {
        f"sim_{key}_detect_p50_s": det["per_observer_s"]["p50"],
        f"sim_{key}_detect_p99_s": det["per_observer_s"]["p99"],
        f"sim_{key}_detect_by_all_p50_s": det["by_all_s"]["p50"],
        f"sim_{key}_detect_by_all_p99_s": det["by_all_s"]["p99"],
        f"sim_{key}_missed_detections": det["missed"],
        f"sim_{key}_false_dead": report["false_dead"]["count"],
        f"sim_{key}_suspicions_refuted": report["suspicions"].get("refuted", 0),
        f"sim_{key}_change_t100_p50_ms": conv["t100"]["p50"] * 1e3 if conv["t100"]["p50"] is not None else None,
        f"sim_{key}_change_t100_p99_ms": conv["t100"]["p99"] * 1e3 if conv["t100"]["p99"] is not None else None,
        f"sim_{key}_change_excess_p99_ms": conv["excess"]["p99"] * 1e3 if conv["excess"]["p99"] is not None else None,
        f"sim_{key}_max_one_way_ms": report["max_one_way_s"] * 1e3,
        f"sim_{key}_bytes_sent_per_node_s": traffic["bytes_sent_per_s"]["mean"],
        f"sim_{key}_bytes_recv_per_node_s": traffic["bytes_recv_per_s"]["mean"],
        f"sim_{key}_msgs_recv_per_node_s": traffic["msgs_recv_per_s"]["mean"],
        f"sim_{key}_bytes_recv_p99_per_node_s": traffic["bytes_recv_per_s"]["p99"],
    }
    for kind, f in traffic.get("bytes_recv_by_kind_per_s", {}).items():  # the mean and the p99 node, by kind
        out |= {f"sim_{key}_bytes_recv_{kind}_per_node_s": f["mean"],
                f"sim_{key}_bytes_recv_{kind}_p99_per_node_s": f["p99"]}
    return {k: v for k, v in out.items() if v is not None}


def _dissemination(key: str, report: dict) -> dict[str, float]:
    d = report["dissemination_s"]
    out = {f"sim_{key}_reached": d["reached"], f"sim_{key}_max_one_way_ms": d["max_one_way_s"] * 1e3}
    out |= {f"sim_{key}_{q}_ms": d[q] * 1e3 for q in ("t50", "t90", "t99", "t100") if d[q] is not None}
    return out


def measure(lab: dict | None = None) -> dict[str, float]:
    """``lab``: the results so far (or the last bench.json's), for the lab's figures side by side."""
    results: dict[str, float] = {}
    for row in core_cost.measure([10_000]):
        results["sim_core_event_us_10k"] = row["event_us"]
        results["sim_core_bytes_per_member_10k"] = row["bytes_per_member"]
        results["sim_core_bytes_per_member_shared_10k"] = row["bytes_per_member_shared"]
    for name in ONLY:
        key = SHORT[name]
        nodes = scenario.load(Path(f"sim/scenarios/{name}.toml"))
        ok, need, have = fits(nodes.nodes + nodes.joins) if nodes.mode == "membership" else (True, 0.0, 0.0)
        if not ok:
            print(f"sim: {name} skipped: {nodes.nodes:,} cores of {nodes.nodes:,} members need about "
                  f"{need:.0f} GB, {have:.0f} GB available", file=sys.stderr)
            results[f"sim_{key}_skipped_needs_gb"] = need
            continue
        print(f"sim: swarm-sim run {name}...", file=sys.stderr)
        report, wall, rss = run(name)
        results[f"sim_{key}_wall_s"] = wall
        results[f"sim_{key}_peak_rss_gb"] = rss
        results |= _dissemination(key, report) if report["scenario"]["mode"] == "disseminate" else \
            _membership(key, report)
    sweep = [results[f"sim_{k}_bytes_recv_per_node_s"] for k in SWEEP if f"sim_{k}_bytes_recv_per_node_s" in results]
    if len(sweep) >= 2:
        results["sim_bytes_recv_per_node_s_max_over_min_1k_10k"] = max(sweep) / min(sweep)
        results["sim_bytes_recv_per_node_s_max_1k_10k"] = max(sweep)
    lab = lab or {}
    for sim_key, lab_key in (("sim_lab5_detect_by_all_p50_s", "kill_detected_by_all_p50_s"),
                             ("sim_lab5_detect_by_all_p99_s", "kill_detected_by_all_p99_s"),
                             ("sim_lab5_change_t100_p50_ms", "change_seen_by_all_p50_ms"),
                             ("sim_lab5_change_t100_p99_ms", "change_seen_by_all_p99_ms")):
        if sim_key in results and lab.get(lab_key):
            results[sim_key.replace("sim_lab5", "sim_vs_lab")] = results[sim_key] / lab[lab_key]
    return results


if __name__ == "__main__":
    previous = Path(".bench/bench.json")
    lab = json.loads(previous.read_text())["results"] if previous.exists() else {}
    for key, value in measure(lab).items():
        print(f"{key:45s} {value:12.3f}")
