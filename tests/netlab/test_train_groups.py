"""Groups by latency (issue 29) on six real hosts as two regions, 5 ms inside and 150 ms
between: `jobs run --groups auto` finds the two regions from the RTTs the swarm measured, the
ranks sync every step inside a region and by DiLoCo across them (hierarchical), and train."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .support import call, formed, rank_lines, swarmctl, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]
EXAMPLES = Path(__file__).parents[2] / "examples"
REGION = {"h1": "a", "h2": "a", "h3": "a", "h4": "b", "h5": "b", "h6": "b"}


def rtt(a, b) -> float:
    return 5.0 if REGION[a.name] == REGION[b.name] else 150.0


@pytest.fixture(scope="module")
def regions():
    with formed("tg", len(REGION), rtt, mesh=True) as lab:
        yield lab


def settled(lab) -> tuple[bool, dict]:
    """Whether every RTT the coordinator (h1) will group by is near its link's: its own probes
    to h2 and h3, and each member's record's RTTs to the others. At a lab's start six daemons
    and their probes share two cores, and a 5 ms link reads 20-30 ms for a while."""
    names = {call(lab, h, "status")["peer_id"]: h for h in REGION}
    off = {}
    peers = {names.get(p["peer"]): p for p in call(lab, "h1", "peers")["peers"]}
    for a in REGION:
        if a == "h1":
            continue
        p = peers.get(a)
        if p is None or p.get("state") != "alive":
            off[a] = "not alive" if p is None else p.get("state")
            continue
        readings = {names.get(q): ms for q, ms in (p.get("rtts_ms") or {}).items()}
        if REGION[a] == REGION["h1"]:
            readings["h1"] = p.get("rtt_ms")
        for b in REGION:  # every pair inside a region, and what is known across
            if b == a or (REGION[b] != REGION[a] and b not in readings):
                continue
            ms, want = readings.get(b), 5.0 if REGION[a] == REGION[b] else 150.0
            if ms is None or not want * 0.5 <= ms <= want * 1.3 + 5:
                off[f"{a}-{b}"] = ms
    return not off, off


def test_two_regions_make_two_groups_and_hierarchical_diloco_trains(regions):
    until(lambda: settled(regions)[0], 180, "RTTs near the links'", interval=2.0, detail=lambda: settled(regions)[1])
    r = swarmctl(regions, "h1", "jobs", "run", "--nodes", "6", "--groups", "auto", "--detach", "--workdir",
                 str(EXAMPLES), "--", "python", "ddp_digits.py", "--sync", "diloco:8", "--epochs", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    job = r.stdout.strip().split()[-1]
    until(lambda: call(regions, "h1", "jobs.show", id=job)["state"] in ("succeeded", "failed", "cancelled"), 600,
          "the job ended", interval=2.0)
    shown = call(regions, "h1", "jobs.show", id=job)
    text = "\n".join(rank_lines(swarmctl(regions, "h1", "jobs", "logs", job).stdout).get(0, []))
    assert shown["state"] == "succeeded", (shown["state"], shown.get("reason"), text[-2000:])
    groups = shown["groups"]
    assert groups and groups.get("groups"), {k: shown.get(k) for k in ("groups", "attempts", "state")}
    names = {call(regions, h, "status")["peer_id"]: h for h in REGION}
    found = sorted(sorted(names[groups["nodes"][i]] for i in g) for g in groups["groups"])  # node ranks -> hosts
    assert found == [["h1", "h2", "h3"], ["h4", "h5", "h6"]], groups
    assert "ddp every step inside each group, DiLoCo outer step" in text, text[-2000:]
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", text).group(1))
    print(f"groups {groups['groups']}; {text[-300:]}")
    assert accuracy > 0.9, text[-2000:]
    assert "groups" in swarmctl(regions, "h1", "jobs", "show", job).stdout.lower()
