"""Garbage collection of finished jobs: what a host and a coordinator keep, and for how long.

Rules:
- A host's job directory (`jobs_dir/<job id>-<coordinator hash>`, ids.host_dir, with the
  32 hex digits of today or the 8 of older daemons, or a bare job id from before) goes `retention` seconds after its job finished (the worker stamps
  its mtime then), unless the job still holds a reservation here. Only names of those
  formats are touched: whatever else an operator keeps in
  `jobs_dir` stays. Trees are removed without following links.
- The coordinator's records and logs of jobs that ended more than `retention` ago go too
  (store.prune).
- Uploaded workdir archives (STATE_DIR/archives/<digest>.tar.gz) are kept least recently
  used first up to `ARCHIVES_KEEP` files and `ARCHIVES_BYTES`, never one a job still being
  coordinated needs; `.part` files are half-finished uploads: all go at start (no upload
  outlives the daemon), and any untouched for `PART_AGE` afterwards.
- `collect` runs once at start and then every `period` seconds (sooner for a retention
  shorter than four periods); each step logs what it
  removed and a failure is logged and retried at the next round, never raised.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path

import structlog
import trio

from .. import trees
from ..ids import is_host_dir, is_job_id

log = structlog.get_logger("swarmd.jobs")

PERIOD = 3600.0  # seconds between rounds; retention is counted in days
ARCHIVES_KEEP = 32
ARCHIVES_BYTES = 4 * 1024**3
PART_AGE = 24 * 3600.0
ARCHIVE_SUFFIX = ".tar.gz"


def job_dirs(jobs_dir: Path, *, keep: Collection[str], before: float) -> list[str]:
    """Remove job directories last changed before `before`, except those in `keep`."""
    removed = []
    for entry in _entries(jobs_dir):
        if not (is_host_dir(entry.name) or is_job_id(entry.name)) or entry.name in keep:
            continue
        try:
            st = entry.lstat()
            if st.st_mtime >= before:
                continue
            trees.remove(entry)  # any depth, links not followed
            removed.append(entry.name)
        except OSError as exc:
            log.warning("cannot remove a finished job's directory", path=str(entry), error=str(exc))
    return sorted(removed)


def archives(archive_dir: Path, *, keep: Collection[str], max_count: int = ARCHIVES_KEEP,
             max_bytes: int = ARCHIVES_BYTES) -> list[str]:
    """Remove the least recently used archives beyond `max_count` files or `max_bytes`,
    never one whose digest is in `keep`. Returns the digests removed."""
    found = []
    for entry in _entries(archive_dir):
        if entry.name.endswith(ARCHIVE_SUFFIX) and entry.is_file() and not entry.is_symlink():
            st = entry.stat()
            found.append((st.st_mtime_ns, st.st_size, entry))
    found.sort(key=lambda f: f[0], reverse=True)  # newest first
    removed, count, size = [], 0, 0
    for _, nbytes, entry in found:
        digest = entry.name.removesuffix(ARCHIVE_SUFFIX)
        if digest not in keep and (count >= max_count or size + nbytes > max_bytes):
            entry.unlink(missing_ok=True)
            removed.append(digest)
            continue
        count += 1
        size += nbytes
    return sorted(removed)


def parts(archive_dir: Path, *, before: float | None = None) -> list[str]:
    """Remove `.part` files (unfinished uploads) last written before `before`, or all."""
    removed = []
    for entry in _entries(archive_dir):
        if entry.name.endswith(".part") and not entry.is_dir():
            if before is None or entry.lstat().st_mtime < before:
                entry.unlink(missing_ok=True)
                removed.append(entry.name)
    return sorted(removed)


def _entries(d: Path) -> list[Path]:
    try:
        return list(d.iterdir())
    except FileNotFoundError:
        return []


async def collect(*, jobs_dir: Path, archive_dir: Path, retention: float, held: Callable[[], Collection[str]],
                  needed: Callable[[], Collection[str]], prune: Callable[[float], list[str]],
                  period: float = PERIOD) -> None:
    """Forever: remove what `retention` no longer covers. `held` names the jobs this host
    still holds, `needed` the archives live jobs still need, `prune` forgets the
    coordinator's records of jobs ended before a time."""
    period = min(period, max(60.0, retention / 4))  # a short retention is kept to, roughly
    while True:
        now = time.time()
        try:
            busy, keep = set(held()), set(needed())  # read here, not in the thread
            dirs = await trio.to_thread.run_sync(lambda: job_dirs(jobs_dir, keep=busy, before=now - retention))
            pruned = prune(now - retention)
            old = await trio.to_thread.run_sync(lambda: archives(archive_dir, keep=keep))
            stale = await trio.to_thread.run_sync(lambda: parts(archive_dir, before=now - PART_AGE))
            if dirs or pruned or old or stale:
                log.info("finished jobs collected", dirs=len(dirs), records=len(pruned), archives=len(old),
                         parts=len(stale))
        except Exception as exc:  # the collector outlives any one bad directory
            log.warning("garbage collection failed; trying again later", error=f"{exc.__class__.__name__}: {exc}")
        await trio.sleep(period)

