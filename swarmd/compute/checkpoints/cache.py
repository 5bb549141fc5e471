"""A host's copies of one (coordinator, job)'s checkpoints, by content. `CkptCache` is blocking
file I/O (call it from a worker thread, trio.to_thread, never from the event loop); `Watcher`
runs the scan of a rank's checkpoint directory that way.

Layout: `jobs_dir/<job>-<coordinator hash>/ckpt-cache/<sha256>` (ids.host_dir). Rules:
- The cache directory is the daemon's (0700) inside the job's directory (the daemon's,
  0711): the job user can reach neither the directory nor a file in it by name. Each file
  is the daemon's, 0444, named by the sha256 of its bytes, and appears only by a rename
  of a complete, verified temporary (``.tmp-*`` beside it): a reader sees a whole file or
  none. A second copy of a sha changes nothing.
- It outlives the job's starts (worker `_prepare` empties the job's directory except it,
  `clear_job_dir`), so a restart finds the checkpoints of attempts before, and goes with
  the job's directory (coordinator/gc.py).
- `snapshot` copies a file out of the rank's checkpoint directory, which the job owns and
  changes at will: opened relative to a descriptor of that directory, O_NOFOLLOW (a link
  is not followed, whatever it points at) and O_NONBLOCK (a FIFO does not hold the thread),
  then judged by fstat of what was opened (rules.refusal): a regular file with one
  link, the job's uid's, at most `max_size`, not sparse. It must show the observation the scan found
  stable before and after the copy, and give exactly its size; else it is `Changed` and
  is looked at again when stable.
- `install` puts the listed checkpoints in a fresh checkpoint directory as hard links to
  the cache: the job reads them, may unlink or rename over them, cannot change them (the
  daemon owns the inode, 0444). A listed sha not in the cache fails the start, naming it.
- `prune` keeps the newest `keep` files (by when they were stored) and those in `protect`
  (the latest start's); temporaries untouched for `TEMP_AGE` are debris of a transfer
  that died with its daemon.
- `incoming_path` hands out a temporary for a file another part of the daemon writes (the
  coordinator fetching a checkpoint into its own cache); `store_file` of such a temporary
  verifies and renames it (no second copy) and removes it when it does not match.
- A copy is refused when it would leave less than `MIN_FREE` bytes free on the disk. All
  the host's caches together (`Budget`: every job's, the hub's, transfers under way) hold
  at most `BUDGET_FACTOR` × checkpoint_max: room for one job's `keep` (2) checkpoints at
  the largest size, one arriving and one more, or for many jobs with the usual smaller
  ones. Without it a member could fill any host's disk by putting checkpoints for jobs it
  never runs. The budget is shared per job (rules.make_room), not first come first
  served for the whole host: while there is room any copy fits; past it a job whose cache
  stays within its share (budget / caches holding anything) gets room by removing copies
  of caches over theirs, unprotected ones (neither the latest start's, nor the hub's list,
  nor the cache's newest) oldest first, protected ones last and only while their cache is
  over its share (protection counts within a share: else a member listing everything it
  put in its start would hold the whole budget); a copy that would take its own cache
  over its share first removes that cache's older unprotected copies (its prune would),
  and is refused when that is not enough. So a member that filled the budget first, with
  puts or its own jobs, gives its excess back to the next job that needs its share, and a
  running job's newest checkpoints and those a restart starts from go last. Why a share
  and not a fixed fraction: the budget stays whole for one job alone (its checkpoints at
  checkpoint_max), and n jobs get an n-th each. A refusal says why (the watcher logs it;
  a refused put fails that host's part of an attempt, and the coordinator places the
  attempt again without the host, coordinator/coordinator.py). Caches of jobs that finished count
  until they go (a host that is not the hub drops one CHECKPOINT_LINGER after its ranks
  end), or gc removes them (retention); caches a peer put into for a hold that ended
  before its job ever started here go with the hold (host/worker.py).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import structlog
import trio

from .. import trees
from .rules import Copy, Observation, Scan, is_checkpoint_name, is_sha256, keep_newest, make_room, refusal

log = structlog.get_logger("swarmd.jobs")

CACHE_DIR = "ckpt-cache"
CHUNK = 1024 * 1024
TEMP = ".tmp-"
TEMP_AGE = 600.0  # seconds a temporary may go unwritten (a transfer pauses at most 30 s a chunk)
MIN_FREE = 64 * 1024 * 1024  # bytes a copy leaves free on the disk at least
RATE_WINDOW = 60.0  # seconds over which the watcher's copies of one job are counted
RATE_FACTOR = 4  # checkpoint_max bytes the watcher copies of one job per RATE_WINDOW at most
BUDGET_FACTOR = 4  # all caches together hold at most this many checkpoint_max (see the header)
MAX_LISTING = 4096  # entries of a checkpoint directory looked at per scan: a job's flood costs it, not the host


class CheckpointError(Exception):
    """A checkpoint this host will not copy, store or install; the message says why."""


class Changed(CheckpointError):
    """The file changed while it was copied (or since it was seen stable): look again later."""


def clear_job_dir(top: Path) -> None:
    """Empty the job's directory for a start, keeping its checkpoint cache; afterwards it
    exists, is the daemon's and is 0700 (nobody reaches in while it is built)."""
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        os.mkdir(top, 0o700)
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        trees.remove(top)  # a leftover of another kind, links not followed
        os.mkdir(top, 0o700)
        return
    os.chmod(top, 0o700)
    for entry in os.scandir(top):
        if entry.name == CACHE_DIR and _own_dir(Path(entry.path)):
            continue
        trees.remove(Path(entry.path))


