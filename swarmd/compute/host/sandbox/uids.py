"""A uid (and the gid of the same number) of its own for each job, from the provider's
`job_uids` range: what keeps one job's processes and files out of another's reach.

Rules:
- `allocate()` hands out the free uid of the range used least recently (its last job
  ended longest ago; one never handed out first, lowest first). Free: not handed out by this pool and not released
  yet, no process with it (any of the real, effective, saved or filesystem ids in
  /proc/PID/status, uid or gid), nothing owned by it where a job could have written (below),
  no user or group of that number in the host's databases (a `useradd` after the range was
  chosen), and not 65534/65535 (nobody, the kernel's overflow id, and the 16-bit -1).
- Where a job could have written, and what is looked at there (`owners`): `jobs_dir` (a
  job's directory and what lies directly in it: the worker keeps the directory root's and
  hands its work/, checkpoints/, home/ and tmp/ to the uid); the host's world-writable
  directories (`SCRATCH`: /tmp, /var/tmp, /dev/shm, /dev/mqueue, /run/lock, /var/crash):
  their entries and the entries of each directory among them, as the daemon (root) sees
  them whatever their modes; and SysV IPC objects (/proc/sysvipc: owner and creator).
  With bubblewrap a rank's /tmp, /var/tmp and /dev/shm are its own and die with it
  (mounts.py), but a job that ran without (sandbox = auto on a host lacking bwrap) wrote
  in the host's: its uid must not come back to a later job while a file of it is there
  (TorchInductor's /tmp/torchinductor_$USER made that code execution in the next job).
  When such a job ends, box.py removes what its uid owns at their top level and its IPC
  objects; what the scan finds after that lies deeper, or survived a failed removal.
  Two levels are enough: whatever a job makes is owned by its uid, so a file of it deeper
  down lies under a directory of its own at one of those two levels, unless someone else
  made a world-writable directory at the second level for it: that file is missed (its
  maker's uid is held, if a job's), and the rotation below keeps the job's uid away as
  long as the range allows. A job cannot hide from root by its modes (chmod 0 on its
  directory): the daemon reads through. The cost: one lstat per entry of those
  directories and of each directory in them, at each hand-out and release.
- So a uid is never reused while a process or a file of its job remains, even across a
  daemon restart (/proc and the file systems are not lost): a later job never inherits a
  crashed one's checkpoints, its planted caches or its stray processes.
- Rotation (least recently used first: by when its last job ended) is the second fence: a
  uid comes back only after every other free uid of the range had its turn, so what the
  scan cannot see (a kernel keyring, a file in a world-writable directory of another user
  three levels down) is reached by a later job only after the whole range went round. The
  order is remembered in `history` (a file in the daemon's state directory, one uid a
  line, least recent first, at most `HISTORY` lines, rewritten whole at each hand-out and
  release): a restart keeps rotating instead of starting from the lowest uid again.
  Without it (unwritable, or not given) it is kept in memory only, and `rotation` says so.
- `release(uid)` only forgets the hand-out; the uid stays taken while something of it
  remains. Releasing a uid not handed out does nothing.
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
from collections.abc import Iterator, Sequence
from pathlib import Path

LOWEST = 1000  # below: system users (Debian's policy, login.defs UID_MIN)
HIGHEST = 2**31 - 2  # uid_t is 32-bit, but -1 and values past 2^31 break tools that read it as signed
RESERVED = frozenset({65534, 65535})  # nobody / the overflow id; (uid16_t)-1
LOCKS = Path("/run/systemd/dynamic-uid")  # systemd's DynamicUser locks, one file per uid
LOCK_NAME = "swarmd-job"  # what the lock file says holds the uid (systemd writes the user's name)
_BUSY = -1  # _take_lock: someone else holds the uid's lock
# the directories any local user (a job without bubblewrap) may write in, as Debian and
# Ubuntu make them (1777; /var/crash 3777 where apport keeps crash reports); missing ones are skipped
SCRATCH = tuple(map(Path, ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock", "/var/crash")))
SYSVIPC = Path("/proc/sysvipc")  # shm, sem, msg: one object a line, with its owner's and creator's ids
# uids remembered for the rotation: where the range is larger, a uid still comes back no
# sooner than this many hand-outs later; the file stays under 50 KB
HISTORY = 4096


class UidPool:
    """The job uids of one daemon: `allocate()` one per job, `release()` when it ends."""

    def __init__(self, low: int, high: int, jobs_dir: Path, *, proc: Path = Path("/proc"),
                 locks: Path = LOCKS, scratch: Sequence[Path] = SCRATCH, sysvipc: Path = SYSVIPC,
                 history: Path | None = None) -> None:
        for v in (low, high):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"job uid range bounds must be integers, got {v!r}")
        if not LOWEST <= low <= high <= HIGHEST:
            raise ValueError(f"job uid range {low}-{high}: want LOW-HIGH with {LOWEST} <= LOW <= HIGH <= {HIGHEST}")
        self.low, self.high = low, high
        self.jobs_dir = Path(jobs_dir)
        self.proc = proc
        self.locks = Path(locks)
        self.scratch = tuple(map(Path, scratch))
        self.sysvipc = Path(sysvipc)
        self.history = history
        self.systemd = "not checked yet"  # how uids are coordinated with systemd's DynamicUser (set by allocate)
        self.rotation = ("least recently used first, in memory only" if history is None  # and whether a restart keeps it
                         else f"least recently used first, remembered in {history}")
        self._used: dict[int, None] = self._recall()  # uids handed out, least recently first
        self._given: set[int] = set()
        self._held: dict[int, int] = {}  # uid -> the descriptor holding its lock file's flock
        self._lingering: dict[int, int] = {}  # released uids whose process or file remained: locks kept
        self._lock = threading.Lock()

    def allocate(self) -> int:
        with self._lock:
            holders = self._holders()
            taken = set().union(*holders.values())
            for uid, fd in list(self._lingering.items()):
                if uid not in taken:
                    del self._lingering[uid]
                    self._unlock(uid, fd)
            locking = self._locking()
            busy = 0
            for uid in self._candidates():
                if uid in self._given or uid in taken or uid in RESERVED or _named(uid):
                    continue
                if locking:
                    fd = self._take_lock(uid)
                    if fd == _BUSY:
                        busy += 1
                        continue
                    if fd is not None:
                        self._held[uid] = fd
                self._given.add(uid)
                self._touch(uid)
                return uid
            in_range = range(self.low, self.high + 1)
            counts = {what: sum(u in ids for u in in_range if u not in self._given) for what, ids in holders.items()}
            raise RuntimeError(
                f"no free job uid in {self.low}-{self.high}: {len(self._given)} held by jobs running here"
                + "".join(f", {n} by {what}" for what, n in counts.items() if n)
                + (f", {busy} locked in {self.locks} (systemd's DynamicUser services)" if busy else "")
                + "; widen job_uids or wait for finished jobs' directories to be collected")

    def release(self, uid: int) -> None:
        with self._lock:
            if uid not in self._given:
                return
            self._given.remove(uid)
            self._touch(uid)  # its job ended now: the most recently used
            fd = self._held.pop(uid, None)
            if fd is None:
                return
            if any(uid in ids for ids in self._holders().values()):
                self._lingering[uid] = fd  # systemd must not hand it out yet
            else:
                self._unlock(uid, fd)

    def holder(self, uid: int) -> str | None:
        """What keeps `uid` from being handed out now (a job, a process, files, IPC), or None."""
        with self._lock:
            if uid in self._given:
                return "a job running here"
            return next((what for what, ids in self._holders().items() if uid in ids), None)

    def _holders(self) -> dict[str, set[int]]:
        """The ids held by something of a job that may remain after it: what holds them -> ids."""
        return {"leftover processes": _process_ids(self.proc),
                f"files in {self.jobs_dir}": owners([self.jobs_dir]),
                f"files in {', '.join(map(str, self.scratch)) or 'no scratch directory'}": owners(self.scratch),
                "SysV IPC objects": ipc_owners(self.sysvipc)}

    def _candidates(self) -> Iterator[int]:
        """The range in rotation order: never handed out (lowest first), then the least recent."""
        for uid in range(self.low, self.high + 1):
            if uid not in self._used:
                yield uid
        yield from list(self._used)

    def _recall(self) -> dict[int, None]:
        """The rotation order a previous life left in `history` (lines that are not a uid of
        the range are dropped: the range may have changed since)."""
        if self.history is None:
            return {}
        try:
            lines = self.history.read_text(encoding="ascii").split()
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            self.rotation = f"least recently used first; {self.history} unreadable ({exc}): started afresh"
            return {}
        used: dict[int, None] = {}
        for uid in (int(w) for w in lines if w.isdigit() and len(w) <= 10):
            if self.low <= uid <= self.high:
                used.pop(uid, None)  # a later line is a later use
                used[uid] = None
        return dict.fromkeys(list(used)[-HISTORY:])

    def _touch(self, uid: int) -> None:
        """`uid` is the most recently used now (handed out, or its job just ended)."""
        self._used.pop(uid, None)
        self._used[uid] = None
        self._remember()

    def _remember(self) -> None:
        if self.history is None:
            return
        while len(self._used) > HISTORY:
            del self._used[next(iter(self._used))]  # the oldest turns "never handed out": first all the same
        part = self.history.with_name(self.history.name + ".new")
        try:
            part.write_text("".join(f"{uid}\n" for uid in self._used), encoding="ascii")
            os.replace(part, self.history)
        except OSError as exc:
            self.rotation = f"least recently used first, in memory only: {self.history}: {os.strerror(exc.errno or 0)}"
            return
        self.rotation = f"least recently used first, remembered in {self.history}"

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
    """Every uid and gid some live process holds (real, effective, saved, filesystem)."""
    ids: set[int] = set()
    for _, uids, gids in _live(proc):
        ids |= uids | gids
    return ids


def pids_of(uid: int, proc: Path = Path("/proc")) -> list[int]:
    """The live processes with `uid` among their real, effective, saved or filesystem uids."""
    return [pid for pid, uids, _ in _live(proc) if uid in uids]


def _live(proc: Path) -> Iterator[tuple[int, set[int], set[int]]]:
    """(pid, uids, gids) of each process but zombies: they run nothing, and their parent
    reaps them (a container's init may take a second or more)."""
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "status"), "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if b":" in line)
            if fields.get(b"State", b"").split()[:1] == [b"Z"]:
                continue
            yield int(entry.name), {int(v) for v in fields[b"Uid"].split()}, {int(v) for v in fields[b"Gid"].split()}
        except (OSError, ValueError, KeyError):
            continue  # gone while we read


