"""uids.py: a job uid is never one a live process or a leftover file still holds, nor one
systemd holds for a DynamicUser service (its lock in /run/systemd/dynamic-uid, taken here
by another process exactly as systemd takes it: flock on the uid's file), a handed-out uid
holds that lock until released, a released one comes back, and the range is checked where
it is configured."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
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
def locks(tmp_path) -> Path:
    """A stand-in for /run/systemd/dynamic-uid: its parent exists, as /run/systemd does on
    a systemd host, so the pool makes it as systemd would."""
    run = tmp_path / "run-systemd"
    run.mkdir()
    return run / "dynamic-uid"


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


def test_lowest_free_uid_first_and_each_only_once(jobs, locks):
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks)
    assert [pool.allocate() for _ in range(3)] == [BASE, BASE + 1, BASE + 2]


def test_release_makes_it_available_again(jobs, locks):
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks)
    a, b = pool.allocate(), pool.allocate()
    pool.release(a)
    assert pool.allocate() == a
    pool.release(BASE + 7)  # never handed out: nothing happens
    assert pool.allocate() == b + 1


@root
def test_a_uid_with_a_live_process_is_skipped_until_it_ends(jobs, process_as, locks):
    stray = process_as(BASE)
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks)
    assert pool.allocate() == BASE + 1
    stray.kill()
    stray.wait()
    assert pool.allocate() == BASE


@chowns
def test_a_uid_owning_a_job_directory_or_a_file_in_one_is_skipped(jobs, locks):
    (jobs / "job-1").mkdir()
    os.chown(jobs / "job-1", BASE, BASE)  # a crashed daemon's job, its checkpoints still there
    (jobs / "job-2").mkdir()
    (jobs / "job-2" / "checkpoint.pt").write_text("x")
    os.chown(jobs / "job-2" / "checkpoint.pt", BASE + 1, BASE + 1)
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks)
    assert pool.allocate() == BASE + 2
    shutil.rmtree(jobs / "job-1")  # collected: the uid is free again
    assert pool.allocate() == BASE


@chowns
def test_a_group_owner_counts_too(jobs, locks):
    (jobs / "job-1").mkdir()
    os.chown(jobs / "job-1", 0, BASE)
    assert UidPool(BASE, BASE + 9, jobs, locks=locks).allocate() == BASE + 1


def test_a_missing_jobs_directory_holds_nothing(tmp_path, locks):
    assert UidPool(BASE, BASE + 9, tmp_path / "not-yet", locks=locks).allocate() == BASE


@chowns
def test_exhaustion_says_who_holds_the_uids(jobs, locks):
    (jobs / "job-1").mkdir()
    os.chown(jobs / "job-1", BASE + 2, BASE + 2)
    pool = UidPool(BASE, BASE + 2, jobs, locks=locks)
    pool.allocate()
    pool.allocate()
    with pytest.raises(RuntimeError) as exc:
        pool.allocate()
    assert str(exc.value) == (
        f"no free job uid in {BASE}-{BASE + 2}: 2 held by jobs running here, 0 by leftover processes, "
        f"1 by files in {jobs}; widen job_uids or wait for finished jobs' directories to be collected")


def test_nobody_and_the_16_bit_minus_one_are_never_handed_out(jobs, locks):
    with pytest.raises(RuntimeError, match="no free job uid in 65534-65535"):
        UidPool(65534, 65535, jobs, locks=locks).allocate()


def test_a_uid_with_a_user_of_that_number_is_skipped(jobs, locks):
    named = sorted(u.pw_uid for u in pwd.getpwall() if 1000 <= u.pw_uid < 65534)
    free = [u for u in named if u + 1 not in named]
    if not free:
        pytest.skip("no user with a uid >= 1000 here")
    got = UidPool(free[0], free[0] + 1, jobs, locks=locks).allocate()
    assert got == free[0] + 1


def test_concurrent_allocations_get_distinct_uids(jobs, locks):
    pool = UidPool(BASE, BASE + 99, jobs, locks=locks)
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.extend(pool.allocate() for _ in range(10))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(BASE, BASE + 80))


SYSTEMD_PICKS = """
import fcntl, os, sys
# what systemd's pick_uid does for a candidate (src/core/dynamic-user.c)
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY, 0o600)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    print("busy", flush=True)
    sys.exit(0)