def _own_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0


def listing(dir_fd: int) -> dict[str, Observation]:
    """``{name: (size, mtime_ns, inode)}`` of the regular files with checkpoint names in a
    directory, links not followed, at most MAX_LISTING entries looked at. Only an entry the
    directory itself types as a regular file is stat'ed: a directory there may be a mount
    (a job's FUSE file system) whose stat never returns."""
    out: dict[str, Observation] = {}
    with os.scandir(dir_fd) as entries:
        for i, entry in enumerate(entries):
            if i >= MAX_LISTING:
                break
            if not is_checkpoint_name(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # gone since the listing
            out[entry.name] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


class Budget:
    """Bytes all the checkpoint caches under `jobs_dir` may hold together: files, and what
    copies under way have been promised (`claim`, by temporary name, until `settle` or the
    temporary is gone), shared among the jobs by rules.make_room (the header says
    why). `protect` names, for a job directory, the shas its cache keeps (the worker's
    word); each cache's newest copy is protected too. Blocking (it lists every job's
    cache): call it from a thread."""

    def __init__(self, jobs_dir: Path, limit: int, protect: Callable[[str], Iterable[str]] = lambda name: ()) -> None:
        self.jobs_dir = jobs_dir
        self.limit = limit
        self.protect = protect
        self._lock = threading.Lock()  # one check-and-claim at a time, whichever thread
        self._claims: dict[str, int] = {}  # temporary's name -> bytes promised to it

    def claim(self, tmp: Path, size: int) -> None:
        """Promise `size` bytes to the temporary `tmp` (in a job's cache), removing other
        jobs' copies over their share where needed; or CheckpointError saying why not."""
        with self._lock:
            plan = make_room(self._copies(tmp.name), tmp.parent.parent.name, size, self.limit)
            if isinstance(plan, str):
                raise CheckpointError(plan)
            for copy in plan:
                assert copy.sha is not None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.jobs_dir / copy.cache / CACHE_DIR / copy.sha)
                log.info("a checkpoint copy removed: its job's cache was over its share of the host's budget",
                         directory=copy.cache, sha=copy.sha[:12], size=copy.size, protected=copy.protected,
                         for_directory=tmp.parent.parent.name)
            self._claims[tmp.name] = size

    def settle(self, tmp: Path) -> None:
        with self._lock:
            self._claims.pop(tmp.name, None)

    def used(self) -> int:
        with self._lock:
            return sum(c.size for c in self._copies())

    def _copies(self, leave: str | None = None) -> list[Copy]:
        """Every file of every job's cache (a claim counted at least at its promise), but `leave`."""
        out: list[Copy] = []
        seen: set[str] = set()
        for top in _entries(self.jobs_dir):
            if not top.is_dir(follow_symlinks=False):
                continue
            files: list[tuple[str, int, int]] = []
            for entry in _entries(Path(top.path) / CACHE_DIR):
                if entry.name == leave or not entry.is_file(follow_symlinks=False):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                size = st.st_size
                if entry.name in self._claims:
                    seen.add(entry.name)
                    size = max(size, self._claims[entry.name])
                files.append((entry.name, size, st.st_mtime_ns))
            if not files:
                continue
            kept = frozenset(self.protect(top.name))
            newest = max(((m, name) for name, _, m in files if is_sha256(name)), default=(0, None))[1]
            for name, size, mtime_ns in files:
                sha = name if is_sha256(name) else None  # a temporary (or debris): never removed here
                out.append(Copy(cache=top.name, sha=sha, size=size, mtime_ns=mtime_ns,
                                protected=sha is not None and (sha in kept or sha == newest)))
        for gone in set(self._claims) - seen - {leave}:  # the temporary went: its claim with it
            del self._claims[gone]
        return out


