"""The node's one refusal counter (p2p/rejects.py): each subsystem counts under its own label,
the status total sums them, and a (reason, peer) is logged once an hour whoever refused it."""

from __future__ import annotations

import structlog

from swarmd.metrics import Metrics
from swarmd.p2p.rejects import Rejects


def sample(metrics: Metrics, subsystem: str, reason: str) -> float:
    return metrics.registry.get_sample_value("swarmd_rejected_total",
                                             {"subsystem": subsystem, "reason": reason}) or 0.0


def test_each_subsystem_counts_under_its_own_label_and_the_total_sums_them():
    metrics = Metrics(version="test", peer_id="me")
    rejects = Rejects(metrics)
    gossip, jobs = rejects.of("gossip"), rejects.of("jobs")
    gossip.reject("malformed", "p1", "a sync payload")
    jobs.reject("malformed", "p1", "a job request")
    jobs.reject("submitter", "p2", "not in job_submitters")
    jobs.count("not_holder")
    assert gossip.rejected == {"malformed": 1}
    assert jobs.rejected == {"malformed": 1, "submitter": 1, "not_holder": 1}
    assert rejects.rejected == {"malformed": 2, "submitter": 1, "not_holder": 1}
    assert {s: dict(c) for s, c in rejects.by_subsystem.items()} == {
        "gossip": {"malformed": 1}, "jobs": {"malformed": 1, "submitter": 1, "not_holder": 1}}
    assert (sample(metrics, "gossip", "malformed"), sample(metrics, "jobs", "malformed"),
            sample(metrics, "jobs", "submitter"), sample(metrics, "routing", "malformed")) == (1, 1, 1, 0)
    assert rejects.of("jobs").rejected is jobs.rejected, "the same counts for the same subsystem"


def test_a_flood_is_one_log_line_per_reason_and_peer_whichever_subsystem_refused():
    rejects = Rejects(Metrics(version="test", peer_id="me"))
    with structlog.testing.capture_logs() as logs:
        for _ in range(100):
            rejects.of("gossip").reject("malformed", "p1", "junk")
            rejects.of("jobs").reject("malformed", "p1", "junk")
        rejects.of("jobs").reject("malformed", "p2", "junk")
    lines = [(e["subsystem"], e["peer"]) for e in logs if e["event"] == "rejected input"]
    assert lines == [("gossip", "p1"), ("jobs", "p2")]
    assert rejects.rejected["malformed"] == 201, "every one is counted"