def owners(dirs: Sequence[Path]) -> set[int]:
    """The uids and gids owning an entry of one of `dirs` or of a directory among those
    entries (links never followed)."""
    ids: set[int] = set()
    for d in dirs:
        try:
            top = list(os.scandir(d))
        except OSError:
            continue  # not made yet, or not on this host: nothing is owned
        for entry in top:
            ids |= _owner(entry)
            try:
                if entry.is_dir(follow_symlinks=False):
                    with os.scandir(entry.path) as inner:
                        for e in inner:
                            ids |= _owner(e)
            except OSError:
                continue  # removed while we looked
    return ids


def ipc_owners(sysvipc: Path = SYSVIPC) -> set[int]:
    """The uids and gids owning or having created a SysV shared memory segment, semaphore
    set or message queue (this IPC namespace's: the host's, for a job without bubblewrap)."""
    ids: set[int] = set()
    for _, _, owner in _ipc_objects(sysvipc):
        ids |= set(owner.values())
    return ids


def ipc_of(uid: int, sysvipc: Path = SYSVIPC) -> list[tuple[str, int]]:
    """(kind, id) of each SysV IPC object `uid` owns or created: kind shm, sem or msg."""
    return [(kind, ident) for kind, ident, owner in _ipc_objects(sysvipc) if uid in (owner["uid"], owner["cuid"])]


def _ipc_objects(sysvipc: Path) -> Iterator[tuple[str, int, dict[str, int]]]:
    """(kind, id, {uid, gid, cuid, cgid}) of each object /proc/sysvipc lists, by its header's
    column names (Linux ipc/shm.c, sem.c, msg.c)."""
    for kind, key in (("shm", "shmid"), ("sem", "semid"), ("msg", "msqid")):
        try:
            header, *rows = (sysvipc / kind).read_text().splitlines()
        except (OSError, ValueError):
            continue  # no SysV IPC in this kernel
        names = header.split()
        wanted = (key, "uid", "gid", "cuid", "cgid")
        if not all(c in names for c in wanted):
            continue  # not the format we know: nothing is read rather than a wrong column
        at = {c: names.index(c) for c in wanted}
        for row in rows:
            words = row.split()
            try:
                values = {c: int(words[i]) for c, i in at.items()}
            except (IndexError, ValueError):
                continue
            yield kind, values.pop(key), values


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
