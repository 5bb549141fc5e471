"""uids.py: a job uid is never one a live process or a leftover file still holds, a
released one comes back, and the range is checked where it is configured."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmd.compute.sandbox.uids import HIGHEST, UidPool
from swarmd.config import ConfigError, load

BASE = 2_000_000_000  # far from any uid this machine or another test uses
SETPRIV = shutil.which("setpriv")
root = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv")
chowns = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to other uids")


@pytest.fixture
def jobs(tmp_path) -> Path:
    d = tmp_path / "jobs"
    d.mkdir()
    return d


@pytest.fixture
def process_as() -> Iterator:
    """Start a process running as a uid (through setpriv, as a rank does); returned once it
    runs as that uid."""
    started: list[subprocess.Popen] = []

    def start(uid: int) -> subprocess.Popen:
        p = subprocess.Popen([SETPRIV, "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--",
                              "/bin/sh", "-c", "echo ready; exec sleep 600"], stdout=subprocess.PIPE, text=True)
        started.append(p)
        assert p.stdout.readline() == "ready\n"  # printed after the drop
        return p

    yield start
    for p in started:
        p.kill()
        p.wait()


def test_lowest_free_uid_first_and_each_only_once(jobs):
    pool = UidPool(BASE, BASE + 9, jobs)
    assert [pool.allocate() for _ in range(3)] == [BASE, BASE + 1, BASE + 2]


def test_release_makes_it_available_again(jobs):
    pool = UidPool(BASE, BASE + 9, jobs)
    a, b = pool.allocate(), pool.allocate()
    pool.release(a)
    assert pool.allocate() == a
    pool.release(BASE + 7)  # never handed out: nothing happens
    assert pool.allocate() == b + 1


@root
def test_a_uid_with_a_live_process_is_skipped_until_it_ends(jobs, process_as):
    stray = process_as(BASE)
    pool = UidPool(BASE, BASE + 9, jobs)
    assert pool.allocate() == BASE + 1
    stray.kill()
    stray.wait()
    assert pool.allocate() == BASE


@chowns
def test_a_uid_owning_a_job_directory_or_a_file_in_one_is_skipped(jobs):
    (jobs / "job-1").mkdir()
    os.chown(jobs / "job-1", BASE, BASE)  # a crashed daemon's job, its checkpoints still there
    (jobs / "job-2").mkdir()
    (jobs / "job-2" / "checkpoint.pt").write_text("x")
    os.chown(jobs / "job-2" / "checkpoint.pt", BASE + 1, BASE + 1)
    pool = UidPool(BASE, BASE + 9, jobs)
    assert pool.allocate() == BASE + 2
    shutil.rmtree(jobs / "job-1")  # collected: the uid is free again
    assert pool.allocate() == BASE


@chowns
def test_a_group_owner_counts_too(jobs):
    (jobs / "job-1").mkdir()
    os.chown(jobs / "job-1", 0, BASE)
    assert UidPool(BASE, BASE + 9, jobs).allocate() == BASE + 1


def test_a_missing_jobs_directory_holds_nothing(tmp_path):
    assert UidPool(BASE, BASE + 9, tmp_path / "not-yet").allocate() == BASE


@chowns
def test_exhaustion_says_who_holds_the_uids(jobs):
    (jobs / "job-1").mkdir()
    os.chown(jobs / "job-1", BASE + 2, BASE + 2)
    pool = UidPool(BASE, BASE + 2, jobs)
    pool.allocate()
    pool.allocate()
    with pytest.raises(RuntimeError) as exc:
        pool.allocate()
    assert str(exc.value) == (
        f"no free job uid in {BASE}-{BASE + 2}: 2 held by jobs running here, 0 by leftover processes, "
        f"1 by files in {jobs}; widen job_uids or wait for finished jobs' directories to be collected")


def test_nobody_and_the_16_bit_minus_one_are_never_handed_out(jobs):
    with pytest.raises(RuntimeError, match="no free job uid in 65534-65535"):
        UidPool(65534, 65535, jobs).allocate()


def test_a_uid_with_a_user_of_that_number_is_skipped(jobs):
    named = sorted(u.pw_uid for u in pwd.getpwall() if 1000 <= u.pw_uid < 65534)
    free = [u for u in named if u + 1 not in named]
    if not free:
        pytest.skip("no user with a uid >= 1000 here")
    got = UidPool(free[0], free[0] + 1, jobs).allocate()
    assert got == free[0] + 1


def test_concurrent_allocations_get_distinct_uids(jobs):
    pool = UidPool(BASE, BASE + 99, jobs)
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.extend(pool.allocate() for _ in range(10))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(BASE, BASE + 80))


@pytest.mark.parametrize("low, high", [(0, 10), (999, 2000), (5000, 4000), (1000, HIGHEST + 1), ("1000", 2000),
                                       (True, 2000), (1000.0, 2000)])
def test_a_bad_range_is_refused(jobs, low, high):
    with pytest.raises(ValueError, match="job uid range"):
        UidPool(low, high, jobs)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "swarmd.toml"
    path.write_text(text)
    return path


def test_the_configured_range_is_checked_and_used(tmp_path, jobs):
    default = load(config_file=write_config(tmp_path, ""), env={})
    assert default.job_uids == (61184, 65519)  # systemd's DynamicUser range
    UidPool(*default.job_uids, jobs)
    c = load(config_file=write_config(tmp_path, f'job_uids = "{BASE}-{BASE + 4}"\n'), env={})
    assert UidPool(*c.job_uids, jobs).allocate() == BASE
    for bad in ('"0-100"', '"65534-65534"', '"70000-60000"', '"61184"', '"a-b"'):
        with pytest.raises(ConfigError, match="job_uids"):
            load(config_file=write_config(tmp_path, f"job_uids = {bad}\n"), env={})
