"""The job store: rows and output survive a restart, terminal states stick, ids by prefix."""

from __future__ import annotations

import stat
import time

import pytest

from swarmd.compute.store import JobRow, JobStore, RankRow


def row(store: JobStore, state: str = "running") -> JobRow:
    job = JobRow(id=store.new_id(), name="train", spec={"cmd": ["python", "x.py"]}, state=state, coordinator="me",
                 submitted_by=1000, created=time.time(), started=None, ended=None, exit_code=None, reason=None,
                 nodes=["a", "b"])
    store.add(job)
    return job


def test_rows_and_output_survive_a_restart(tmp_path):
    store = JobStore(tmp_path)
    job = row(store, "succeeded")
    store.set_rank(RankRow(job_id=job.id, rank=0, node="a", state="exited", exit_code=0))
    store.append_log(job.id, 1, b"from one")
    store.append_log(job.id, 0, b"from zero")
    store.close()
    again = JobStore(tmp_path)
    assert again.get(job.id) == job
    assert again.ranks(job.id) == [RankRow(job_id=job.id, rank=0, node="a", state="exited", exit_code=0)]
    assert again.read_log(job.id)[0] == [(1, "from one"), (0, "from zero")]
    assert stat.S_IMODE((tmp_path / "jobs.sqlite3").stat().st_mode) == 0o600


def test_a_follower_reads_on_from_its_cursor_and_by_rank(tmp_path):
    store = JobStore(tmp_path)
    job = row(store)
    store.append_log(job.id, 0, b"one")
    lines, cursor = store.read_log(job.id)
    store.append_log(job.id, 1, b"two\twith a tab")
    store.append_log(job.id, 0, b"three")
    assert store.read_log(job.id, offset=cursor)[0] == [(1, "two\twith a tab"), (0, "three")]
    assert store.read_log(job.id, rank=0)[0] == [(0, "one"), (0, "three")]
    assert store.read_log("nosuchjob") == ([], 0)


def test_terminal_states_stick(tmp_path):
    store = JobStore(tmp_path)
    job = row(store)
    store.update(job.id, state="failed", reason="rank 2 exited with 3", exit_code=3, ended=1.0)
    after = store.update(job.id, state="running", reason="something later", exit_code=0)
    assert (after.state, after.reason, after.exit_code) == ("failed", "rank 2 exited with 3", 3)
    with pytest.raises(TypeError):
        store.update(job.id, colour="blue")


def test_recover_fails_what_was_going_and_keeps_what_ended(tmp_path):
    store = JobStore(tmp_path)
    going, done = row(store, "running"), row(store, "succeeded")
    store.close()
    again = JobStore(tmp_path)
    assert again.recover("the daemon restarted") == [going.id]
    assert again.get(going.id).state == "failed" and again.get(going.id).reason == "the daemon restarted"
    assert again.get(done.id).state == "succeeded"


def test_ids_are_unique_time_ordered_and_found_by_prefix(tmp_path):
    store = JobStore(tmp_path)
    ids = [store.new_id() for _ in range(200)]
    assert len(set(ids)) == 200 and all(len(i) == 12 for i in ids)
    assert sorted(ids) == ids, "time-ordered, even within a millisecond"
    first, second = row(store), row(store)
    for job_id in ("abcd0000aa", "abcd0000bb"):
        store.add(JobRow(id=job_id, name=None, spec={}, state="running", coordinator="me", submitted_by=0,
                         created=time.time(), started=None, ended=None, exit_code=None, reason=None, nodes=[]))
    assert store.get("abcd0000a").id == "abcd0000aa"
    with pytest.raises(ValueError, match="more than one job"):
        store.get("abcd")
    assert store.get("abc") is None, "prefixes shorter than 4 are not searched"
    assert store.get(first.id).id == first.id
    assert [j.id for j in store.list()][-2:] == [second.id, first.id], "newest first"
