"""The restart state machine (run.py): moves by table, attempts, and how an elastic job ends."""

from __future__ import annotations

import pytest

from swarmd.compute.coordinator.run import MOVES, STATES, TERMINAL, IllegalMove, Run

A, B, C, D = "peerAAAAAAAAaaaa", "peerBBBBBBBBbbbb", "peerCCCCCCCCcccc", "peerDDDDDDDDdddd"


def started(nodes=(A, B, C), *, max_restarts=2, min_nodes=2, t=0.0) -> Run:
    run = Run(job="j", max_restarts=max_restarts, min_nodes=min_nodes)
    run.to("reserving")
    run.placed(nodes, now=t)
    run.to("shipping")
    run.to("starting")
    for n in nodes:
        run.node_started(n, now=t + 1)
    assert run.state == "running"
    return run


def lose_c(run: Run) -> None:
    """C is lost and the other two stop: the attempt is over."""
    run.node_lost(C, "dead")
    run.node_exited(A, {0: 143})
    run.node_exited(B, {1: 143})


def setting_up(run: Run, nodes: tuple[str, ...], t: float | None = None) -> None:
    """The next attempt placed on `nodes`, its ranks starting (none has said so yet)."""
    run.begin_attempt()
    run.to("reserving")
    run.placed(nodes, now=t)
    run.to("shipping")
    run.to("starting")


def restart(run: Run, nodes: tuple[str, ...], t: float) -> None:
    setting_up(run, nodes, t)
    for n in nodes:
        run.node_started(n, now=t + 1)


LIVE = [s for s in STATES if s not in TERMINAL]


@pytest.mark.parametrize("state", LIVE)
@pytest.mark.parametrize("requested", [*STATES, "stopping"])
def test_every_move_is_in_the_table_or_raises(state, requested):
    run = Run(job="j")
    run.state = state
    expected = MOVES.get((state, requested))
    if expected is None:
        with pytest.raises(IllegalMove, match=f"no move from {state} to {requested}"):
            run.to(requested)
        assert run.state == state
    else:
        run.to(requested)
        assert run.state == expected


@pytest.mark.parametrize("state", sorted(TERMINAL))
def test_a_finished_job_absorbs_every_late_move(state):
    run = Run(job="j")
    run.state = state
    for requested in STATES:
        run.to(requested)
    assert run.state == state


def test_a_lost_host_restarts_the_job_and_the_next_attempt_runs():
    run = started()
    run.node_lost(C, "silent for 2.5 s", now=10.0)
    assert (run.state, run.phase, run.restart_count) == ("restarting", "stopping", 1)
    assert run.reason == "host CCCCcccc lost: silent for 2.5 s"
    assert run.stop_others and not run.settled
    run.node_exited(A, {0: 143}, now=10.2)  # stopped because of the loss: not a new cause
    run.node_exited(B, {1: 143}, now=10.3)
    assert run.settled and run.state == "restarting" and run.survivors == (A, B)
    assert run.attempts[0].why == "host CCCCcccc lost: silent for 2.5 s"
    assert (run.attempts[0].detected, run.attempts[0].ended) == (10.0, 10.3)
    restart(run, (A, B, D), t=12.0)
    assert run.state == "running" and run.phase is None and not run.stop_others
    assert [a.nodes for a in run.attempts] == [(A, B, C), (A, B, D)]
    assert run.attempts[1].started == 13.0
    for i, n in enumerate((A, B, D)):
        run.node_exited(n, {i: 0})
    assert (run.state, run.exit_code) == ("succeeded", 0)


def test_restarting_keeps_its_phase_while_the_next_attempt_is_set_up():
    run = started()
    run.node_exited(B, {1: 1}, now=5.0)
    run.node_exited(A, {0: 143})
    run.node_exited(C, {2: 143})
    run.begin_attempt()
    for phase in ("reserving", "shipping", "starting"):
        run.to(phase)
        assert (run.state, run.phase) == ("restarting", phase)


