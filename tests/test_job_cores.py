"""The sans-IO cores behind jobs: a host's ledger, gang reservation, and a job's life."""

from __future__ import annotations

import pytest

from swarmd.compute.coordinator.gang import Commit, Gang, Release
from swarmd.compute.ledger import Cancel, Grant, Ledger, Refusal
from swarmd.compute.coordinator.run import Run

# --- a host's ledger ---------------------------------------------------------------------


def test_a_host_refuses_work_beyond_its_slots_and_gpus():
    ledger = Ledger(2, gpus=(0, 1, 2), max_unstarted=2)
    assert ledger.reserve(0, "a", "c", gpus=2, ranks=1, lease=30) == Grant("a", (0, 1))
    assert ledger.reserve(0, "b", "c", gpus=2, ranks=1, lease=30) == Refusal("1 free GPU(s), 2 asked")
    assert ledger.reserve(0, "b", "c", gpus=1, ranks=1, lease=30) == Grant("b", (2,))
    assert ledger.reserve(0, "x", "c", gpus=0, ranks=1, lease=30) == Refusal("no free job slot (all 2 in use)")
    assert ledger.slots_free == 0 and ledger.gpus_free == ()


def test_an_uncommitted_lease_lapses_and_a_commit_never_started_lapses_at_its_start_deadline():
    ledger = Ledger(1)
    ledger.reserve(0, "a", "c", gpus=0, ranks=1, lease=30)
    assert ledger.next_deadline() == 30
    assert ledger.expire(29.9) == [] and ledger.expire(30) == [("c", "a")]
    assert isinstance(ledger.commit(31, "a", "c", 600), Refusal), "a lapsed lease cannot be committed"
    ledger.reserve(40, "b", "c", gpus=0, ranks=1, lease=30)
    assert ledger.commit(41, "b", "c", 600) == Grant("b", ())
    assert ledger.expire(70) == [] and ledger.holds("b", "c"), "the lease no longer counts once committed"
    assert ledger.commit(100, "b", "c", 600) == Grant("b", ()) and ledger.next_deadline() == 641, \
        "a retried commit does not push the start deadline"
    assert ledger.release("b", "c") is True and ledger.slots_free == 1


def test_a_member_reserving_and_committing_fresh_ids_never_started_cannot_keep_the_slots():
    """Finding 9: reserve again to renew, commit and never start, take every slot with fresh
    ids: each lapses, and a host can cap how many a coordinator holds unstarted."""
    ledger = Ledger(4, max_unstarted=2)
    assert Ledger(4).max_unstarted == 4, "by default a coordinator may hold every slot for jobs it starts"
    assert ledger.reserve(0, "a", "hog", gpus=0, ranks=1, lease=10) == Grant("a", ())
    assert ledger.reserve(9, "a", "hog", gpus=0, ranks=1, lease=10) == Grant("a", ())
    assert ledger.next_deadline() == 10, "reserving again does not renew the lease"
    assert ledger.commit(9, "a", "hog", 660) == Grant("a", ())
    assert ledger.reserve(9, "b", "hog", gpus=0, ranks=1, lease=10) == Grant("b", ())
    assert ledger.commit(9, "b", "hog", 660) == Grant("b", ())
    refused = ledger.reserve(9, "c", "hog", gpus=0, ranks=1, lease=10)
    assert isinstance(refused, Refusal) and "have not started" in refused.reason and refused.code == ""
    for job in ("x", "y"):  # honest coordinators still find slots
        assert ledger.reserve(9, job, "honest", gpus=0, ranks=1, lease=10) == Grant(job, ())
        assert ledger.commit(9, job, "honest", 660) == Grant(job, ())
        assert ledger.start(job, "honest", 1) == Grant(job, ())
    assert ledger.expire(669) == [("hog", "a"), ("hog", "b")], "commits never started lapse"
    assert ledger.slots_free == 2 and ledger.state_of("x", "honest") == "running"
    assert ledger.expire(1e9) == [], "running holds never lapse"


def test_one_coordinator_may_hold_every_slot_for_jobs_submitted_at_once():
    """Two `jobs run` at the same moment from one user on a 2-slot host: both are placed."""
    ledger = Ledger(2)
    for job in ("a", "b"):
        assert ledger.reserve(0, job, "coord", gpus=0, ranks=1, lease=10) == Grant(job, ())
    assert ledger.slots_free == 0


