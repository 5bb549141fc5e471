"""A job's working directory: packed where the user is, shipped once, cached where it runs.

Rules:
- `pack` is deterministic (sorted names, mtime 0, owner 0, gzip without a timestamp), so
  the same tree gives the same sha256 digest and a host that has it is sent nothing.
- It honours `.gitignore` files (the root's and nested ones, git's wildmatch rules), always
  leaves out `.git/`, keeps regular files and directories (symlinks, inside the tree or
  not, are left out: one that points outside would not exist on another host, and one that
  points inside duplicates what is packed anyway), and stops as soon as the archive passes
  the limit, or the tree what a host accepts (`MAX_DEPTH`, `MAX_ENTRIES`), saying so.
- `Cache.put` trusts nothing: the archive must match its digest, its names must stay inside
  the tree as plain files and directories (no absolute names, `..`, links or devices), at
  most `MAX_DEPTH` names deep, at most `max_entries` of them, and it may not unpack to more
  than `unpacked_limit` bytes, each entry counted as at least one filesystem block
  (`ENTRY_FLOOR`: an empty file costs an inode and a block, not the 512 bytes of its
  header), none with an extended (pax, long-name) header over `MAX_HEADER`. The archive is
  read as a stream twice: once to check every header, creating nothing, then to create
  each entry (its header checked again); no list of its members is kept (tarfile keeps
  one: two million empty files held ~0.9 GB, issue 23, finding 7). It unpacks beside the cache and renames into place, so a tree is whole or absent, and a
  second put of the same digest, even a concurrent one, changes nothing.
- Digests given to `has`, `path` and `hold` come from peers too: only 64 lowercase hex
  digits name a tree.
- Trees are the daemon's own (the cache directory is 0700, owned by whoever unpacked them)
  and are copied out for each job; their modes (directories 0755, files 0644 or 0755 for
  the executable ones) are readable, not writable, by the unprivileged user a copy is
  handed to.
- The least recently used trees beyond `keep` are removed after each put; `has`, `hold` and
  `put` count as use, and a tree inside a `hold` block or `pin`ned (a reservation here is
  to use it) is never removed.
- A peer's upload is spooled to a file beside the trees (`spool`), never held in memory,
  and put with `put_file`, which hashes and unpacks it from disk.
- One Cache per directory: it clears half-unpacked trees and half-received uploads of a
  killed daemon at start. That clean-up never stops the daemon: what cannot be removed is
  logged and set aside (renamed `.stuck-*`, tried again at the next start). Trees are
  removed and copied only through trees.py, which walks to any depth (a tree 1,200 levels
  deep made `shutil.rmtree` raise RecursionError here at every start, issue 23, finding 1).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import re
import shutil
import stat
import tarfile
import tempfile
import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, TypeAlias

import structlog

from . import trees

log = structlog.get_logger("swarmd.jobs")

DEFAULT_LIMIT = 64 * 1024 * 1024
# Source and configs compress 4-10x: 16x the packed limit leaves room for honest trees and
# none for a gzip bomb (zeros compress about 1000x).
UNPACKED_LIMIT = 16 * DEFAULT_LIMIT
# Names in a tree: deep source trees (Java packages, a vendored node_modules) reach 20-30
# levels; 64 leaves room for them and is far from anything that strains a walk (Python's
# recursion limit of 1,000, PATH_MAX of 4,096 bytes).
MAX_DEPTH = 64
# Entries in a tree: a large repository's checkout (CPython: ~5,000 files; the Linux
# kernel: ~90,000, over UNPACKED_LIMIT anyway) fits; each costs an inode and a block.
MAX_ENTRIES = 100_000
ENTRY_FLOOR = 4096  # bytes counted for any entry, at least: one block of ext4 and xfs
# A pax header of one entry: a name MAX_DEPTH names of 255 bytes deep is 16 KiB
MAX_HEADER = 64 * 1024
_EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
             tarfile.GNUTYPE_LONGLINK)
_DIGEST = re.compile(r"[0-9a-f]{64}")
_UNPACKING = ".unpack-"
_STUCK = ".stuck-"  # a leftover the start-up clean-up could not remove, set aside
_Members: TypeAlias = Iterator[tuple[tarfile.TarInfo, tuple[str, ...]]]  # each checked, with its name's parts


class WorkdirError(Exception):
    pass


def is_digest(value: object) -> bool:
    """Whether `value` names a tree: 64 lowercase hex digits."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