def test_a_rank_failing_on_every_attempt_is_restarted_max_restarts_times_then_fails_with_its_code():
    run = started(max_restarts=2)
    for attempt in range(3):
        run.node_exited(B, {1: 1}, now=attempt * 10.0)
        run.node_exited(A, {0: 143})
        run.node_exited(C, {2: 143})
        if attempt < 2:
            assert run.state == "restarting" and run.restart_count == attempt + 1
            restart(run, (A, B, C), t=attempt * 10.0 + 5)
    assert (run.state, run.exit_code) == ("failed", 1)
    assert run.reason == ("rank 1 on peerBBBBBBBBbbbb exited with 1; restarts exhausted (2/2); attempts: "
                          "#1 rank 1 on peerBBBBBBBBbbbb exited with 1; #2 rank 1 on peerBBBBBBBBbbbb exited with 1; "
                          "#3 rank 1 on peerBBBBBBBBbbbb exited with 1")
    assert len(run.attempts) == 3 and all(a.why for a in run.attempts)


def test_a_job_without_restarts_fails_as_before():
    run = started(max_restarts=0)
    run.node_lost(B, "stream closed")
    run.node_exited(A, {0: 143})
    run.node_exited(C, {2: 143})
    assert (run.state, run.exit_code, run.reason) == ("failed", 1, "host BBBBbbbb lost: stream closed")


def test_a_rank_failing_while_a_restart_starts_ends_that_attempt_too():
    run = started()
    lose_c(run)
    setting_up(run, (A, B), 20.0)
    run.node_started(A)
    run.node_exited(B, {1: 2}, now=21.0)  # before every node started
    assert (run.state, run.restart_count, run.attempts[1].why) == ("restarting", 2, "rank 1 on " + B + " exited with 2")
    run.node_exited(A, {0: 143})
    assert run.settled and run.state == "restarting"


def test_too_few_hosts_for_a_restart_fails_naming_every_attempt():
    run = started()
    lose_c(run)
    run.begin_attempt()
    run.fail("fewer than 2 hosts fit")
    assert run.state == "failed"
    assert run.reason == "fewer than 2 hosts fit; attempts: #1 host CCCCcccc lost: dead"


def test_cancel_while_stopping_for_a_restart_cancels_once_everyone_stopped():
    run = started()
    run.node_lost(C, "dead")
    run.cancel()
    assert run.state == "restarting" and run.reason == "cancelled by the user"
    run.node_exited(A, {0: 143})
    run.node_exited(B, {1: 143})
    assert (run.state, run.exit_code) == ("cancelled", 130)


def test_cancel_while_a_restart_reserves_is_at_once():
    run = started()
    lose_c(run)
    run.begin_attempt()
    run.to("reserving")
    run.placed((A, B))
    run.cancel()
    assert run.state == "cancelled"


def test_cancel_after_restarts_ran_out_does_not_hide_the_failure():
    run = started(max_restarts=0)
    run.node_exited(A, {0: 4})
    run.cancel()
    run.node_exited(B, {1: 143})
    run.node_exited(C, {2: 143})
    assert (run.state, run.exit_code) == ("failed", 4)


def test_a_new_attempt_needs_the_last_one_over():
    run = started()
    with pytest.raises(IllegalMove):
        run.begin_attempt()  # nothing ended
    run.node_lost(C, "dead")
    with pytest.raises(IllegalMove):
        run.begin_attempt()  # A and B still running


def test_a_resumed_job_whose_ranks_end_before_every_start_is_told_succeeds():
    run = started()
    lose_c(run)
    setting_up(run, (A, B))
    run.node_started(A)
    run.node_exited(A, {0: 0})  # resumed at the last epoch: done before B's start was told
    run.node_started(B)
    assert run.state == "running"
    run.node_exited(B, {1: 0})
    assert (run.state, run.exit_code) == ("succeeded", 0)
    run2 = started()
    run2.node_exited(B, {1: 1})
    run2.node_exited(A, {0: 143})
    run2.node_exited(C, {2: 143})
    setting_up(run2, (A, B))
    run2.node_exited(A, {0: 0})
    run2.node_exited(B, {1: 0})  # neither start was told
    assert run2.state == "succeeded"


def test_a_lost_host_is_placed_again_after_a_pause_doubling_with_each_restart_up_to_a_minute():
    """Where only a host lost earlier fits: 1 s after the first restart, then 2, 4 … 60 s; the
    largest count a member's record may carry still gives a minute, not an overflow."""
    run = Run(job="j", max_restarts=1000)
    pauses = []
    for count in (0, 1, 2, 3, 6, 7, 1000):
        run.restart_count = count
        pauses.append(run.lost_retry_pause)
    assert pauses == [1.0, 1.0, 2.0, 4.0, 32.0, 60.0, 60.0]
