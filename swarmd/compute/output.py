"""Rank output, bounded: a log on disk that keeps its tail, and a bounded queue to a stream.

Rules:
- A log is ``rank<TAB>line`` records, one per line (`records`). `append` writes them with
  one O_APPEND write, never following a symlink; once the file passes `cap` it is rewritten
  to its newest `cap // 2` bytes, cut at a record boundary, and `append` returns how many
  bytes went from its head (readers that keep offsets move theirs on by that much).
- `RankOutput` is a host's side of one job: every line goes to the job's log first (through
  a buffer of at most `FLUSH_BYTES`, flushed by the driver every few milliseconds) and then
  into a queue of at most `queue_bytes` for the coordinator's stream. Each queued line costs
  its length plus `LINE_OVERHEAD` (what a queued line costs in memory even when empty), so
  a job printing empty lines fills the queue like any other. A full queue drops the line
  from the stream only, and counts it per rank; `take` hands the counts on once, so the
  coordinator can say how many lines it missed, and hands out at most `MAX_BATCH_LINES`
  lines at a time. Memory per job is bounded by `queue_bytes + FLUSH_BYTES` whether or not
  the coordinator reads.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from pathlib import Path
from typing import Any

from .events import MAX_BATCH_LINES

MAX_RECORD = 64 * 1024
LOG_CAP = 64 * 1024 * 1024  # per job, on the host and at the coordinator
QUEUE_BYTES = 1024 * 1024  # per job, lines waiting for the coordinator's stream
FLUSH_BYTES = 64 * 1024
LINE_OVERHEAD = 64  # bytes charged per queued line beyond its text: a tuple, a str, a deque slot
_COPY = 1024 * 1024


def records(rank: int, data: bytes) -> bytes:
    """`data` (a line, or several split at newlines) as log records, long lines cut."""
    return b"".join(b"%d\t%s\n" % (rank, line[i:i + MAX_RECORD])
                    for line in data.split(b"\n") for i in range(0, max(len(line), 1), MAX_RECORD))


def append(path: Path, data: bytes, cap: int = LOG_CAP) -> int:
    """Append `data` to the log at `path` (0600, created if absent); returns how many bytes
    were dropped from its head to keep it under `cap`."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return _trim(path, size, cap) if size > cap else 0


def _trim(path: Path, size: int, cap: int) -> int:
    """Rewrite the log as its newest `cap // 2` bytes from a record boundary, copied in
    chunks (a trim costs the daemon a chunk of memory, not half a log)."""
    tmp = path.with_name(path.name + ".trim")
    kept = 0
    src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.lseek(src, size - cap // 2, os.SEEK_SET)
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            first = True
            while chunk := os.read(src, _COPY):
                if first:  # start at the first whole record
                    chunk, first = chunk[chunk.find(b"\n") + 1:], False
                os.write(dst, chunk)
                kept += len(chunk)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    os.replace(tmp, path)
    return size - kept


class RankOutput:
    def __init__(self, log: Path, *, cap: int = LOG_CAP, queue_bytes: int = QUEUE_BYTES) -> None:
        self.log = log
        self.cap = cap
        self.queue_bytes = queue_bytes
        self._disk = bytearray()
        self._queue: deque[tuple[int, str, int]] = deque()  # rank, line, its bytes
        self._queued = 0
        self._dropped: Counter[int] = Counter()
        self.dropped_total = 0
        self.log_error: str | None = None

    def add(self, rank: int, line: bytes) -> None:
        self._disk += records(rank, line)
        if len(self._disk) >= FLUSH_BYTES:
            self.flush()
        cost = len(line) + LINE_OVERHEAD
        if self._queued + cost > self.queue_bytes:
            self._dropped[rank] += 1
            self.dropped_total += 1
            return
        self._queue.append((rank, line.decode("utf-8", "replace"), cost))
        self._queued += cost

    def flush(self) -> None:
        if not self._disk:
            return
        data, self._disk = bytes(self._disk), bytearray()
        try:
            append(self.log, data, self.cap)
        except OSError as exc:  # a full disk costs the host's copy, never the job
            self.log_error = f"{exc.strerror}: {self.log}"

    @property
    def pending(self) -> bool:
        return bool(self._queue or self._dropped)

    def replay(self, batch_bytes: int) -> Replay:
        """A successor attached (sink.py): every line so far goes to it from the log, once, so
        what the queue holds (and the event a gone coordinator may never have read) is
        dropped; lines from now on queue as ever."""
        self.flush()
        self._queue.clear()
        self._queued = 0
        self._dropped.clear()
        try:
            end = os.stat(self.log).st_size
        except OSError:
            end = 0
        return Replay(self.log, end, batch_bytes)

    def take(self, max_bytes: int) -> tuple[list[list[Any]], list[list[int]]]:
        """Queued lines up to about `max_bytes` and at most `MAX_BATCH_LINES`, and [rank,
        lines dropped] since last asked."""
        batch: list[list[Any]] = []
        size = 0
        while self._queue and (not batch or size < max_bytes) and len(batch) < MAX_BATCH_LINES:
            rank, text, n = self._queue.popleft()
            batch.append([rank, text])
            size += n
        self._queued -= size
        dropped = [[r, n] for r, n in sorted(self._dropped.items())]
        self._dropped.clear()
        return batch, dropped


class Replay:
    """A host's log of its ranks' output from its start to byte `end`, as ``out`` events of at
    most `batch_bytes` and MAX_BATCH_LINES lines each, read a batch at a time."""

    def __init__(self, log: Path, end: int, batch_bytes: int) -> None:
        self.log, self.end, self.batch_bytes = log, end, batch_bytes
        self.pos = 0

    def next(self) -> dict[str, Any] | None:
        """The next batch, or None when the log up to `end` has been told (or is unreadable)."""
        if self.pos >= self.end:
            return None
        try:
            with open(self.log, "rb") as f:
                f.seek(self.pos)
                data = f.read(min(self.batch_bytes, self.end - self.pos))
        except OSError:
            self.pos = self.end
            return None
        cut = data.rfind(b"\n") + 1
        if cut == 0:  # one record longer than a batch: cannot be (records are at most MAX_RECORD)
            self.pos = self.end
            return None
        lines: list[list[Any]] = []
        used = 0
        for record in data[:cut].split(b"\n")[:-1]:
            if len(lines) >= MAX_BATCH_LINES:
                break
            used += len(record) + 1
            head, tab, text = record.partition(b"\t")
            if tab and head.isdigit():
                lines.append([int(head), text.decode("utf-8", "replace")])
        self.pos += used
        return {"out": lines} if lines else self.next()
