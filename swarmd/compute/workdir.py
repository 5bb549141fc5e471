"""A job's working directory: packed where the user is, shipped once, cached where it runs.

Rules:
- `pack` is deterministic (sorted names, mtime 0, owner 0, gzip without a timestamp), so
  the same tree gives the same sha256 digest and a host that has it is sent nothing.
- It honours `.gitignore` files (the root's and nested ones, git's wildmatch rules), always
  leaves out `.git/`, keeps regular files and directories (symlinks are left out: they
  would point outside the tree on another host), and stops as soon as the archive passes
  the limit, saying so.
- `Cache.put` trusts nothing: the archive must match its digest, and names that are
  absolute, climb out with `..`, or are links or devices are refused. It unpacks beside the
  cache and renames into place, so a tree is whole or absent. Trees are readable, not
  writable, by everyone (ranks run as another user and copy them). The least recently used
  trees beyond `keep` are removed.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_LIMIT = 64 * 1024 * 1024
# tarfile's own guard as well as ours, where this Python has it (3.11.4+; Debian's 3.11.2 not)
SAFE = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


class WorkdirError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Packed:
    digest: str
    data: bytes
    files: int
    size: int


class _Capped(io.BytesIO):
    def __init__(self, limit: int, root: Path) -> None:
        super().__init__()
        self.limit, self.root = limit, root

    def write(self, b) -> int:  # type: ignore[override]
        if self.tell() + len(b) > self.limit:
            raise WorkdirError(f"workdir {self.root} is larger than {self.limit // 2**20} MiB packed; "
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
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w",
                                                                            format=tarfile.PAX_FORMAT) as tar:
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
    data = buf.getvalue()
    return Packed(digest=hashlib.sha256(data).hexdigest(), data=data, files=files, size=size)


class Cache:
    def __init__(self, root: Path, *, keep: int = 16) -> None:
        self.root = root
        self.keep = keep
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o711)

    def path(self, digest: str) -> Path:
        return self.root / digest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_dir()

    def put(self, digest: str, data: bytes) -> Path:
        if hashlib.sha256(data).hexdigest() != digest:
            raise WorkdirError("the workdir does not match its digest")
        final = self.path(digest)
        if final.is_dir():
            os.utime(final)
            return final
        tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=self.root))
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                members = tar.getmembers()
                for m in members:
                    name = Path(m.name)
                    if name.is_absolute() or ".." in name.parts or not (m.isfile() or m.isdir()):
                        raise WorkdirError(f"the workdir holds {m.name!r}: only plain files and "
                                           "directories inside the tree are accepted")
                    m.mode = 0o755 if m.isdir() or m.mode & 0o100 else 0o644
                tar.extractall(tmp, members=members, **SAFE)
            for d, _, _ in os.walk(tmp):
                os.chmod(d, 0o755)
            try:
                tmp.rename(final)
            except OSError:  # another put of the same digest won
                shutil.rmtree(tmp, ignore_errors=True)
        except (tarfile.TarError, EOFError, OSError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise WorkdirError(f"the workdir archive is unreadable: {exc}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._evict(keep=final)
        return final

    def _evict(self, keep: Path) -> None:
        trees = sorted((p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                       key=lambda p: p.stat().st_mtime)
        for old in trees[:max(0, len(trees) - self.keep)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)
