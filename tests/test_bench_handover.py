"""make bench's handover part runs, and its figures are what they say (few rounds here)."""

from __future__ import annotations

from bench import handover
from swarmd.compute.succession import MAX_RECORD


def test_the_handover_figures_measure_a_real_record(monkeypatch):
    monkeypatch.setattr(handover, "ROUNDS", 5)
    got = handover.figures()
    assert 1000 < got["handover_record_bytes_3_hosts"] < MAX_RECORD
    assert got["handover_bytes_per_transition_all_replicas"] == 3 * got["handover_record_bytes_3_hosts"]
    assert all(got[k] > 0 for k in ("handover_record_sign_p50_ms", "handover_record_verify_p50_ms",
                                    "handover_replica_write_p50_ms", "handover_replica_write_p95_ms"))
