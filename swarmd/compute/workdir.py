"""A job's working directory: packed where the user is, shipped once, cached where it runs.

Rules:
- `pack` is deterministic (sorted names, mtime 0, owner 0, gzip without a timestamp), so
  the same tree gives the same sha256 digest and a host that has it is sent nothing.
- It honours `.gitignore` files (the root's and nested ones, git's wildmatch rules), always
  leaves out `.git/`, keeps regular files and directories (symlinks, inside the tree or
  not, are left out: one that points outside would not exist on another host, and one that
  points inside duplicates what is packed anyway), and stops as soon as the archive passes
  the limit, saying so.
- `Cache.put` trusts nothing: the archive must match its digest, its names must stay inside
  the tree as plain files and directories (no absolute names, `..`, links or devices), and
  it may not unpack to more than `unpacked_limit` bytes. It unpacks beside the cache and
  renames into place, so a tree is whole or absent, and a second put of the same digest,
  even a concurrent one, changes nothing.
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
  killed daemon at start.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import tarfile
import tempfile
import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

DEFAULT_LIMIT = 64 * 1024 * 1024
# Source and configs compress 4-10x: 16x the packed limit leaves room for honest trees and
# none for a gzip bomb (zeros compress about 1000x).
UNPACKED_LIMIT = 16 * DEFAULT_LIMIT
# tarfile's own guard as well as ours, where this Python has it (3.11.4+; Debian's 3.11.2 not)
SAFE = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
_DIGEST = re.compile(r"[0-9a-f]{64}")
_UNPACKING = ".unpack-"


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

    def walk(d: Path, rules: list[tuple[Path, pathspec.PathSpec]]) -> None:
        gi = d / ".gitignore"
        if gi.is_file():
            lines = gi.read_text(errors="replace").splitlines()
            rules = [*rules, (d, pathspec.PathSpec.from_lines("gitwildmatch", lines))]
        for entry in sorted(d.iterdir(), key=lambda p: p.name):
            if entry.is_symlink() or entry.name == ".git":
                continue
            if entry.is_dir():
                if not ignored(rules, entry, True):
                    out.append(entry)
                    walk(entry, rules)
            elif entry.is_file() and not ignored(rules, entry, False):
                out.append(entry)

    walk(root, [])
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
    def __init__(self, root: Path, *, keep: int = 16, unpacked_limit: int = UNPACKED_LIMIT) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = root
        self.keep = keep
        self.unpacked_limit = unpacked_limit
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()  # put, hold and eviction run in worker threads
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        root.chmod(0o700)
        for junk in root.glob(_UNPACKING + "*"):
            if junk.is_dir() and not junk.is_symlink():
                shutil.rmtree(junk, ignore_errors=True)
            else:
                junk.unlink(missing_ok=True)

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
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        self._touch(final)
        self._evict()
        return final

    def _unpack(self, source: bytes | Path, into: Path) -> None:
        members, total = [], 0
        try:
            with (tarfile.open(fileobj=io.BytesIO(source), mode="r:gz") if isinstance(source, bytes)
                  else tarfile.open(name=source, mode="r:gz")) as tar:
                for m in tar:
                    name = Path(m.name)
                    if name.is_absolute() or ".." in name.parts or not (m.isfile() or m.isdir()):
                        raise WorkdirError(f"the workdir holds {m.name!r}: only plain files and "
                                           "directories inside the tree are accepted")
                    total += m.size + tarfile.BLOCKSIZE  # a header's block too: no million empty files
                    if total > self.unpacked_limit:
                        raise WorkdirError(f"the workdir unpacks to more than {_size(self.unpacked_limit)}")
                    m.mode = 0o755 if m.isdir() or m.mode & 0o100 else 0o644
                    m.uid, m.gid, m.uname, m.gname = os.geteuid(), os.getegid(), "", ""
                    members.append(m)
                tar.extractall(into, members=members, **SAFE)
        except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise WorkdirError(f"the workdir archive is unreadable: {exc}") from None
        for d, _, _ in os.walk(into):
            os.chmod(d, 0o755)

    def _touch(self, tree: Path) -> bool:
        try:
            os.utime(tree)
        except FileNotFoundError:
            return False
        return tree.is_dir()

    def _evict(self) -> None:
        with self._lock:
            trees = sorted((p for p in self.root.iterdir() if _DIGEST.fullmatch(p.name)),
                           key=lambda p: p.stat().st_mtime_ns)
            spare = [p for p in trees if p.name not in self._held]
            for old in spare[:max(0, len(trees) - self.keep)]:
                shutil.rmtree(old, ignore_errors=True)