def _entries(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


class CkptCache:
    """The checkpoint cache of one job directory `top` (already checked to be the job's);
    copies into it are counted against `budget`, when given."""

    def __init__(self, top: Path, budget: Budget | None = None) -> None:
        self.top = top
        self.root = top / CACHE_DIR
        self.budget = budget

    def ensure(self) -> Path:
        """The cache directory, made where absent (and the job's directory, 0711, with it)."""
        try:
            os.mkdir(self.top, 0o711)
        except FileExistsError:
            pass
        st = os.lstat(self.top)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise CheckpointError(f"{self.top} is not this daemon's directory")
        if not _own_dir(self.root):
            with contextlib.suppress(FileNotFoundError):
                if os.path.lexists(self.root):
                    trees.remove(self.root)
            os.mkdir(self.root, 0o700)
        return self.root

    def path(self, sha: str) -> Path | None:
        """The cached file of `sha`, or None."""
        if not is_sha256(sha):
            return None
        p = self.root / sha
        try:
            st = os.lstat(p)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return p if stat.S_ISREG(st.st_mode) else None

    def shas(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if is_sha256(e.name))
        except FileNotFoundError:
            return []

    # --- in ------------------------------------------------------------------------------

    def open_incoming(self, size: int) -> Incoming:
        """A temporary in the cache for `size` bytes, which becomes `<sha>` at
        `Incoming.finish`; `Incoming.discard` removes it otherwise."""
        _room(self.ensure(), size)
        inc = Incoming(self.root, size)
        if self.budget is not None:
            try:
                self.budget.claim(inc.tmp, size)  # type: ignore[arg-type]
            except BaseException:
                inc.discard()
                raise
            inc.budget = self.budget
        return inc

    @contextlib.contextmanager
    def incoming(self, size: int) -> Iterator[Incoming]:
        """`open_incoming` for a block: discarded if the block ends before `finish`."""
        inc = self.open_incoming(size)
        try:
            yield inc
        finally:
            inc.discard()

    def snapshot(self, dir_fd: int, name: str, *, seen: Observation | None, job_uid: int | None,
                 max_size: int) -> tuple[str, int]:
        """Copy the checkpoint `name` of the directory `dir_fd` into the cache; its (sha256, size)."""
        if not is_checkpoint_name(name):
            raise CheckpointError(f"{name[:40]!r} is not a checkpoint name")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                         dir_fd=dir_fd)
        except FileNotFoundError:
            raise Changed(f"{name}: gone") from None
        except OSError as exc:  # ELOOP: a link
            raise CheckpointError(f"{name}: {exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            if (why := refusal(mode=st.st_mode, nlink=st.st_nlink, uid=st.st_uid, size=st.st_size,
                               job_uid=job_uid, max_size=max_size, blocks=st.st_blocks)) is not None:
                raise CheckpointError(f"{name}: {why}")
            before = (st.st_size, st.st_mtime_ns, st.st_ino)
            if seen is not None and before != seen:
                raise Changed(f"{name}: changed since it was seen stable")
            with self.incoming(st.st_size) as inc:
                while chunk := os.read(fd, CHUNK):
                    if inc.received + len(chunk) > st.st_size:
                        raise Changed(f"{name}: grew while it was copied")
                    inc.write(chunk)
                after = os.fstat(fd)
                if (after.st_size, after.st_mtime_ns, after.st_ino) != before or inc.received != st.st_size:
                    raise Changed(f"{name}: changed while it was copied")
                sha = inc.finish()
            return sha, st.st_size
        finally:
            os.close(fd)

    def incoming_path(self, size: int) -> Path:
        """A fresh, empty temporary in the cache (``.tmp-*``, the daemon's, 0600) for a file of
        `size` bytes that someone else writes, then gives to `store_file`; `prune` removes it
        once untouched for TEMP_AGE, and it goes with the job's directory (gc.py)."""
        root = self.ensure()
        _room(root, size)
        path = root / f"{TEMP}{secrets.token_hex(8)}"
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        if self.budget is not None:
            try:
                self.budget.claim(path, size)  # settled by store_file, or when the file goes
            except BaseException:
                os.unlink(path)
                raise
        return path

    def is_incoming(self, path: Path) -> bool:
        """Whether `path` names a temporary of this cache (`incoming_path`'s)."""
        return path.name.startswith(TEMP) and os.path.abspath(path.parent) == os.path.abspath(self.root)

    def store_file(self, sha: str, size: int, src: Path) -> Path:
        """Copy `src` into the cache as `sha`, verifying both; the cached file. A temporary
        of this cache (`incoming_path`) is verified and renamed instead of copied, and
        removed when it does not match."""
        if self.is_incoming(src):
            try:
                return self._adopt(sha, size, src)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(src)
                if self.budget is not None:
                    self.budget.settle(src)
        if not is_sha256(sha):
            raise CheckpointError("a checkpoint's sha256 must be 64 lowercase hex digits")
        if (have := self.path(sha)) is not None:
            return have
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(f"{src} is not a regular file")
            with self.incoming(size) as inc:
                while chunk := os.read(fd, CHUNK):
                    inc.write(chunk)
                return inc.finish(sha)
        finally:
            os.close(fd)

    def _adopt(self, sha: str, size: int, src: Path) -> Path:
        """The temporary `src` of this cache, verified, renamed to `sha`."""
        if not is_sha256(sha):
            raise CheckpointError("a checkpoint's sha256 must be 64 lowercase hex digits")
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise CheckpointError(f"{src.name} is not a regular file of its own")
            if st.st_size != size:
                raise CheckpointError(f"{st.st_size} bytes arrived, not the {size} announced")
            digest = hashlib.sha256()
            while chunk := os.read(fd, CHUNK):
                digest.update(chunk)
            if (got := digest.hexdigest()) != sha:
                raise CheckpointError(f"the bytes' sha256 is {got[:12]}…, not the {sha[:12]}… announced")
            os.fchmod(fd, 0o444)
            os.fsync(fd)
        finally:
            os.close(fd)
        final = self.root / sha
        if not os.path.lexists(final):
            os.rename(src, final)
        return final

    # --- out -----------------------------------------------------------------------------

    def install(self, checkpoints: Path, listed: Iterable[tuple[str, str, int]]) -> dict[str, Observation]:
        """Hard-link each listed (name, sha, size) from the cache into the fresh directory
        `checkpoints`; what each looks like there (for the scan to leave alone)."""
        out: dict[str, Observation] = {}
        for name, sha, size in listed:
            if not is_checkpoint_name(name):
                raise CheckpointError(f"{name[:40]!r} is not a checkpoint name")
            p = self.path(sha)
            if p is None:
                raise CheckpointError(f"checkpoint {name} ({sha[:12]}) is not on this host")
            st = os.lstat(p)
            if st.st_size != size:
                raise CheckpointError(f"checkpoint {name} ({sha[:12]}) is {st.st_size} bytes here, not {size}")
            os.link(p, checkpoints / name, follow_symlinks=False)
            out[name] = (st.st_size, st.st_mtime_ns, st.st_ino)
        return out

    def prune(self, keep: int, protect: Iterable[str] = ()) -> list[str]:
        """Remove all but the newest `keep` (and `protect`); the shas removed."""
        found: list[tuple[str, float]] = []
        now = time.time()
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.name.startswith(TEMP):
                if now - st.st_mtime > TEMP_AGE:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
            elif is_sha256(entry.name) and stat.S_ISREG(st.st_mode):
                found.append((entry.name, st.st_mtime_ns))
        _, old = keep_newest(found, keep)
        removed = [sha for sha in old if sha not in set(protect)]
        for sha in removed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root / sha)
        return sorted(removed)


