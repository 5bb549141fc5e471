"""A job's run as its replicas keep it (Run.to_wire / from_wire): a successor goes on from
exactly the state the coordinator was in, and a record a replica shaped is checked field by
field before a successor acts on it."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmd.compute.coordinator.run import MAX_ATTEMPTS_KEPT, Run

A, B, C, D = "peerAAAAAAAAaaaa", "peerBBBBBBBBbbbb", "peerCCCCCCCCcccc", "peerDDDDDDDDdddd"
HOSTS = (A, B, C, D)


def over_the_wire(run: Run) -> Run:
    """As a record carries it: msgpack with string keys only (succession.Record)."""
    raw = msgpack.packb(run.to_wire(), use_bin_type=True)
    return Run.from_wire(msgpack.unpackb(raw, raw=False, strict_map_key=True))


def same(a: Run, b: Run) -> bool:
    return a.to_wire() == b.to_wire()


# events a coordinator applies, by name: (name, host index, value)
event = st.tuples(st.sampled_from(["place", "ship", "start", "started", "exit0", "exit1", "lost", "cancel",
                                   "begin", "fail"]), st.integers(0, 3), st.integers(0, 3))


def apply(run: Run, name: str, i: int, v: int, t: float) -> None:
    """``name`` as the coordinator would apply it: hosts report only while their ranks start or run."""
    host = HOSTS[i]
    attempt_runs = run.state in ("starting", "running") or run.state == "restarting" and run.phase in (
        "starting", "stopping")
    if name in ("started", "exit0", "exit1", "lost") and not attempt_runs:
        return
    try:
        if name == "place" and ("placing" in (run.state, run.phase) or "reserving" in (run.state, run.phase)):
            run.to("reserving")
            run.placed(HOSTS[:v + 1], now=t)
        elif name == "ship" and "reserving" in (run.state, run.phase):
            run.to("shipping")
        elif name == "start":
            run.to("starting")
        elif name == "started":
            run.node_started(host, now=t)
        elif name in ("exit0", "exit1"):
            rank = run.nodes.index(host) if host in run.nodes else 0
            run.node_exited(host, {rank: 0 if name == "exit0" else v + 1}, now=t)
        elif name == "lost":
            run.node_lost(host, f"dead {v}", now=t)
        elif name == "cancel":
            run.cancel()
        elif name == "begin":
            run.begin_attempt()
        elif name == "fail":
            run.fail(f"no fit {v}")
    except Exception as exc:  # an illegal move for this state: the coordinator would not make it
        if exc.__class__.__name__ != "IllegalMove":
            raise


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3), st.booleans(), st.lists(event, max_size=40))
def test_any_run_round_trips_and_goes_on_the_same_from_its_record(max_restarts, driver, events):
    run = Run(job="0123456789ab", procs_per_node=1, min_nodes=1, max_restarts=max_restarts, driver=driver)
    for t, (name, i, v) in enumerate(events):
        apply(run, name, i, v, float(t))
        copy = over_the_wire(run)
        assert same(copy, run)
    # the successor and the coordinator it replaces take the same next steps to the same state
    copy = over_the_wire(run)
    for t, (name, i, v) in enumerate(events[:10]):
        apply(run, name, i, v, 100.0 + t)
        apply(copy, name, i, v, 100.0 + t)
    assert same(copy, run)


def test_a_record_keeps_the_last_attempts_only():
    run = Run(job="0123456789ab", max_restarts=100)
    for _ in range(MAX_ATTEMPTS_KEPT + 5):
        if run.state == "restarting":
            run.begin_attempt()
        run.to("reserving")
        run.placed((A,), now=1.0)
        run.to("shipping")
        run.to("starting")
        run.node_lost(A, "dead", now=2.0)
    copy = over_the_wire(run)
    assert len(copy.attempts) == MAX_ATTEMPTS_KEPT and copy.attempts[-1].n == MAX_ATTEMPTS_KEPT + 5
    assert copy.restart_count == run.restart_count and copy.lost == {A}


def base() -> dict:
    run = Run(job="0123456789ab", max_restarts=2)
    run.to("reserving")
    run.placed((A, B), now=1.0)
    run.to("shipping")
    run.to("starting")
    run.node_started(A, now=2.0)
    return run.to_wire()


@pytest.mark.parametrize("change, names", [
    ({"state": "rm -rf"}, "record.state"),
    ({"state": "running", "phase": "placing"}, "record.phase"),
    ({"verdict": "win"}, "record.verdict"),
    ({"nodes": ["a/b"]}, "record.nodes"),
    ({"nodes": ["x" * 65]}, "record.nodes"),
    ({"nodes": [A] * 1025}, "record.nodes"),
    ({"node_state": {A: "running"}}, "record.node_state"),
    ({"node_state": {A: "running", B: "zombie"}}, "record.node_state"),
    ({"exit_codes": [[0]]}, "record.exit_codes"),
    ({"exit_codes": [[-1, 0]]}, "record.exit_codes rank"),
    ({"exit_codes": [[0, 2**40]]}, "an exit code"),
    ({"failure": [0]}, "record.failure"),
    ({"attempts": [{}] * (MAX_ATTEMPTS_KEPT + 1)}, "record.attempts"),
    ({"attempts": [{"n": 1}]}, "an attempt"),
    ({"max_restarts": 10**9}, "record.max_restarts"),
    ({"restart_count": 3}, "record.restart_count"),  # more than max_restarts (2)
    ({"procs_per_node": 0}, "record.procs_per_node"),
    ({"driver": 1}, "record.driver"),
    ({"reason": "x" * 5000}, "record.reason"),
    ({"lost": "AAAA"}, "record.lost"),
    ({"extra": 1}, "a job's record"),
])
def test_a_malformed_record_is_refused_naming_the_field(change, names):
    d = {**base(), **change}
    with pytest.raises(ValueError) as exc:
        Run.from_wire(d)
    assert names in str(exc.value)


def test_a_record_that_is_not_a_map_is_refused():
    for value in (None, [], "run", 7):
        with pytest.raises(ValueError):
            Run.from_wire(value)
    attempt = base()["attempts"][0]
    for change in ({"placed": -1.0}, {"placed": True}, {"why": 5}, {"n": 0}, {"nodes": [7]}):
        with pytest.raises(ValueError):
            Run.from_wire({**base(), "attempts": [{**attempt, **change}]})
