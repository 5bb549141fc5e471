"""uids.py: a job uid is never one a live process, a leftover file (in the jobs directory or
where a job without bubblewrap writes: /tmp, /dev/shm...) or a SysV IPC object still holds,
nor one systemd holds for a DynamicUser service (its lock in /run/systemd/dynamic-uid, taken
here by another process exactly as systemd takes it: flock on the uid's file), a handed-out
uid holds that lock until released, a released one comes back only after the others had
their turn (remembered across a restart), and the range is checked where it is configured."""

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

from swarmd.compute.host.sandbox import uids as uidsmod
from swarmd.compute.host.sandbox.uids import HIGHEST, SCRATCH, UidPool, ipc_owners
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


def test_a_released_uid_comes_back_only_after_the_others_had_their_turn(jobs, locks):
    """Least recently used first: what a job left where no scan looks is reached by a later
    job only once the whole range went round (issue 23, finding 2)."""
    pool = UidPool(BASE, BASE + 2, jobs, locks=locks)
    a, b = pool.allocate(), pool.allocate()
    pool.release(a)
    c = pool.allocate()
    assert (a, b, c) == (BASE, BASE + 1, BASE + 2), "one never handed out before a released one"
    pool.release(c)
    pool.release(b)
    assert [pool.allocate() for _ in range(3)] == [a, c, b], "then the least recently handed out"
    pool.release(BASE + 7)  # never handed out: nothing happens


def test_the_rotation_survives_a_restart(jobs, locks, tmp_path):
    """A restarted daemon went back to the lowest uid: the one the last job had."""
    history = tmp_path / "state" / "job-uids"
    history.parent.mkdir()
    first = UidPool(BASE, BASE + 2, jobs, locks=locks, history=history)
    got = [first.allocate(), first.allocate()]
    for uid in got:
        first.release(uid)
    assert history.read_text() == f"{BASE}\n{BASE + 1}\n"
    assert first.rotation == f"least recently used first, remembered in {history}"
    second = UidPool(BASE, BASE + 2, jobs, locks=locks, history=history)  # the daemon's next life
    assert [second.allocate(), second.allocate(), second.allocate()] == [BASE + 2, BASE, BASE + 1]


def test_a_history_with_foreign_lines_keeps_the_uids_of_the_range(jobs, locks, tmp_path):
    history = tmp_path / "job-uids"
    history.write_text(f"{BASE}\nnot-a-uid\n{BASE + 50}\n-3\n{BASE + 1}\n{BASE}\n")  # the range was wider once
    pool = UidPool(BASE, BASE + 2, jobs, locks=locks, history=history)
    assert [pool.allocate() for _ in range(3)] == [BASE + 2, BASE + 1, BASE]


def test_an_unwritable_history_leaves_the_rotation_in_memory(jobs, locks, tmp_path):
    history = tmp_path / "missing-dir" / "job-uids"
    pool = UidPool(BASE, BASE + 2, jobs, locks=locks, history=history)
    assert pool.allocate() == BASE
    assert pool.rotation.startswith(f"least recently used first, in memory only: {history}")
    pool.release(BASE)
    assert pool.allocate() == BASE + 1


def test_the_history_keeps_the_latest_uids_only(jobs, locks, tmp_path, monkeypatch):
    monkeypatch.setattr(uidsmod, "HISTORY", 2)
    history = tmp_path / "job-uids"
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks, history=history)
    for _ in range(3):
        pool.release(pool.allocate())
    assert history.read_text() == f"{BASE + 1}\n{BASE + 2}\n"


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


@pytest.fixture
def scratch(tmp_path) -> list[Path]:
    """Stand-ins for /tmp and /dev/shm: world-writable and sticky, as on the host."""
    dirs = [tmp_path / "tmp", tmp_path / "shm"]
    for d in dirs:
        d.mkdir()
        d.chmod(0o1777)
    return dirs