os.pwrite(fd, b"some-service\\n", 0)
print("locked", flush=True)
sys.stdin.read()  # held until the test closes our stdin (the service stops)
"""


@pytest.fixture
def systemd() -> Iterator:
    """Another process taking a uid's lock as systemd does for a DynamicUser service:
    `systemd(path)` returns "locked" (it holds it until the test ends) or "busy"."""
    started: list[subprocess.Popen] = []

    def pick(path: Path) -> str:
        p = subprocess.Popen([sys.executable, "-c", SYSTEMD_PICKS, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        started.append(p)
        return p.stdout.readline().strip()

    yield pick
    for p in started:
        p.stdin.close()
        p.wait()


def test_a_handed_out_uid_holds_systemds_lock_until_released(jobs, locks, systemd):
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks)
    uid = pool.allocate()
    lock = locks / str(uid)
    assert stat.S_IMODE(locks.stat().st_mode) == 0o755  # made as systemd makes it
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    assert lock.read_text() == "swarmd-job\n"
    assert pool.systemd == pool.coordination() == f"uids locked in {locks}, as systemd's DynamicUser does"
    assert systemd(lock) == "busy"  # systemd would try another uid
    pool.release(uid)
    assert not lock.exists()  # unlinked, as systemd unlinks its own when a service stops
    assert systemd(lock) == "locked"


def test_a_uid_systemd_holds_is_skipped_though_no_process_or_file_shows_it(jobs, locks, systemd):
    locks.mkdir()
    assert systemd(locks / str(BASE)) == "locked"  # a DynamicUser service starting: no process of it yet
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks)
    assert pool.allocate() == BASE + 1
    assert (locks / str(BASE)).read_text() == "some-service\n"  # not touched


@root
def test_a_released_uid_keeps_its_lock_while_a_process_of_it_remains(jobs, locks, systemd, process_as):
    """A job without a cgroup may leave a stray: systemd must not give its uid to a service."""
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks)
    uid = pool.allocate()
    stray = process_as(uid)
    pool.release(uid)
    assert systemd(locks / str(uid)) == "busy"
    stray.kill()
    stray.wait()
    assert pool.allocate() == uid  # gone: the pool takes it again, still locked
    assert systemd(locks / str(uid)) == "busy"
    pool.release(uid)
    assert systemd(locks / str(uid)) == "locked"


def test_a_lock_file_nobody_holds_any_more_is_taken(jobs, locks):
    locks.mkdir()
    (locks / str(BASE)).write_text("crashed-service\n")  # its holder died without unlinking it
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks)
    assert pool.allocate() == BASE
    assert (locks / str(BASE)).read_text() == "swarmd-job\n"


def test_exhaustion_counts_uids_systemd_holds(jobs, locks, systemd):
    locks.mkdir()
    assert systemd(locks / str(BASE + 1)) == "locked"
    pool = UidPool(BASE, BASE + 1, jobs, locks=locks)
    assert pool.allocate() == BASE
    with pytest.raises(RuntimeError) as exc:
        pool.allocate()
    assert str(exc.value) == (
        f"no free job uid in {BASE}-{BASE + 1}: 1 held by jobs running here, 0 by leftover processes, "
        f"0 by files in {jobs}, 1 locked in {locks} (systemd's DynamicUser services); "
        "widen job_uids or wait for finished jobs' directories to be collected")


def test_two_pools_on_one_host_never_share_a_uid(jobs, locks):
    """Two daemons (or a daemon and its restarted self) with overlapping ranges: the locks,
    not each pool's memory, keep their uids apart."""
    a = UidPool(BASE, BASE + 9, jobs, locks=locks)
    b = UidPool(BASE, BASE + 9, jobs, locks=locks)
    assert [a.allocate(), b.allocate(), a.allocate()] == [BASE, BASE + 1, BASE + 2]
    a.release(BASE)
    assert b.allocate() == BASE