class Incoming:
    """A checkpoint arriving into the cache: written to a temporary while hashed."""

    def __init__(self, root: Path, size: int) -> None:
        self.root = root
        self.size = size
        self.received = 0
        self.hash = hashlib.sha256()
        self.tmp: Path | None = root / f"{TEMP}{secrets.token_hex(8)}"
        self.budget: Budget | None = None  # settled when the temporary is renamed or removed
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                      0o600)

    def write(self, chunk: bytes) -> None:
        assert self.fd is not None
        if self.received + len(chunk) > self.size:
            raise CheckpointError(f"more than the {self.size} bytes announced")
        view = memoryview(chunk)
        while view:
            view = view[os.write(self.fd, view):]
        self.hash.update(chunk)
        self.received += len(chunk)

    def finish(self, sha: str | None = None) -> str:
        """Verify the size (and `sha`, when given) and rename into place; the sha256."""
        assert self.fd is not None and self.tmp is not None
        if self.received != self.size:
            raise CheckpointError(f"{self.received} bytes arrived, not the {self.size} announced")
        got = self.hash.hexdigest()
        if sha is not None and got != sha:
            raise CheckpointError(f"the bytes' sha256 is {got[:12]}…, not the {sha[:12]}… announced")
        os.fchmod(self.fd, 0o444)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        final = self.root / got
        if os.path.lexists(final):
            os.unlink(self.tmp)  # had already: the same bytes
        else:
            os.rename(self.tmp, final)
        self._settle()
        self.tmp = None
        return got

    def _settle(self) -> None:
        if self.budget is not None and self.tmp is not None:
            self.budget.settle(self.tmp)

    def discard(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self._settle()
            self.tmp = None


def _room(root: Path, size: int) -> None:
    vfs = os.statvfs(root)
    free = vfs.f_bavail * vfs.f_frsize
    if free - size < MIN_FREE:
        raise CheckpointError(f"a {size}-byte checkpoint would leave {max(free - size, 0)} bytes free on this "
                              f"host's disk (at least {MIN_FREE} are kept)")


class Watcher:
    """A rank directory's checkpoints as they complete: each `poll` lists the directory
    (checkpoints.Scan), copies what became complete into the cache (the newest `keep` of
    them) and prunes it, in a worker thread; it returns the new ones as (name, sha256,
    size), oldest first. A file refused is logged once per change of it, never retried
    until it changes. At most `rate` bytes are copied per RATE_WINDOW (RATE_FACTOR ×
    `max_size` by default): a job renaming a fresh 8 GiB file every half second costs the
    host a few copies a minute, not a disk's bandwidth; a complete file over it waits for
    the window to have room and is copied and told then."""

    def __init__(self, cache: CkptCache, directory: Path, *, job_uid: int | None, max_size: int, keep: int,
                 protect: Callable[[], Iterable[str]] = tuple, listed: Iterable[tuple[str, str, int]] = (),
                 rate: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cache = cache
        self.directory = directory
        self.job_uid = job_uid
        self.max_size = max_size
        self.keep = keep
        self.protect = protect  # shas never pruned, asked at each prune (the worker's word may change)
        self.listed = tuple(listed)  # installed by the host: not told back
        self.scan: Scan | None = None
        self.rate = rate if rate is not None else RATE_FACTOR * max_size
        self.clock = clock
        self.copied: collections.deque[tuple[float, int]] = collections.deque()  # (when, bytes) in the window
        self.waiting: set[str] = set()  # names held back by the rate, logged once

    def _room(self, size: int) -> bool:
        """Whether `size` more bytes fit this window's copies (and if so, count them)."""
        now = self.clock()
        while self.copied and self.copied[0][0] <= now - RATE_WINDOW:
            self.copied.popleft()
        if sum(n for _, n in self.copied) + size > self.rate:
            return False
        self.copied.append((now, size))
        return True

    async def poll(self) -> list[tuple[str, str, int]]:
        # a cancel leaves a thread stuck in the job's file system behind, never the job's end
        return await trio.to_thread.run_sync(self._poll, abandon_on_cancel=True)

    def _poll(self) -> list[tuple[str, str, int]]:
        try:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return []  # not made yet, or gone with the job's directory
        out: list[tuple[str, str, int]] = []
        try:
            try:
                seen = listing(dir_fd)
            except OSError:
                return []
            if self.scan is None:
                self.scan = Scan(self._installed(seen))
            self.waiting &= seen.keys()
            # only the newest `keep` of those complete at once: the older would be pruned at once
            # (a job that renames a thousand files costs it, not the host or the coordinator)
            for name in self.scan.observe(seen)[-self.keep:]:
                if not self._room(seen[name][0]):
                    self.scan.retry(name)  # told again once the window has room, if it is still there
                    if name not in self.waiting:
                        self.waiting.add(name)
                        log.info("a job's checkpoint waits: its copies are over the rate", path=str(self.directory),
                                 name=name, rate=self.rate, window=RATE_WINDOW)
                    continue
                self.waiting.discard(name)
                try:
                    sha, size = self.cache.snapshot(dir_fd, name, seen=seen[name], job_uid=self.job_uid,
                                                    max_size=self.max_size)
                except Changed:
                    self.scan.retry(name)
                    continue
                except (CheckpointError, OSError) as exc:
                    log.info("a file in a job's checkpoint directory is not copied", path=str(self.directory),
                             why=str(exc))
                    continue
                out.append((name, sha, size))
        finally:
            os.close(dir_fd)
        if out:
            try:
                self.cache.prune(self.keep, {*self.protect(), *(sha for _, sha, _ in out)})
            except OSError as exc:  # the checkpoints are told all the same; the next prune tries again
                log.warning("a job's checkpoint cache not pruned", path=str(self.cache.root), error=str(exc))
        return out

    def _installed(self, seen: dict[str, Observation]) -> dict[str, Observation]:
        """The listed checkpoints still the cache's own files (same inode) in `seen`."""
        out = {}
        for name, sha, _ in self.listed:
            path = self.cache.path(sha)
            with contextlib.suppress(OSError):
                if name in seen and path is not None and os.lstat(path).st_ino == seen[name][2]:
                    out[name] = seen[name]
        return out
