"""The job store: rows and output survive a restart, terminal states stick, ids by prefix."""

from __future__ import annotations

import stat
import threading
import time

import pytest

from swarmd.compute.coordinator.store import MAX_RECORD, TERMINAL, JobRow, JobStore, RankRow


def row(store: JobStore, state: str = "running", job_id: str | None = None) -> JobRow:
    job = JobRow(id=job_id or store.new_id(), name="train", spec={"cmd": ["python", "x.py"], "nodes": 2},
                 state=state, coordinator="me", submitted_by=1000, created=time.time(), started=None, ended=None,
                 exit_code=None, reason=None, nodes=["a", "b"])
    store.add(job)
    return job


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_rows_and_output_survive_a_restart_in_files_only_the_daemon_reads(tmp_path):
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
    files = [tmp_path / "jobs.sqlite3", tmp_path / "jobs.sqlite3-wal", tmp_path / "jobs" / job.id / "output.log"]
    assert [mode(p) for p in files] == [0o600] * 3
    assert [mode(tmp_path / "jobs"), mode(tmp_path / "jobs" / job.id)] == [0o700, 0o700]


def test_a_follower_reads_on_from_its_cursor_and_by_rank(tmp_path):
    store = JobStore(tmp_path)
    job = row(store)
    assert store.read_log(job.id) == ([], 0), "no output yet"
    store.append_log(job.id, 0, b"one")
    lines, cursor = store.read_log(job.id)
    assert lines == [(0, "one")] and store.read_log(job.id, offset=cursor) == ([], cursor)
    store.append_log(job.id, 1, b"two\twith a tab")
    store.append_log(job.id, 0, "thr\u00e9e".encode())
    assert store.read_log(job.id, offset=cursor)[0] == [(1, "two\twith a tab"), (0, "thr\u00e9e")]
    assert store.read_log(job.id, rank=0)[0] == [(0, "one"), (0, "thr\u00e9e")]
    ones, end = store.read_log(job.id, rank=1, offset=cursor)
    assert ones == [(1, "two\twith a tab")] and end == store.read_log(job.id)[1], "the cursor passes other ranks"
    assert store.read_log("nosuchjob") == ([], 0)


def test_a_half_written_record_waits_and_a_torn_one_is_skipped(tmp_path):
    store = JobStore(tmp_path)
    job = row(store)
    store.append_log(job.id, 0, b"whole")
    log = tmp_path / "jobs" / job.id / "output.log"
    with open(log, "ab") as f:
        f.write(b"1\thalf")
    lines, cursor = store.read_log(job.id)
    assert lines == [(0, "whole")]
    with open(log, "ab") as f:
        f.write(b" done\n\0\0\0\n")
    store.append_log(job.id, 0, b"after")
    assert store.read_log(job.id, offset=cursor)[0] == [(1, "half done"), (0, "after")]


def test_several_lines_and_very_long_lines_become_records(tmp_path):
    store = JobStore(tmp_path)
    job = row(store)
    store.append_log(job.id, 2, b"a\nb\n\nc")
    store.append_log(job.id, 2, b"x" * (MAX_RECORD * 2 + 1))
    lines = store.read_log(job.id)[0]
    assert lines[:4] == [(2, "a"), (2, "b"), (2, ""), (2, "c")]
    assert [len(text) for _, text in lines[4:]] == [MAX_RECORD, MAX_RECORD, 1]