READ_ONLY = """
import sys
from pathlib import Path
from swarmd.compute.sandbox.uids import UidPool
pool = UidPool(int(sys.argv[1]), int(sys.argv[1]) + 9, Path(sys.argv[2]), locks=Path(sys.argv[3]))
print(pool.allocate(), pool.allocate(), flush=True)
print(pool.systemd, flush=True)
sys.stdin.read()
"""


@root
def test_a_read_only_lock_directory_still_honours_and_holds_existing_locks(jobs, locks, systemd):
    """/run under ProtectSystem=strict: systemd's held locks are still seen, an existing
    unheld lock file is held read-only; a uid with no lock file cannot be protected."""
    locks.mkdir()
    assert systemd(locks / str(BASE)) == "locked"
    (locks / str(BASE + 1)).write_text("stale\n")
    inner = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f'mount --bind -o ro "$1" "$1" && exec "$2" -c "$3" {BASE} "$4" "$1"', "sh",
         str(locks), sys.executable, READ_ONLY, str(jobs)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    try:
        assert inner.stdout.readline().split() == [str(BASE + 1), str(BASE + 2)]
        assert inner.stdout.readline().strip() == (
            f"{locks} is read-only here (Read-only file system): systemd may hand a job's uid to a DynamicUser "
            "service")
        assert systemd(locks / str(BASE + 1)) == "busy"  # held, read-only
        assert (locks / str(BASE + 1)).read_text() == "stale\n"
    finally:
        inner.stdin.close()
        inner.wait()


def test_without_systemd_uids_are_handed_out_unlocked(jobs, tmp_path):
    locks = tmp_path / "no-systemd" / "dynamic-uid"
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks)
    assert pool.allocate() == BASE
    assert not locks.parent.exists()  # nothing made where systemd is not
    assert pool.coordination() == f"no {locks.parent} (no systemd here): no DynamicUser uid to avoid"
    assert pool.systemd == f"no {locks.parent} (no systemd here): no DynamicUser uid to avoid"
    pool.release(BASE)
    assert pool.allocate() == BASE


def test_a_link_where_a_lock_belongs_is_not_followed(jobs, locks, tmp_path):
    locks.mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("x")
    (locks / str(BASE)).symlink_to(target)
    assert UidPool(BASE, BASE + 9, jobs, locks=locks).allocate() == BASE + 1
    assert target.read_text() == "x"


@pytest.mark.parametrize("low, high", [(0, 10), (999, 2000), (5000, 4000), (1000, HIGHEST + 1), ("1000", 2000),
                                       (True, 2000), (1000.0, 2000)])
def test_a_bad_range_is_refused(jobs, low, high):
    with pytest.raises(ValueError, match="job uid range"):
        UidPool(low, high, jobs)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "swarmd.toml"
    path.write_text(text)
    return path


def test_the_configured_range_is_checked_and_used(tmp_path, jobs, locks):
    default = load(config_file=write_config(tmp_path, ""), env={})
    assert default.job_uids == (61184, 65519)  # systemd's DynamicUser range
    UidPool(*default.job_uids, jobs)
    c = load(config_file=write_config(tmp_path, f'job_uids = "{BASE}-{BASE + 4}"\n'), env={})
    assert UidPool(*c.job_uids, jobs, locks=locks).allocate() == BASE
    for bad in ('"0-100"', '"65534-65534"', '"70000-60000"', '"61184"', '"a-b"'):
        with pytest.raises(ConfigError, match="job_uids"):
            load(config_file=write_config(tmp_path, f"job_uids = {bad}\n"), env={})