def test_the_host_directories_a_job_without_bubblewrap_writes_are_looked_at():
    assert {Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")} <= set(SCRATCH)
    assert UidPool(BASE, BASE, Path("/nonexistent")).scratch == SCRATCH


@chowns
def test_a_uid_owning_a_file_in_tmp_or_dev_shm_is_skipped(jobs, locks, scratch):
    """Job A ran without bubblewrap and planted /tmp/torchinductor_jobA/kernel.py: job B got
    A's uid (the lowest free one) and ran it (issue 23, finding 2)."""
    tmp, shm = scratch
    planted = tmp / f"torchinductor_job{BASE}"
    planted.mkdir()
    (planted / "kernel.py").write_text("import os  # runs in the next job of this uid\n")
    for p in (planted / "kernel.py", planted):
        os.chown(p, BASE, BASE)
    planted.chmod(0)  # the job cannot hide from root by its modes
    (shm / "segment").write_text("x")
    os.chown(shm / "segment", BASE + 1, BASE + 1)
    other = tmp / "someone-elses"  # another user's world-writable directory: a file of the job in it
    other.mkdir()
    other.chmod(0o777)
    (other / "left").write_text("x")
    os.chown(other / "left", BASE + 2, BASE + 2)
    pool = UidPool(BASE, BASE + 9, jobs, locks=locks, scratch=scratch)
    assert pool.allocate() == BASE + 3
    assert pool.holder(BASE) == pool.holder(BASE + 2) == f"files in {tmp}, {shm}"
    assert pool.holder(BASE + 3) == "a job running here" and pool.holder(BASE + 4) is None
    with pytest.raises(RuntimeError, match=rf"3 by files in {tmp}, {shm};"):
        UidPool(BASE, BASE + 2, jobs, locks=locks, scratch=scratch).allocate()
    planted.chmod(0o700)
    shutil.rmtree(planted)  # cleaned (systemd-tmpfiles, a reboot): free again
    assert pool.allocate() == BASE


def test_sysv_ipc_owners_and_creators_hold_their_uids(tmp_path):
    """The columns as /proc/sysvipc lists them (Linux ipc/util.c, shm.c, sem.c, msg.c)."""
    ipc = tmp_path / "sysvipc"
    ipc.mkdir()
    (ipc / "shm").write_text(
        "       key      shmid perms                  size  cpid  lpid nattch   uid   gid  cuid  cgid      atime"
        "      dtime      ctime                   rss                  swap\n"
        "         0          3  1600                  4096  4711     0      0  1001  1002  1003  1004          0"
        "          0 1700000000                     0                     0\n")
    (ipc / "sem").write_text(
        "       key      semid perms      nsems   uid   gid  cuid  cgid      otime      ctime\n"
        " 305419896          0   600          1  2001  2002  2003  2004          0 1700000000\n")
    (ipc / "msg").write_text(
        "       key      msqid perms      cbytes       qnum lspid lrpid   uid   gid  cuid  cgid      stime      rtime"
        "      ctime\n")
    assert ipc_owners(ipc) == {1001, 1002, 1003, 1004, 2001, 2002, 2003, 2004}
    assert ipc_owners(tmp_path / "no-sysvipc") == set()


@root
def test_a_uid_owning_a_sysv_shared_memory_segment_is_skipped(jobs, locks, scratch):
    """Without bubblewrap's IPC namespace a job's segments stay in the host's after it."""
    made = subprocess.run([SETPRIV, "--reuid", str(BASE), "--regid", str(BASE), "--clear-groups", "--",
                           "ipcmk", "-M", "4096"], capture_output=True, text=True, check=True)
    shmid = made.stdout.split()[-1]
    try:
        pool = UidPool(BASE, BASE + 9, jobs, locks=locks, scratch=scratch)
        assert pool.holder(BASE) == "SysV IPC objects" and pool.allocate() == BASE + 1
    finally:
        subprocess.run(["ipcrm", "-m", shmid], check=True)
    assert pool.allocate() == BASE


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
        f"no free job uid in {BASE}-{BASE + 2}: 2 held by jobs running here, 1 by files in {jobs}; "
        "widen job_uids or wait for finished jobs' directories to be collected")


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
    pool = UidPool(BASE, BASE, jobs, locks=locks)
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
        f"no free job uid in {BASE}-{BASE + 1}: 1 held by jobs running here, "
        f"1 locked in {locks} (systemd's DynamicUser services); "
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
from swarmd.compute.host.sandbox.uids import UidPool
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
    pool = UidPool(BASE, BASE, jobs, locks=locks)
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