def test_a_retried_reservation_is_the_same_grant():
    ledger = Ledger(2, gpus=(0, 1))
    first = ledger.reserve(0, "a", "coord", gpus=1, ranks=1, lease=10)
    assert ledger.reserve(5, "a", "coord", gpus=1, ranks=1, lease=10) == first
    assert ledger.slots_free == 1


def test_an_id_is_bound_to_its_coordinator_and_another_members_copy_is_its_own():
    """Finding 8: a member that learned coordinator C's id holds only (member, id): it
    cannot commit, start, release or cancel C's, and reserving it does not block C."""
    ledger = Ledger(4, gpus=(0, 1))
    assert ledger.reserve(0, "j", "mallory", gpus=1, ranks=1, lease=10) == Grant("j", (0,))
    assert ledger.reserve(0, "j", "coord", gpus=1, ranks=1, lease=10) == Grant("j", (1,)), \
        "C is not refused as 'held for another coordinator'"
    assert ledger.commit(1, "j", "coord", 660) == Grant("j", (1,))
    assert ledger.release("j", "mallory") is True and ledger.state_of("j", "coord") == "committed"
    for move in (lambda: ledger.start("j", "mallory", 1), lambda: ledger.release("j", "mallory"),
                 lambda: ledger.commit(1, "j", "mallory", 660), lambda: ledger.check_holder("j", "mallory")):
        assert move().code == "not_holder"
    assert ledger.start("j", "coord", 1) == Grant("j", (1,))
    assert ledger.finish("j", "mallory") is False and ledger.state_of("j", "coord") == "running"


def test_start_needs_the_same_coordinators_commit_and_at_most_the_ranks_reserved():
    ledger = Ledger(2)
    ledger.reserve(0, "a", "coord", gpus=0, ranks=2, lease=10)
    assert ledger.start("a", "coord", 2).code == "not_committed"
    assert ledger.start("zz", "coord", 1).code == "no_reservation"
    ledger.commit(1, "a", "coord", 660)
    assert ledger.start("a", "intruder", 1).code == "not_holder"
    assert ledger.start("a", "coord", 3) == Refusal("job a reserved 2 rank(s) here, 3 asked", "ranks")
    assert ledger.start("a", "coord", 2) == Grant("a", ())
    assert ledger.start("a", "coord", 2).code == "state", "one start per hold"


def test_only_the_holder_releases_and_a_running_hold_is_cancelled_not_freed():
    ledger = Ledger(1)
    ledger.reserve(0, "a", "coord", gpus=0, ranks=1, lease=10)
    assert ledger.release("a", "intruder").code == "not_holder" and ledger.holds("a", "coord")
    assert ledger.check_holder("a", "intruder").code == "not_holder"
    assert ledger.check_holder("a", "coord") is None and ledger.check_holder("zz", "intruder") is None
    ledger.commit(1, "a", "coord", 660)
    ledger.start("a", "coord", 1)
    assert ledger.expire(1e9) == [] and ledger.state_of("a", "coord") == "running", "nothing lapses under running ranks"
    assert ledger.release("a", "coord") == Cancel("a") and ledger.slots_free == 0, "its ranks still use the slot"
    assert ledger.finish("a", "coord") and ledger.slots_free == 1 and not ledger.finish("a", "coord")
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


def running(nodes=("a", "b", "c"), **kw) -> Run:
    run = Run(job="j", procs_per_node=1, **kw)
    run.to("reserving")
    run.placed(nodes)
    run.to("shipping")
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


def test_a_rank_the_kernel_killed_for_memory_fails_the_job_saying_so():
    run = running()
    run.node_exited("b", {1: 137}, first=(1, 137), oom=(1,), memory_limit=4 << 30)
    run.node_exited("a", {0: 143})
    run.node_exited("c", {2: 143})
    assert (run.state, run.exit_code) == ("failed", 137)
    assert run.reason == "rank 1 on b: out of memory (limit 4 GiB)"


def test_a_rank_killed_by_a_signal_while_another_process_ran_out_of_memory_is_not_blamed_on_memory():
    run = running()
    run.node_exited("b", {1: 137}, first=(1, 137), oom=())
    assert run.reason == "rank 1 on b exited with 137"


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
    assert run.state == "failed" and run.reason == "host b lost: stream closed"


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
