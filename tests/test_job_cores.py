"""The sans-IO cores behind jobs: a host's ledger, gang reservation, and a job's life."""

from __future__ import annotations

import pytest

from swarmd.compute.gang import Commit, Gang, Release
from swarmd.compute.ledger import Cancel, Grant, Ledger, Refusal
from swarmd.compute.run import Run

# --- a host's ledger ---------------------------------------------------------------------


def test_a_host_refuses_work_beyond_its_slots_and_gpus():
    ledger = Ledger(2, gpus=(0, 1, 2))
    assert ledger.reserve(0, "a", "c", gpus=2, ranks=1, lease=30) == Grant("a", (0, 1))
    assert ledger.reserve(0, "b", "c", gpus=2, ranks=1, lease=30) == Refusal("1 free GPU(s), 2 asked")
    assert ledger.reserve(0, "b", "c", gpus=1, ranks=1, lease=30) == Grant("b", (2,))
    assert ledger.reserve(0, "x", "c", gpus=0, ranks=1, lease=30) == Refusal("no free job slot (all 2 in use)")
    assert ledger.slots_free == 0 and ledger.gpus_free == ()


def test_an_uncommitted_lease_lapses_and_a_committed_one_holds():
    ledger = Ledger(1)
    ledger.reserve(0, "a", "c", gpus=0, ranks=1, lease=30)
    assert ledger.next_deadline() == 30
    assert ledger.expire(29.9) == [] and ledger.expire(30) == ["a"]
    assert isinstance(ledger.commit(31, "a", "c"), Refusal), "a lapsed lease cannot be committed"
    ledger.reserve(40, "b", "c", gpus=0, ranks=1, lease=30)
    assert ledger.commit(41, "b", "c") == Grant("b", ())
    assert ledger.expire(10_000) == [] and ledger.holds("b"), "committed work has no deadline"
    assert ledger.release("b", "c") is True and ledger.slots_free == 1


def test_a_retried_reservation_is_the_same_grant_and_others_cannot_take_it():
    ledger = Ledger(2, gpus=(0, 1))
    first = ledger.reserve(0, "a", "coord", gpus=1, ranks=1, lease=10)
    assert ledger.reserve(5, "a", "coord", gpus=1, ranks=1, lease=10) == first
    assert ledger.next_deadline() == 15, "a retry renews the lease"
    assert isinstance(ledger.reserve(5, "a", "intruder", gpus=1, ranks=1, lease=10), Refusal)
    assert isinstance(ledger.commit(5, "a", "intruder"), Refusal)


def test_start_needs_the_same_coordinators_commit_and_at_most_the_ranks_reserved():
    ledger = Ledger(2)
    ledger.reserve(0, "a", "coord", gpus=0, ranks=2, lease=10)
    assert ledger.start("a", "coord", 2).code == "not_committed"
    assert ledger.start("zz", "coord", 1).code == "no_reservation"
    ledger.commit(1, "a", "coord")
    assert ledger.start("a", "intruder", 1).code == "not_holder"
    assert ledger.start("a", "coord", 3) == Refusal("job a reserved 2 rank(s) here, 3 asked", "ranks")
    assert ledger.start("a", "coord", 2) == Grant("a", ())
    assert ledger.start("a", "coord", 2).code == "state", "one start per hold"


def test_only_the_holder_releases_and_a_running_hold_is_cancelled_not_freed():
    ledger = Ledger(1)
    ledger.reserve(0, "a", "coord", gpus=0, ranks=1, lease=10)
    assert ledger.release("a", "intruder").code == "not_holder" and ledger.holds("a")
    assert ledger.check_holder("a", "intruder").code == "not_holder"
    assert ledger.check_holder("a", "coord") is None and ledger.check_holder("zz", "intruder") is None
    ledger.commit(1, "a", "coord")
    ledger.start("a", "coord", 1)
    assert ledger.expire(1e9) == [] and ledger.state_of("a") == "running", "no lease lapses under running ranks"
    assert ledger.release("a", "coord") == Cancel("a") and ledger.slots_free == 0, "its ranks still use the slot"
    assert ledger.finish("a") and ledger.slots_free == 1 and not ledger.finish("a")
    assert ledger.release("a", "coord") is False


