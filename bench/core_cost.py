"""What one membership core costs at swarm size: time per event and bytes per member.

The simulator runs one core per simulated node, so both figures bound what `swarm-sim run`
can do: an event is ``receive_record`` of a member's new record, then ``handle_timeout`` and
``next_deadline`` (what a driver does after every input); probes the core starts are answered
at once, as a healthy swarm would. Bytes per member: tracemalloc over building a core that
holds N members (the records themselves are the driver's, shared, and not counted; nor are
the ints all cores in a process share), once as the daemon's core (its own ``PeerIndex``, float64
times) and once as the simulator's (a ``PeerIndex`` all cores share, built before: not this core's;
``compact`` float32 times).

``python -m bench.core_cost [N ...]`` prints a table; quick (a few seconds at 10,000).
``BEFORE``: the same measurements on earlier cores, on this 2-core machine: a member an object
of eight slots (commit 42b9b16, issue 30's columns replaced it), and the core before issue
15's refactor (commit 40db257). The first columns (commit a368dc7: float64 times, a ``heard`` column,
RTTs in two NaN-filled columns) cost 132 B a member with its own index and 77 B shared, at 10,000.
"""

from __future__ import annotations

import gc
import random
import sys
import timeit
import tracemalloc

from sim.swarm import SimRecord as Rec  # what the core reads of a record (membership.Carried)
from swarmd.gossip.membership import Membership, PeerIndex, Probe, Timing, _index

BEFORE = {1_000: {"event_us": 3.06, "bytes_per_member": 179.0},  # rows of slots (42b9b16)
          10_000: {"event_us": 3.34, "bytes_per_member": 167.0}}
BEFORE_ISSUE_15 = {1_000: {"event_us": 122.7, "bytes_per_member": 200.0},  # 40db257
                   10_000: {"event_us": 1265.9, "bytes_per_member": 190.0}}


def build(n: int, seed: int = 1) -> tuple[Membership, list[Rec]]:
    recs = [Rec(f"peer-{i:06d}", 10) for i in range(n)]
    core = Membership("me", 1 << 32, Timing.wan(), random.Random(seed), 0.0)
    for r in recs:
        core.receive_record(0.0, r)
    core.take_actions()
    return core, recs


def event_cost(n: int, events: int = 2000) -> float:
    """Microseconds per event, the best of 3 runs of ``events`` events each."""
    core, recs = build(n)
    rng = random.Random(2)
    state = {"now": 1.0}

    def one() -> None:
        now = state["now"] = state["now"] + 0.001
        i = rng.randrange(n)
        r = recs[i] = Rec(recs[i].peer, recs[i].seq + 1)
        core.receive_record(now, r)
        core.handle_timeout(now)
        core.next_deadline()
        for a in core.take_actions():
            if isinstance(a, Probe):
                core.probe_result(now, a.id, True, 0.05)

    return min(timeit.repeat(one, number=events, repeat=3)) / events * 1e6


def bytes_per_member(n: int, shared: bool = False) -> float:
    """``shared``: the simulator's core (rows from a PeerIndex all cores share, float32 times)."""
    recs = [Rec(f"peer-{i:06d}", 10) for i in range(n)]
    _index(n)  # the ints every core in the process shares: built once, not this core's
    peers = PeerIndex(r.peer for r in recs) if shared else None
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    core = Membership("me", 1 << 32, Timing.wan(), random.Random(1), 0.0, peers=peers, compact=shared)
    for r in recs:
        core.receive_record(0.0, r)
    core.take_actions()
    core.handle_timeout(0.0)
    core.take_actions()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del core
    return used / n


def measure(sizes: list[int]) -> list[dict[str, float | None]]:
    """One row per size: what ``make bench`` records (before: the earlier cores, where measured)."""
    rows = []
    for n in sizes:
        before, older = BEFORE.get(n, {}), BEFORE_ISSUE_15.get(n, {})
        rows.append({"members": n, "event_us": round(event_cost(n), 2),
                     "bytes_per_member": round(bytes_per_member(n)),
                     "bytes_per_member_shared": round(bytes_per_member(n, shared=True)),
                     "event_us_before": before.get("event_us"),
                     "bytes_per_member_before": before.get("bytes_per_member"),
                     "event_us_before_issue_15": older.get("event_us"),
                     "bytes_per_member_before_issue_15": older.get("bytes_per_member")})
    return rows


def main(sizes: list[int]) -> None:
    def cell(v: float | None, digits: int) -> str:
        return f"{v:9.{digits}f}" if v is not None else f"{'-':>9}"
    print(f"{'members':>9} {'us/event':>9} {'slots':>9} {'issue 15':>9} {'B/member':>9} {'shared':>9} {'slots':>9} "
          f"{'issue 15':>9}")
    for r in measure(sizes):
        print(f"{r['members']:9d} {cell(r['event_us'], 1)} {cell(r['event_us_before'], 1)} "
              f"{cell(r['event_us_before_issue_15'], 1)} {cell(r['bytes_per_member'], 0)} "
              f"{cell(r['bytes_per_member_shared'], 0)} {cell(r['bytes_per_member_before'], 0)} "
              f"{cell(r['bytes_per_member_before_issue_15'], 0)}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1_000, 10_000])
