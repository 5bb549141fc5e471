"""A driven job (a Ray job, run.py `driver`): rank 0's exit decides, the rest of the cluster
is stopped after it, and a worker node's exit or loss does not end the job."""

from __future__ import annotations

from swarmd.compute.coordinator.run import Run

HEAD, W1, W2 = "peerHEADHEADhead", "peerW1W1W1W1wwww", "peerW2W2W2W2wwww"


def running() -> Run:
    run = Run(job="j", driver=True)
    run.to("reserving")
    run.placed((HEAD, W1, W2), now=0.0)
    run.to("shipping")
    run.to("starting")
    for n in (HEAD, W1, W2):
        run.node_started(n, now=1.0)
    assert run.state == "running"
    return run


def test_the_drivers_success_stops_the_cluster_and_the_job_succeeds_whatever_the_workers_exit_with():
    run = running()
    run.node_exited(HEAD, {0: 0})
    assert run.stop_others and run.state == "running"  # the workers are told to stop
    run.node_exited(W1, {1: 143})  # SIGTERM'd by the stop
    run.node_exited(W2, {2: 137})
    assert run.state == "succeeded" and run.exit_code == 0 and run.reason is None


def test_the_drivers_failure_is_the_jobs_exit_code():
    run = running()
    run.node_exited(HEAD, {0: 3})
    run.node_exited(W1, {1: 143})
    run.node_exited(W2, {2: 143})
    assert run.state == "failed" and run.exit_code == 3
    assert "the driver (rank 0 on " in run.reason and "exited with 3" in run.reason


def test_a_worker_nodes_exit_or_loss_does_not_end_the_job():
    run = running()
    run.node_exited(W1, {1: 1})
    run.node_lost(W2, "silent for 2 s")
    assert run.state == "running" and not run.stop_others
    run.node_exited(HEAD, {0: 0})
    assert run.state == "succeeded" and run.exit_code == 0


def test_the_drivers_host_lost_fails_the_job():
    run = running()
    run.node_lost(HEAD, "silent for 2 s")
    assert run.stop_others
    run.node_exited(W1, {1: 143})
    run.node_exited(W2, {2: 143})
    assert run.state == "failed" and "host" in run.reason and "lost" in run.reason


def test_a_cancel_of_a_driven_job_cancels_it():
    run = running()
    run.cancel()
    for n, r in ((HEAD, 0), (W1, 1), (W2, 2)):
        run.node_exited(n, {r: 143})
    assert run.state == "cancelled" and run.exit_code == 130


def test_a_worker_host_lost_while_starting_does_not_hold_the_job_in_starting_and_is_named():
    run = Run(job="j", driver=True)
    run.to("reserving")
    run.placed((HEAD, W1, W2), now=0.0)
    run.to("shipping")
    run.to("starting")
    run.node_started(HEAD, now=1.0)
    run.node_lost(W2, "no free block of 100 Ray ports on this host")
    run.node_started(W1, now=1.5)
    assert run.state == "running", "a forward or a cancel sees a running job"
    run.node_exited(HEAD, {0: 1})
    run.node_exited(W1, {1: 143})
    assert run.state == "failed" and "no free block of 100 Ray ports" in run.reason, run.reason