def test_concurrent_appends_keep_every_record_whole_and_each_rank_in_order(tmp_path):
    store = JobStore(tmp_path)
    job = row(store)
    go = threading.Barrier(4)

    def rank(k: int) -> None:
        go.wait()
        for i in range(300):
            store.append_log(job.id, k, b"rank %d line %d " % (k, i) + b"." * 500)

    threads = [threading.Thread(target=rank, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    merged, cursor = [], 0
    while True:
        lines, cursor = store.read_log(job.id, offset=cursor)
        if not lines:
            break
        merged += lines
    assert len(merged) == 1200
    for k in range(4):
        assert [text for r, text in merged if r == k] == [f"rank {k} line {i} " + "." * 500 for i in range(300)]


def test_terminal_states_stick(tmp_path):
    store = JobStore(tmp_path)
    job = row(store)
    store.update(job.id, state="failed", reason="rank 2 exited with 3", exit_code=3)
    after = store.update(job.id, state="running", reason="something later", exit_code=0, ended=5.0)
    assert (after.state, after.reason, after.exit_code, after.ended) == ("failed", "rank 2 exited with 3", 3, 5.0), \
        "only what was still unset is filled in"
    assert store.get(job.id) == after
    for state in TERMINAL:
        other = row(store, state)
        assert store.update(other.id, state="running").state == state


def test_updates_name_what_is_wrong(tmp_path):
    store = JobStore(tmp_path)
    job = row(store)
    with pytest.raises(TypeError, match="cannot set colour"):
        store.update(job.id, colour="blue")
    with pytest.raises(TypeError, match="cannot set id"):
        store.update(job.id, id="other")
    with pytest.raises(ValueError, match="unknown job state 'done'"):
        store.update(job.id, state="done")
    with pytest.raises(ValueError, match="unknown job state 'queued'"):
        row(store, "queued")
    with pytest.raises(KeyError):
        store.update("nosuchjob", state="failed")
    assert store.update(job.id, state="starting", nodes=["b", "a"]).nodes == ["b", "a"]
    assert store.get(job.id).nodes == ["b", "a"] and store.get(job.id).state == "starting"


def test_recover_fails_what_was_going_and_keeps_what_ended(tmp_path):
    store = JobStore(tmp_path)
    going, placing, done = row(store, "running"), row(store, "placing"), row(store, "succeeded")
    store.set_rank(RankRow(job_id=going.id, rank=0, node="a", state="running", exit_code=None))
    store.set_rank(RankRow(job_id=going.id, rank=1, node="b", state="exited", exit_code=0))
    store.close()
    again = JobStore(tmp_path)
    assert again.recover("the daemon restarted") == sorted([going.id, placing.id])
    for job_id in (going.id, placing.id):
        lost = again.get(job_id)
        assert (lost.state, lost.reason) == ("failed", "the daemon restarted") and lost.ended is not None
    assert [(r.state, r.exit_code) for r in again.ranks(going.id)] == [("lost", None), ("exited", 0)]
    assert again.get(done.id) == done
    assert again.recover("again") == []


def test_ids_are_unique_time_ordered_and_found_by_prefix(tmp_path):
    store = JobStore(tmp_path)
    ids = [store.new_id() for _ in range(200)]
    assert len(set(ids)) == 200 and all(len(i) == 12 and i.isalnum() and i.islower() for i in ids)
    assert sorted(ids) == ids, "time-ordered, even within a millisecond"
    first, second = row(store), row(store)
    for job_id in ("abcd0000aa", "abcd0000bb"):
        row(store, job_id=job_id)
    assert store.get("abcd0000a").id == "abcd0000aa"
    assert store.get("ABCD0000B").id == "abcd0000bb"
    with pytest.raises(ValueError, match="'abcd' matches more than one job; give more of the id"):
        store.get("abcd")
    assert store.get("abc") is None, "prefixes shorter than 4 are not searched"
    assert store.get("abc%") is None and store.get("ab__") is None, "no SQL wildcards"
    assert store.get(first.id) == first
    assert [j.id for j in store.list()][-2:] == [second.id, first.id], "newest first"
    assert len(store.list(limit=3)) == 3


def test_a_jobs_log_keeps_its_tail_under_the_cap_and_readers_skip_the_trimmed_head(tmp_path):
    store = JobStore(tmp_path, log_cap=4096)
    job = row(store)
    for i in range(1000):
        store.append_log(job.id, 0, b"line %04d" % i)
    size = (tmp_path / "jobs" / job.id / "output.log").stat().st_size
    assert size <= 4096, "the log never grows past its cap"
    lines, end = store.read_log(job.id)
    assert lines[-1] == (0, "line 0999") and lines[0][1].startswith("line ") and len(lines) < 1000
    numbers = [int(text.split()[1]) for _, text in lines]
    assert numbers == list(range(numbers[0], 1000)), "whole records, the newest, in order"
    store.append_log(job.id, 0, b"after")
    assert store.read_log(job.id, offset=end)[0] == [(0, "after")], "a follower's cursor stays good"


def test_prune_forgets_jobs_that_ended_before_a_time_and_keeps_the_rest(tmp_path):
    store = JobStore(tmp_path)
    old, recent, going = row(store, "succeeded"), row(store, "failed"), row(store, "running")
    store.update(old.id, ended=1000.0)
    store.update(recent.id, ended=time.time())
    for job in (old, recent, going):
        store.append_log(job.id, 0, b"x")
        store.set_rank(RankRow(job_id=job.id, rank=0, node="a", state="exited", exit_code=0))
    assert store.prune(time.time() - 60) == [old.id]
    assert store.get(old.id) is None and store.ranks(old.id) == [] and not (tmp_path / "jobs" / old.id).exists()
    assert store.get(recent.id) is not None and store.get(going.id) is not None


def test_attempts_survive_a_restart_and_the_one_going_is_ended_by_recover(tmp_path):
    from swarmd.compute.coordinator.run import Attempt

    store = JobStore(tmp_path)
    done, going = row(store, "succeeded"), row(store, "restarting")
    first = Attempt(n=1, nodes=("a", "b", "c"), started=10.0, ended=20.0, why="host bbbbbbbb lost (dead)",
                    detected=19.5, placed=9.0, reserved=9.5)
    second = Attempt(n=2, nodes=("a", "c", "d"), started=23.0, ended=50.0, resumed_from="epoch-4.pt",
                     reserved=21.0, checkpoints_ready=22.0)
    for a in (first, second):
        store.set_attempt(done.id, a.to_dict())
    store.set_attempt(going.id, Attempt(n=1, nodes=("a",), started=5.0).to_dict())
    store.close()
    again = JobStore(tmp_path)
    got = again.attempts(done.id)
    assert [a["n"] for a in got] == [1, 2]
    assert got[0] | {"resumed_from": None} == {k: v for k, v in first.to_dict().items()}
    assert (got[1]["resumed_from"], got[1]["checkpoints_ready"], got[1]["nodes"]) == ("epoch-4.pt", 22.0, ["a", "c", "d"])
    again.recover("the daemon restarted")
    lost = again.attempts(going.id)[0]
    assert lost["why"] == "the daemon restarted" and lost["ended"] is not None
    assert again.attempts(done.id) == got  # a finished job's history is kept as it was
    again.update(done.id, ended=1.0)
    assert again.prune(ended_before=time.time()) and again.attempts(done.id) == []


def test_an_attempts_groups_outlive_its_rewrites_and_a_restart_and_a_store_from_before_groups_opens(tmp_path):
    import sqlite3

    from swarmd.compute.coordinator.run import Attempt

    old = sqlite3.connect(tmp_path / "jobs.sqlite3")  # the attempts table as it was before latency groups
    old.execute("CREATE TABLE attempts (job_id TEXT NOT NULL, n INTEGER NOT NULL, nodes TEXT NOT NULL, started REAL, "
                "ended REAL, why TEXT, resumed_from TEXT, times TEXT NOT NULL, PRIMARY KEY (job_id, n))")
    old.execute("INSERT INTO attempts VALUES ('j0', 1, '[\"a\"]', 1.0, 2.0, NULL, NULL, '{}')")
    old.commit()
    old.close()
    store = JobStore(tmp_path)
    assert store.attempts("j0")[0]["nodes"] == ["a"] and store.groups("j0") is None
    job = row(store)
    grouping = {"groups": [[0], [1]], "max_rtt_ms": 30.0, "nodes": ["a", "b"], "rtt_ms": [[None, 150.0], [150.0, None]]}
    first = Attempt(n=1, nodes=("a", "b"), placed=1.0)
    store.set_attempt(job.id, first.to_dict())
    store.set_groups(job.id, 1, grouping)
    first.ended, first.why = 5.0, "host b lost"
    store.set_attempt(job.id, first.to_dict())  # the attempt written again as it ends
    store.set_attempt(job.id, Attempt(n=2, nodes=("a", "c"), placed=6.0).to_dict())  # a restart without groups
    store.close()
    again = JobStore(tmp_path)
    assert again.groups(job.id) == grouping and again.attempts(job.id)[0]["why"] == "host b lost"
