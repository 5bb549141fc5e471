"""Rank output, bounded: the on-disk log keeps its tail, the stream's queue drops and counts."""

from __future__ import annotations

import os

import pytest

from swarmd.compute import output
from swarmd.compute.output import RankOutput


def test_a_full_queue_drops_lines_from_the_stream_only_and_says_how_many(tmp_path):
    out = RankOutput(tmp_path / "output.log", queue_bytes=1000)
    for i in range(500):
        out.add(i % 2, b"%08d" % i)  # 8 bytes a line: 125 fit
    batch, dropped = out.take(10_000)
    assert len(batch) == 125 and batch[0] == [0, "00000000"]
    assert dropped == [[0, 187], [1, 188]] and out.dropped_total == 375
    assert out.take(10_000) == ([], []), "each count is handed on once"
    out.flush()
    assert (tmp_path / "output.log").read_bytes().count(b"\n") == 500, "the log has every line"


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