def test_a_ledger_needs_a_slot():
    with pytest.raises(ValueError, match="at least one job slot"):
        Ledger(0)


# --- gang reservation --------------------------------------------------------------------


def test_every_host_granting_commits_in_placement_order():
    g = Gang(peers=("b", "a"), deadline=5)
    g.grant("a", (0,))
    assert g.decide(1) is None, "still waiting for b"
    g.grant("b", ())
    assert g.decide(1) == Commit(gpus={"b": (), "a": (0,)})


def test_one_refusal_releases_the_others_and_names_the_refuser():
    g = Gang(peers=("a", "b", "c"), deadline=5)
    g.grant("a", ())
    g.refuse("b", "no free job slot")
    decision = g.decide(1)
    assert isinstance(decision, Release)
    assert decision.peers == ("a",)
    assert decision.refused == {"b": "no free job slot", "c": "no answer to the reservation in time"}


def test_silence_past_the_deadline_counts_as_a_refusal():
    g = Gang(peers=("a", "b"), deadline=5)
    g.grant("a", ())
    assert g.decide(4.9) is None
    assert g.decide(5) == Release(peers=("a",), refused={"b": "no answer to the reservation in time"})


def test_answers_from_hosts_outside_the_gang_are_ignored():
    g = Gang(peers=("a",), deadline=5)
    g.grant("z", ())
    g.refuse("y", "no")
    assert g.decide(1) is None


# --- a job's life --------------------------------------------------------------------------


def running(nodes=("a", "b", "c")) -> Run:
    run = Run(job="j", procs_per_node=1)
    run.placed(nodes)
    run.to("starting")
    for n in nodes:
        run.node_started(n)
    assert run.state == "running"
    return run


def test_a_job_succeeds_when_every_rank_exits_zero():
    run = running()
    run.node_exited("a", {0: 0})
    run.node_exited("b", {1: 0})
    assert not run.over
    run.node_exited("c", {2: 0})
    assert (run.state, run.exit_code, run.reason) == ("succeeded", 0, None)


def test_the_first_failing_rank_decides_and_the_others_are_stopped():
    run = running()
    run.node_exited("c", {2: 3})
    assert run.stop_others and not run.over
    run.node_exited("a", {0: 143})  # stopped with SIGTERM because of rank 2
    run.node_exited("b", {1: 143})
    assert (run.state, run.exit_code) == ("failed", 3)
    assert run.reason == "rank 2 on c exited with 3"


def test_the_rank_a_node_saw_fail_first_is_the_cause_not_the_lowest():
    run = running(("a",))
    run.node_exited("a", {0: 143, 1: 3}, first=(1, 3))  # rank 0 was stopped because rank 1 failed
    assert (run.state, run.exit_code, run.reason) == ("failed", 3, "rank 1 on a exited with 3")


def test_a_lost_node_fails_the_job_with_the_reason():
    run = running()
    run.node_lost("b", "stream closed")
    assert run.stop_others
    run.node_exited("a", {0: 143})
    run.node_exited("c", {2: 143})
    assert run.state == "failed" and run.reason == "node b lost: stream closed"


def test_cancel_stops_everyone_and_is_not_a_failure():
    run = running(("a", "b"))
    run.cancel()
    run.node_exited("a", {0: 143})
    run.node_exited("b", {1: 143})
    assert (run.state, run.exit_code, run.reason) == ("cancelled", 130, "cancelled by the user")


def test_cancel_before_placement_ends_at_once_and_terminal_states_stick():
    run = Run(job="j")
    run.cancel()
    assert run.state == "cancelled"
    run.to("running")
    run.fail("late")
    assert run.state == "cancelled"
