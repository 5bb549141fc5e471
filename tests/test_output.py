"""Rank output, bounded: the on-disk log keeps its tail, the stream's queue drops and counts."""

from __future__ import annotations

import os

import pytest

from swarmd.compute import output
from swarmd.compute.output import RankOutput


def test_a_full_queue_drops_lines_from_the_stream_only_and_says_how_many(tmp_path):
    out = RankOutput(tmp_path / "output.log", queue_bytes=125 * (8 + output.LINE_OVERHEAD))
    for i in range(500):
        out.add(i % 2, b"%08d" % i)  # 8 bytes a line and its overhead: 125 fit
    batch, dropped = out.take(10_000)
    assert len(batch) == 125 and batch[0] == [0, "00000000"]
    assert dropped == [[0, 187], [1, 188]] and out.dropped_total == 375
    assert out.take(10_000) == ([], []), "each count is handed on once"
    out.flush()
    assert (tmp_path / "output.log").read_bytes().count(b"\n") == 500, "the log has every line"


def test_a_job_printing_empty_lines_fills_the_queue_and_is_taken_in_bounded_batches(tmp_path):
    out = RankOutput(tmp_path / "output.log", queue_bytes=output.QUEUE_BYTES)
    for _ in range(100_000):
        out.add(0, b"")
    queued = output.QUEUE_BYTES // output.LINE_OVERHEAD
    assert out.dropped_total == 100_000 - queued, "an empty line costs its overhead, so the queue fills"
    batch, dropped = out.take(output.QUEUE_BYTES * 10)
    assert len(batch) == output.MAX_BATCH_LINES and dropped == [[0, 100_000 - queued]]
    taken = len(batch)
    while out.pending:
        batch, _ = out.take(output.QUEUE_BYTES * 10)
        assert 0 < len(batch) <= output.MAX_BATCH_LINES
        taken += len(batch)
    assert taken == queued
    out.add(0, b"honest")
    assert out.take(1000) == ([[0, "honest"]], []), "drained, the queue takes lines again"


def test_the_queue_takes_lines_again_once_drained(tmp_path):
    out = RankOutput(tmp_path / "output.log", queue_bytes=100)
    for _ in range(20):
        out.add(0, b"x" * 10)
    out.take(1000)
    out.add(0, b"again")
    assert out.take(1000) == ([[0, "again"]], [])


def test_the_log_keeps_its_newest_records_under_the_cap(tmp_path):
    log = tmp_path / "output.log"
    dropped = sum(output.append(log, output.records(0, b"%05d" % i), cap=1024) for i in range(1000))
    data = log.read_bytes()
    assert len(data) <= 1024 and data.endswith(b"0\t00999\n") and data.startswith(b"0\t")
    assert dropped == 1000 * 8 - len(data)


def test_the_log_is_never_written_through_a_link(tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / "output.log")
    with pytest.raises(OSError):
        output.append(tmp_path / "output.log", b"0\tx\n")
    assert target.read_bytes() == b"keep"
    out = RankOutput(tmp_path / "output.log")
    out.add(0, b"x")
    out.flush()
    assert out.log_error and target.read_bytes() == b"keep", "the job goes on; the host's copy is lost"
