"""A uid (and the gid of the same number) of its own for each job, from the provider's
`job_uids` range: what keeps one job's processes and files out of another's reach.

Rules:
- `allocate()` hands out the lowest uid of the range that is free: not handed out by this
  pool and not released yet, no process with it (any of the real, effective, saved or
  filesystem ids in /proc/PID/status, uid or gid), no entry of `jobs_dir` owned by it (a
  job's directory and what lies directly in it: the worker keeps the directory root's and
  hands its work/, checkpoints/ and home/ to the uid; a job leaves files nowhere else, its
  /tmp, /var/tmp and /dev/shm die with it, mounts.py), no user or group of that number in the
  host's databases (a `useradd` after the range was chosen), and not 65534/65535 (nobody,
  the kernel's overflow id, and the 16-bit -1).
- So a uid is never reused while a process or a file of its job remains, even across a
  daemon restart (the pool's own memory is lost, /proc and the jobs directory are not): a
  later job never inherits a crashed one's checkpoints or its stray processes.
- `release(uid)` only forgets the hand-out; the uid stays taken while its directory or a
  process remains. Releasing a uid not handed out does nothing.
- systemd's DynamicUser= picks its uids from the same default range (61184-65519) and
  checks only user/group names and IPC objects, never processes or files; what it does
  check is a lock: it opens /run/systemd/dynamic-uid/<uid> (O_CREAT|O_RDWR|O_NOFOLLOW,
  0600) and takes a BSD lock on it (flock LOCK_EX|LOCK_NB; held: the uid is in use, try
  another), writes the user's name and a newline into it, keeps the descriptor for the
  service's lifetime, and unlinks the file before closing it (src/core/dynamic-user.c,
  pick_uid and unlink_uid_lock). The pool takes part in that protocol: a candidate whose
  lock someone holds is skipped (a service got it, even before any of its processes
  shows), and a handed-out uid's lock is taken the same way and held until `release`,
  so systemd never hands a service a uid a job holds; where a process or a file of the
  uid remains at `release` (a job without a cgroup leaves a stray), the lock is kept until
  an `allocate` finds them gone. systemd makes the directory itself (mode 0755) where
  /run/systemd exists; so does the pool. The lock is a flock: a POSIX lock (fcntl/lockf)
  is another kind, invisible to systemd. Where the directory cannot be used (no
  /run/systemd: no systemd here; or read-only, as /run is under ProtectSystem=strict
  unless the unit makes it writable: existing lock files are still tested and held, new
  ones cannot be made), jobs still get uids and `systemd` says what is not coordinated.
- Exhaustion raises RuntimeError saying how many uids are held by whom and what to do.
- Thread-safe: the worker allocates from trio worker threads.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
import threading
from pathlib import Path

LOWEST = 1000  # below: system users (Debian's policy, login.defs UID_MIN)
HIGHEST = 2**31 - 2  # uid_t is 32-bit, but -1 and values past 2^31 break tools that read it as signed
RESERVED = frozenset({65534, 65535})  # nobody / the overflow id; (uid16_t)-1
LOCKS = Path("/run/systemd/dynamic-uid")  # systemd's DynamicUser locks, one file per uid
LOCK_NAME = "swarmd-job"  # what the lock file says holds the uid (systemd writes the user's name)
_BUSY = -1  # _take_lock: someone else holds the uid's lock


class UidPool:
    """The job uids of one daemon: `allocate()` one per job, `release()` when it ends."""

    def __init__(self, low: int, high: int, jobs_dir: Path, *, proc: Path = Path("/proc"),
                 locks: Path = LOCKS) -> None:
        for v in (low, high):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"job uid range bounds must be integers, got {v!r}")
        if not LOWEST <= low <= high <= HIGHEST:
            raise ValueError(f"job uid range {low}-{high}: want LOW-HIGH with {LOWEST} <= LOW <= HIGH <= {HIGHEST}")
        self.low, self.high = low, high
        self.jobs_dir = Path(jobs_dir)
        self.proc = proc
        self.locks = Path(locks)
        self.systemd = "not checked yet"  # how uids are coordinated with systemd's DynamicUser (set by allocate)
        self._given: set[int] = set()
        self._held: dict[int, int] = {}  # uid -> the descriptor holding its lock file's flock
        self._lingering: dict[int, int] = {}  # released uids whose process or file remained: locks kept
        self._lock = threading.Lock()

    def allocate(self) -> int:
        with self._lock:
            running = _process_ids(self.proc)
            files = _owners(self.jobs_dir)
            for uid, fd in list(self._lingering.items()):
                if uid not in running and uid not in files:
                    del self._lingering[uid]
                    self._unlock(uid, fd)
            locking = self._locking()
            busy = 0
            for uid in range(self.low, self.high + 1):
                if uid in self._given or uid in running or uid in files or uid in RESERVED or _named(uid):
                    continue
                if locking:
                    fd = self._take_lock(uid)
                    if fd == _BUSY:
                        busy += 1
                        continue
                    if fd is not None:
                        self._held[uid] = fd
                self._given.add(uid)
                return uid
            in_range = range(self.low, self.high + 1)
            raise RuntimeError(
                f"no free job uid in {self.low}-{self.high}: {len(self._given)} held by jobs running here, "
                f"{sum(u in running for u in in_range if u not in self._given)} by leftover processes, "
                f"{sum(u in files for u in in_range if u not in self._given)} by files in {self.jobs_dir}"
                + (f", {busy} locked in {self.locks} (systemd's DynamicUser services)" if busy else "")
                + "; widen job_uids or wait for finished jobs' directories to be collected")

    def release(self, uid: int) -> None:
        with self._lock:
            self._given.discard(uid)
            fd = self._held.pop(uid, None)
            if fd is None:
                return
            if uid in _process_ids(self.proc) or uid in _owners(self.jobs_dir):
                self._lingering[uid] = fd  # systemd must not hand it out yet
            else:
                self._unlock(uid, fd)

    def coordination(self) -> str:
        """How job uids stand with systemd's DynamicUser here (for status), checked now."""
        with self._lock:
            self._locking()
            return self.systemd

    def _unlock(self, uid: int, fd: int) -> None:
        """As systemd does: unlink the lock file while the lock is held, then close it."""
        try:
            os.unlink(self.locks / str(uid))
        except OSError:
            pass  # read-only here, or gone: the closed descriptor frees the uid all the same
        os.close(fd)

    def _locking(self) -> bool:
        """Whether the lock directory can be used; `systemd` says how it stands."""
        if not self.locks.is_dir():
            if not self.locks.parent.is_dir():
                self.systemd = f"no {self.locks.parent} (no systemd here): no DynamicUser uid to avoid"
                return False
            try:  # what systemd does before its first pick: mkdir, mode 0755 (whatever our umask)
                os.mkdir(self.locks, 0o755)
                os.chmod(self.locks, 0o755)
            except FileExistsError:
                pass
            except OSError as exc:
                self.systemd = (f"cannot make {self.locks} ({os.strerror(exc.errno)}): systemd may hand a job's "
                                "uid to a DynamicUser service")
                return False
        self.systemd = f"uids locked in {self.locks}, as systemd's DynamicUser does"
        return True

    def _take_lock(self, uid: int) -> int | None:
        """systemd's lock for `uid`, taken: its descriptor; _BUSY when someone else holds it;
        None when it cannot be taken here (a read-only lock directory without this uid's file)."""
        path = self.locks / str(uid)
        flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
        while True:
            writable = True
            try:
                fd = os.open(path, os.O_CREAT | os.O_RDWR | flags, 0o600)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    return _BUSY  # a link where the lock belongs: not ours to follow; leave the uid alone
                if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
                writable = False  # a read-only /run: an existing lock can still be tested and held
                try:
                    fd = os.open(path, os.O_RDONLY | flags)
                except FileNotFoundError:
                    self.systemd = (f"{self.locks} is read-only here ({os.strerror(exc.errno)}): systemd may hand "
                                    "a job's uid to a DynamicUser service")
                    return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return _BUSY
            except BaseException:
                os.close(fd)
                raise
            if os.fstat(fd).st_nlink == 0:  # unlinked by its holder between our open and our lock: again
                os.close(fd)
                continue
            if writable:  # like systemd, say who holds it (systemd reads a name it does not know as no user)
                data = f"{LOCK_NAME}\n".encode()
                try:
                    os.pwrite(fd, data, 0)
                    os.ftruncate(fd, len(data))
                except OSError:
                    pass  # a full /run: the lock is what counts
            return fd


def _process_ids(proc: Path) -> set[int]:
    """Every uid and gid some process holds (real, effective, saved, filesystem)."""
    ids: set[int] = set()
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "status"), "rb") as f:
                for line in f:
                    if line.startswith((b"Uid:", b"Gid:")):
                        ids.update(int(v) for v in line.split()[1:])
        except (OSError, ValueError):
            continue  # gone while we read
    return ids


def _owners(jobs_dir: Path) -> set[int]:
    """The uids and gids owning an entry of `jobs_dir` or of one of its directories."""
    ids: set[int] = set()
    try:
        top = list(os.scandir(jobs_dir))
    except OSError:
        return ids  # not made yet: nothing is owned
    for entry in top:
        ids |= _owner(entry)
        try:
            if entry.is_dir(follow_symlinks=False):
                for inner in os.scandir(entry.path):
                    ids |= _owner(inner)
        except OSError:
            continue  # removed while we looked
    return ids


def _owner(entry: os.DirEntry) -> set[int]:
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return set()
    return {st.st_uid, st.st_gid}


def _named(uid: int) -> bool:
    """A user or group of this number exists (files of it may be anywhere)."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            continue
    return False
