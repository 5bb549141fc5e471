"""Placement's cost on the daemon's event loop: a synthetic view of 1,000 alive members in
30 clusters (RTTs from positions on a line), 8 and 64 nodes asked; median of 5 runs."""

from __future__ import annotations

import random
import statistics
import time

from swarmd.compute.coordinator.placement import Candidate, Placement, place
from swarmd.compute.spec import build

MEMBERS = 1000


def measure() -> dict[str, float]:
    rng = random.Random(1)
    clusters = [rng.uniform(0, 1000) for _ in range(30)]
    pos = {f"12D3KooW{i:044d}": clusters[i % 30] + rng.uniform(0, 3) for i in range(MEMBERS)}
    view = [Candidate(peer=p, state="alive", gpus_free=0, gpu_model=None, slots_free=2, cpu_free=2.0,
                      memory_free_mb=8000, labels={}) for p in pos]
    results = {}
    for nodes in (8, 64):
        spec = build({"cmd": ["python"], "nodes": nodes}, {})
        took = []
        for _ in range(5):
            t0 = time.perf_counter()
            assert isinstance(place(spec, view, lambda a, b: abs(pos[a] - pos[b])), Placement)
            took.append(time.perf_counter() - t0)
        results[f"placement_{MEMBERS}_members_{nodes}_nodes_s"] = statistics.median(took)
    return results
