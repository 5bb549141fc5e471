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
- Exhaustion raises RuntimeError saying how many uids are held by whom and what to do.
- Thread-safe: the worker allocates from trio worker threads.
"""

from __future__ import annotations

import grp
import os
import pwd
import threading
from pathlib import Path

LOWEST = 1000  # below: system users (Debian's policy, login.defs UID_MIN)
HIGHEST = 2**31 - 2  # uid_t is 32-bit, but -1 and values past 2^31 break tools that read it as signed
RESERVED = frozenset({65534, 65535})  # nobody / the overflow id; (uid16_t)-1


class UidPool:
    """The job uids of one daemon: `allocate()` one per job, `release()` when it ends."""

    def __init__(self, low: int, high: int, jobs_dir: Path, *, proc: Path = Path("/proc")) -> None:
        for v in (low, high):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"job uid range bounds must be integers, got {v!r}")
        if not LOWEST <= low <= high <= HIGHEST:
            raise ValueError(f"job uid range {low}-{high}: want LOW-HIGH with {LOWEST} <= LOW <= HIGH <= {HIGHEST}")
        self.low, self.high = low, high
        self.jobs_dir = Path(jobs_dir)
        self.proc = proc
        self._given: set[int] = set()
        self._lock = threading.Lock()

    def allocate(self) -> int:
        with self._lock:
            running = _process_ids(self.proc)
            files = _owners(self.jobs_dir)
            for uid in range(self.low, self.high + 1):
                if uid in self._given or uid in running or uid in files or uid in RESERVED or _named(uid):
                    continue
                self._given.add(uid)
                return uid
            in_range = range(self.low, self.high + 1)
            raise RuntimeError(
                f"no free job uid in {self.low}-{self.high}: {len(self._given)} held by jobs running here, "
                f"{sum(u in running for u in in_range if u not in self._given)} by leftover processes, "
                f"{sum(u in files for u in in_range if u not in self._given)} by files in {self.jobs_dir}; "
                "widen job_uids or wait for finished jobs' directories to be collected")

    def release(self, uid: int) -> None:
        with self._lock:
            self._given.discard(uid)


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