@dataclass(frozen=True, slots=True)
class Packed:
    digest: str
    data: bytes
    files: int
    size: int


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n} bytes"


class _Capped(io.BytesIO):
    def __init__(self, limit: int, root: Path) -> None:
        super().__init__()
        self.limit, self.root = limit, root

    def write(self, b) -> int:  # type: ignore[override]
        if self.tell() + len(b) > self.limit:
            raise WorkdirError(f"workdir {self.root} is larger than {_size(self.limit)} packed; "
                               "add what the job does not need to .gitignore")
        return super().write(b)


def _files(root: Path) -> list[Path]:
    import pathspec

    out: list[Path] = []

    def ignored(rules: list[tuple[Path, pathspec.PathSpec]], path: Path, is_dir: bool) -> bool:
        """git's order: the deepest .gitignore that has a say decides."""
        verdict = False
        for base, spec in rules:
            result = spec.check_file(path.relative_to(base).as_posix() + ("/" if is_dir else ""))
            if result.include is not None:
                verdict = result.include
        return verdict

    def add(entry: Path, depth: int) -> None:
        """What a host would refuse (Cache.put), said here before anything is packed."""
        if depth > MAX_DEPTH:
            raise WorkdirError(f"workdir {root}: {entry.relative_to(root)} is more than {MAX_DEPTH} names "
                               "deep; add what the job does not need to .gitignore")
        if len(out) >= MAX_ENTRIES:
            raise WorkdirError(f"workdir {root} holds more than {MAX_ENTRIES} files and directories; "
                               "add what the job does not need to .gitignore")
        out.append(entry)

    def walk(d: Path, rules: list[tuple[Path, pathspec.PathSpec]], depth: int) -> None:
        gi = d / ".gitignore"
        if gi.is_file():
            lines = gi.read_text(errors="replace").splitlines()
            rules = [*rules, (d, pathspec.PathSpec.from_lines("gitwildmatch", lines))]
        for entry in sorted(d.iterdir(), key=lambda p: p.name):
            if entry.is_symlink() or entry.name == ".git":
                continue
            if entry.is_dir():
                if not ignored(rules, entry, True):
                    add(entry, depth)
                    walk(entry, rules, depth + 1)
            elif entry.is_file() and not ignored(rules, entry, False):
                add(entry, depth)

    walk(root, [], 1)
    return out


def pack(root: Path, limit: int = DEFAULT_LIMIT) -> Packed:
    root = root.expanduser()
    if not root.is_dir():
        raise WorkdirError(f"workdir {root}: {'not a directory' if root.exists() else 'no such directory'}")
    buf = _Capped(limit, root)
    files = size = 0
    try:
        with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in _files(root):
                info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                info.mode = 0o755 if path.is_dir() or info.mode & 0o100 else 0o644
                if path.is_dir():
                    tar.addfile(info)
                else:
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                    files += 1
                    size += info.size
    except OSError as exc:
        raise WorkdirError(f"workdir {root}: cannot read it: {exc}") from None
    data = buf.getvalue()
    return Packed(digest=hashlib.sha256(data).hexdigest(), data=data, files=files, size=size)


