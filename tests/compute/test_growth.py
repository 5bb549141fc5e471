"""growth.py, the coordinator's "grow now?" (sans-IO), and the run's growth move (run.py):
table tests of the rule, the hosts that may join, and what a growth does to a job's run."""

from __future__ import annotations

import pytest

from swarmd.compute.coordinator.growth import GROW_EVERY_S, joining, ready, why
from swarmd.compute.coordinator.placement import Candidate, NoFit, Placement, place
from swarmd.compute.coordinator.run import IllegalMove, Run
from swarmd.compute.spec import JobSpec

A, B, C, D, E = (f"peer{x * 8}{x.lower() * 4}" for x in "ABCDE")
NOW = 10_000.0


def asked(**change) -> str | None:
    given = dict(grow=True, driver=False, most=4, size=2, running=True, last=None, now=NOW, every=GROW_EVERY_S)
    return ready(**{**given, **change})


@pytest.mark.parametrize("change, verdict", [
    ({}, None),  # below its maximum, running, never grew: look now
    ({"last": NOW - GROW_EVERY_S}, None),  # exactly N s after the last growth
    ({"last": NOW - 299.0}, "grew 299 s ago (at most once per 300 s)"),
    ({"last": NOW - 10.0, "every": 5.0}, None),  # the daemon's job_grow_every lowered
    ({"grow": False}, "growth is off for this job (--no-grow)"),
    ({"driver": True}, "a Ray job resizes its own cluster"),
    ({"size": 4}, "at its maximum of 4 node(s)"),
    ({"size": 5}, "at its maximum of 4 node(s)"),
    ({"running": False}, "the attempt is not running"),
])
def test_when_a_job_looks_for_free_hosts(change, verdict):
    assert asked(**change) == verdict


@pytest.mark.parametrize("most, current, placed, expected", [
    (4, (A, B), (A, B, C, D), (C, D)),
    (4, (A, B), (C, A, B), (C,)),  # placement's order (C hosts rank 0 next): kept
    (3, (A, B), (A, B, C, D), (C,)),  # never past the maximum, whatever placement returned
    (2, (A, B), (A, B, C), ()),
    (4, (A, B), (A, C, D), ()),  # it dropped a running host: no growth moves the job off one
    (4, (A, B), (A, B), ()),
    (4, (A, B), (A, B, C, C), (C,)),
])
def test_the_hosts_that_join(most, current, placed, expected):
    assert joining(most, current, placed) == expected


def test_the_reason_names_the_sizes_the_checkpoint_and_the_hosts():
    assert why((A, B), (C, D), "epoch-0005.pt") == \
        f"growing from 2 to 4 nodes at checkpoint epoch-0005.pt ({C[-8:]}, {D[-8:]} free again)"


def running(nodes: tuple[str, ...], max_restarts: int = 1) -> Run:
    run = Run(job="0123456789ab", min_nodes=2, max_restarts=max_restarts)
    run.to("reserving")
    run.placed(nodes, now=1.0)
    run.to("shipping")
    run.to("starting")
    for n in nodes:
        run.node_started(n, now=2.0)
    return run


def test_a_growth_stops_the_attempt_spends_no_restart_and_places_the_survivors_with_the_joining_hosts():
    run = running((A, B))
    run.grow((C, D), "growing from 2 to 4 nodes at checkpoint e.pt (…)", now=5.0)
    assert (run.state, run.phase, run.stop_others) == ("restarting", "stopping", True)
    run.node_exited(A, {0: -15}, now=6.0)  # the stop's echo, not a failure
    run.node_exited(B, {1: -15}, now=6.0)
    run.begin_attempt()
    assert run.restart_count == 0 and run.kept == (A, B) and run.joining == (C, D)
    assert run.attempts[0].why.startswith("growing from 2 to 4") and run.grown_at == 5.0
    assert run.growth is not None, "the next attempt's marker says it grew"
    run.to("reserving")
    run.placed((A, B, C, D), now=7.0)
    assert run.joining == ()


def test_a_host_lost_while_the_growth_stops_the_attempt_is_not_kept_and_a_failure_later_is_a_restart():
    run = running((A, B, C))
    run.grow((D,), "growing from 3 to 4 nodes at checkpoint e.pt (…)", now=5.0)
    run.node_lost(C, "membership: dead", now=5.5)
    run.node_exited(A, {0: -15}, now=6.0)
    run.node_exited(B, {1: -15}, now=6.0)
    assert run.state == "restarting" and run.restart_count == 0, "the loss was no failure of its own"
    run.begin_attempt()
    assert run.kept == (A, B) and run.joining == (D,)
    run.to("reserving")
    run.placed((A, B, D), now=7.0)
    run.to("shipping")
    run.to("starting")
    run.node_exited(D, {2: 1}, now=8.0)
    assert run.restart_count == 1 and run.growth is None, "a failure after a growth is an ordinary restart"


@pytest.mark.parametrize("setup", ["stopping", "cancelled", "restarting", "driver", "nobody"])
def test_only_a_running_attempt_with_no_stop_under_way_grows(setup):
    run = running((A, B))
    joining_hosts: tuple[str, ...] = (C,)
    if setup == "stopping":
        run.node_exited(A, {0: 1}, now=3.0)
    elif setup == "cancelled":
        run.cancel()
    elif setup == "restarting":
        run.node_lost(B, "dead", now=3.0)
    elif setup == "driver":
        run.driver = True
    else:
        joining_hosts = ()
    with pytest.raises(IllegalMove):
        run.grow(joining_hosts, "growing", now=4.0)


def test_a_grown_run_round_trips_and_a_record_cannot_smuggle_hosts_in():
    run = running((A, B))
    run.grow((C,), "growing from 2 to 3 nodes at checkpoint e.pt (…)", now=5.0)
    copy = Run.from_wire(run.to_wire())
    assert (copy.joining, copy.growth, copy.grown_at) == (run.joining, run.growth, 5.0)
    for change in ({"joining": ["a/b"]}, {"joining": "C"}, {"grown_at": True}, {"growth": 7}):
        with pytest.raises(ValueError):
            Run.from_wire({**run.to_wire(), **change})


def candidate(peer: str) -> Candidate:
    return Candidate(peer=peer, state="alive", gpus_free=0, gpu_model=None, slots_free=1, cpu_free=4.0,
                     memory_free_mb=4096, labels={})


def test_placement_never_holds_more_hosts_than_the_spec_allows_whatever_is_required():
    """A replica's record (a member's bytes) naming more kept and joining hosts than MAX."""
    spec = JobSpec(cmd=("x",), nodes=3, min_nodes=2)
    everyone = [candidate(p) for p in (A, B, C, D, E)]
    got = place(spec, everyone, lambda a, b: 1.0, require=(A, B, C, D))
    assert isinstance(got, NoFit) and "over its maximum" in got.reason
    got = place(spec, everyone, lambda a, b: 1.0, require=(A, B))
    assert isinstance(got, Placement) and len(got.peers) == 3 and {A, B} <= set(got.peers)