class Cache:
    def __init__(self, root: Path, *, keep: int = 16, unpacked_limit: int = UNPACKED_LIMIT,
                 max_entries: int = MAX_ENTRIES) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = root
        self.keep = keep
        self.unpacked_limit = unpacked_limit
        self.max_entries = max_entries
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()  # put, hold and eviction run in worker threads
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        root.chmod(0o700)
        self._clear_leftovers()

    def _clear_leftovers(self) -> None:
        """Half-unpacked trees and half-received uploads of a killed daemon, and what an
        earlier start set aside. Runs while the daemon starts: nothing here may stop it."""
        try:
            junk = sorted(p for p in self.root.iterdir() if p.name.startswith((_UNPACKING, _STUCK)))
        except OSError as exc:
            log.warning("cannot list the workdir cache for leftovers", path=str(self.root), error=str(exc))
            return
        for path in junk:
            try:
                trees.remove(path)
                continue
            except Exception as exc:  # whatever it is, the daemon starts
                log.warning("cannot remove a leftover of the workdir cache; set aside", path=str(path),
                            error=f"{exc.__class__.__name__}: {exc}")
            if path.name.startswith(_UNPACKING):  # named for what it is, for an operator's ls
                try:
                    path.rename(path.with_name(_STUCK + path.name.removeprefix(_UNPACKING)))
                except OSError as exc:
                    log.warning("cannot set a leftover of the workdir cache aside", path=str(path), error=str(exc))

    def path(self, digest: str) -> Path:
        if not _DIGEST.fullmatch(digest):
            raise WorkdirError(f"{digest[:80]!r} is not a workdir digest (64 lowercase hex digits)")
        return self.root / digest

    def has(self, digest: str) -> bool:
        """Whether the tree is here; asking counts as use."""
        if not _DIGEST.fullmatch(digest):
            return False
        return self._touch(self.root / digest)

    @contextmanager
    def hold(self, digest: str) -> Iterator[Path]:
        """The tree, kept from eviction until the block ends (while a job copies it out)."""
        path = self.path(digest)
        with self._lock:
            if not self._touch(path):
                raise WorkdirError(f"workdir {digest[:12]} is not in the cache")
            self._held[digest] += 1
        try:
            yield path
        finally:
            with self._lock:
                self._held[digest] -= 1
                if not self._held[digest]:
                    del self._held[digest]

    def pin(self, digest: str) -> bool:
        """Keep the tree from eviction until `unpin`; False when it is not here."""
        path = self.path(digest)
        with self._lock:
            if not self._touch(path):
                return False
            self._held[digest] += 1
        return True

    def unpin(self, digest: str) -> None:
        with self._lock:
            self._held[digest] -= 1
            if self._held[digest] <= 0:
                del self._held[digest]

    def spool(self) -> IO[bytes]:
        """A file for an upload to arrive in, removed when closed."""
        return tempfile.NamedTemporaryFile(prefix=_UNPACKING + "upload-", dir=self.root)

    def put_file(self, digest: str, archive: Path) -> Path:
        """`put` of an archive on disk, read in chunks."""
        h = hashlib.sha256()
        with open(archive, "rb") as f:
            while chunk := f.read(1024 * 1024):
                h.update(chunk)
        return self._put(digest, h.hexdigest(), archive)

    def put(self, digest: str, data: bytes) -> Path:
        return self._put(digest, hashlib.sha256(data).hexdigest(), data)

    def _put(self, digest: str, actual: str, source: bytes | Path) -> Path:
        final = self.path(digest)
        if actual != digest:
            raise WorkdirError("the workdir does not match its digest")
        if self._touch(final):
            return final
        self._check(source)  # before anything is created
        tmp = Path(tempfile.mkdtemp(prefix=_UNPACKING, dir=self.root))
        try:
            self._unpack(source, tmp)
            try:
                tmp.rename(final)
            except OSError:
                if not final.is_dir():  # else another put of the same digest won
                    raise
        except OSError as exc:
            raise WorkdirError(f"cannot unpack a workdir into {self.root}: {exc}") from None
        finally:
            try:
                trees.remove(tmp)  # nothing there when it was renamed into place
            except OSError as exc:  # the next start tries again; this put's own outcome stands
                log.warning("cannot remove a half-unpacked workdir", path=str(tmp), error=str(exc))
        self._touch(final)
        self._evict()
        return final

    @contextmanager
    def _members(self, source: bytes | Path) -> Iterator[tuple[tarfile.TarFile, _Members]]:
        """The archive as a stream of checked members (read a member's data before the
        next); WorkdirError for the first that breaks a rule, or an archive that cannot be
        read, also while a member's data is."""
        def stream(tar: tarfile.TarFile) -> _Members:
            entries = total = 0
            while (m := tar.next()) is not None:
                tar.members.clear()  # tarfile keeps every header it read; we need none of them again
                if m.size < 0:  # base-256 sizes can be negative
                    raise WorkdirError(f"the workdir archive is unreadable: {_shown(m.name)} has a negative size")
                entries += 1
                if entries > self.max_entries:
                    raise WorkdirError(f"the workdir holds more than {self.max_entries} files and directories")
                total += max(ENTRY_FLOOR, -(-m.size // ENTRY_FLOOR) * ENTRY_FLOOR)
                if total > self.unpacked_limit:
                    raise WorkdirError(f"the workdir unpacks to more than {_size(self.unpacked_limit)} "
                                       f"(each file or directory counted as at least {ENTRY_FLOOR} bytes)")
                yield m, _checked_name(m)

        try:
            # gzip's reader, not tarfile's "r|gz": that one re-slices all it decompressed at each
            # 512-byte read, ~100 us a header of an archive that compresses 1000x (measured)
            with (gzip.GzipFile(fileobj=io.BytesIO(source)) if isinstance(source, bytes)
                  else gzip.GzipFile(source)) as gz, \
                    tarfile.open(fileobj=gz, mode="r|", tarinfo=_Header) as tar:
                yield tar, stream(tar)
        except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise WorkdirError(f"the workdir archive is unreadable: {exc}") from None

    def _check(self, source: bytes | Path) -> None:
        with self._members(source) as (_, members):
            for _ in members:
                pass

    def _unpack(self, source: bytes | Path, into: Path) -> None:
        """Create each entry under `into` (the daemon's, nobody else reaches in), with the
        cache's modes and the daemon as owner; a name given twice is refused."""
        with self._members(source) as (tar, members):
            for m, parts in members:
                if not parts:  # "." or "./": the tree itself
                    continue
                path = into.joinpath(*parts)
                try:
                    _create(tar, m, path)
                except FileNotFoundError:  # named before its directory, or without one
                    for parent in reversed(path.parents[:len(parts) - 1]):
                        with contextlib.suppress(FileExistsError):
                            _mkdir(parent)
                    _create(tar, m, path)
        os.chmod(into, 0o755)

    def _touch(self, tree: Path) -> bool:
        try:
            os.utime(tree)
        except FileNotFoundError:
            return False
        return tree.is_dir()

    def _evict(self) -> None:
        with self._lock:
            trees_here = sorted((p for p in self.root.iterdir() if _DIGEST.fullmatch(p.name)),
                                key=lambda p: p.stat().st_mtime_ns)
            spare = [p for p in trees_here if p.name not in self._held]
            for old in spare[:max(0, len(trees_here) - self.keep)]:
                try:
                    trees.remove(old)
                except OSError as exc:  # tried again after the next put
                    log.warning("cannot evict a workdir", path=str(old), error=str(exc))


class _Header(tarfile.TarInfo):
    """tarfile reads a pax or GNU long-name header whole into memory, whatever size it
    claims (a gigabyte of them packs into a megabyte): refused past MAX_HEADER first."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:  # tarfile's hook for each header
        if self.type in _EXTENDED and self.size > MAX_HEADER:
            raise WorkdirError(f"the workdir archive has an extended header of {self.size} bytes "
                               f"(at most {MAX_HEADER})")
        return super()._proc_member(tar)  # type: ignore[misc]


def _checked_name(m: tarfile.TarInfo) -> tuple[str, ...]:
    """The parts of a member's name: relative, inside the tree, a plain file or directory,
    at most MAX_DEPTH deep."""
    name = PurePosixPath(m.name)
    if name.is_absolute() or ".." in name.parts or not (m.isfile() or m.isdir()) or (m.isfile() and not name.parts):
        raise WorkdirError(f"the workdir holds {_shown(m.name)}: only plain files and "
                           "directories inside the tree are accepted")
    if len(name.parts) > MAX_DEPTH:
        raise WorkdirError(f"the workdir holds {_shown(m.name)}, {len(name.parts)} names deep: "
                           f"at most {MAX_DEPTH} are accepted")
    return name.parts


def _create(tar: tarfile.TarFile, m: tarfile.TarInfo, path: Path) -> None:
    """One entry, new (a directory may come again), with the cache's modes: directories
    0755, files 0644 or 0755 for an executable one."""
    if m.isdir():
        try:
            _mkdir(path)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise _twice(m) from None
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise _twice(m) from None
    with open(fd, "wb") as out:
        data = tar.extractfile(m)
        if data is not None:
            shutil.copyfileobj(data, out, 1024 * 1024)
        os.fchmod(fd, 0o755 if m.mode & 0o100 else 0o644)


def _mkdir(path: Path) -> None:
    os.mkdir(path)
    os.chmod(path, 0o755)  # whatever the umask took


def _shown(name: str) -> str:
    return repr(name) if len(name) <= 80 else f"{name[:40]!r}…{name[-30:]!r}"


def _twice(m: tarfile.TarInfo) -> WorkdirError:
    return WorkdirError(f"the workdir names {_shown(m.name)} twice")
