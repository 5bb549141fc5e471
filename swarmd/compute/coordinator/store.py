"""Jobs that survive a restart: a SQLite table of jobs and ranks, and each job's output.

Rules:
- STATE_DIR/jobs.sqlite3 (WAL; every change committed at once) holds jobs and ranks;
  STATE_DIR/jobs/<id>/output.log holds the ranks' output in arrival order, one
  ``rank<TAB>line`` record per line (a line longer than 64 KiB is cut into records of that
  size), so a reader follows it with a byte offset as its cursor and sees only whole
  records. Each append is one write, so a killed daemon loses nothing it had appended, and
  the database stays consistent; a torn record after a power loss is skipped by readers.
- A job's log keeps its newest `output.LOG_CAP` bytes (output.py trims its head): offsets
  stay those of the whole output, and a reader behind the trimmed head skips to it.
- `prune` deletes jobs that ended before a time, their ranks, hosts and logs.
- A job's `attempts` rows are its runs, one per (re)start: nodes, start, end, why it ended,
  the checkpoint it resumed from, and when each step of its restart happened.
- A job's `hosts` rows hold what each host reported: the sandbox the ranks had there, and
  their peak memory and CPU time.
- Files are 0600 and directories 0700: they are the daemon's.
- A job in a terminal state never leaves it; after that only fields still unset may be
  filled in. States are those of `run.STATES`; any other is a ValueError.
- `recover` at start marks every job that was still going as failed, with the reason: the
  process that drove it is gone.
- Ids are ids.py's (12 lowercase characters, time-ordered), strictly increasing within a
  store, and can be given by a unique prefix of at least 4 characters.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sqlite3
import time
from dataclasses import dataclass, fields
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from .. import ids, output
from .run import STATES, TERMINAL

MIN_PREFIX = 4
MAX_RECORD = output.MAX_RECORD
_READ = 4 * 1024 * 1024  # at most this much output per read_log: a follower comes back for more

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT, spec TEXT NOT NULL, state TEXT NOT NULL, coordinator TEXT NOT NULL,
    submitted_by INTEGER NOT NULL, created REAL NOT NULL, started REAL, ended REAL, exit_code INTEGER,
    reason TEXT, nodes TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ranks (
    job_id TEXT NOT NULL, rank INTEGER NOT NULL, node TEXT NOT NULL, state TEXT NOT NULL, exit_code INTEGER,
    PRIMARY KEY (job_id, rank)
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT NOT NULL, n INTEGER NOT NULL, nodes TEXT NOT NULL, started REAL, ended REAL, why TEXT,
    resumed_from TEXT, times TEXT NOT NULL, groups TEXT, PRIMARY KEY (job_id, n)
);
CREATE TABLE IF NOT EXISTS hosts (
    job_id TEXT NOT NULL, node TEXT NOT NULL, sandbox TEXT, peak_memory INTEGER, cpu_seconds REAL,
    PRIMARY KEY (job_id, node)
);
"""


@dataclass(slots=True, kw_only=True)
class JobRow:
    id: str
    name: str | None
    spec: dict[str, Any]
    state: str
    coordinator: str
    submitted_by: int
    created: float
    started: float | None
    ended: float | None
    exit_code: int | None
    reason: str | None
    nodes: list[str]


@dataclass(slots=True, kw_only=True)
class RankRow:
    job_id: str
    rank: int
    node: str
    state: str
    exit_code: int | None


_COLUMNS = [f.name for f in fields(JobRow)]
_ATTEMPT_TIMES = ("placed", "detected", "reserved", "checkpoints_ready")


class JobStore:
    def __init__(self, state_dir: Path, *, log_cap: int = output.LOG_CAP) -> None:
        self.log_cap = log_cap
        self.dir = state_dir / "jobs"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_dir / "jobs.sqlite3"
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))  # SQLite gives its -wal and -shm the same mode
        os.chmod(path, 0o600)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL: consistent after any crash, durable past a killed process
        self.db.executescript(_SCHEMA)
        if "ray" not in {r[1] for r in self.db.execute("PRAGMA table_info(hosts)")}:  # a store from before Ray jobs
            self.db.execute("ALTER TABLE hosts ADD COLUMN ray TEXT")
        if "groups" not in {r[1] for r in self.db.execute("PRAGMA table_info(attempts)")}:  # from before groups
            self.db.execute("ALTER TABLE attempts ADD COLUMN groups TEXT")
        self._last = 0  # ids only grow: two jobs in one millisecond still differ
        self._trimmed: dict[str, int] = {}  # job -> bytes trimmed from its log's head in this run

    def close(self) -> None:
        self.db.close()

    def new_id(self) -> str:
        n = max((int(time.time() * 1000) << ids.RANDOM_BITS) | secrets.randbits(ids.RANDOM_BITS), self._last + 1)
        self._last = n
        return ids.encode(n)

    def add(self, job: JobRow) -> None:
        _check_state(job.state)
        values = [_encode(k, getattr(job, k)) for k in _COLUMNS]
        self.db.execute(f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})", values)

    def update(self, job_id: str, **changes: Any) -> JobRow:
        unknown = set(changes) - (set(_COLUMNS) - {"id"})
        if unknown:
            raise TypeError(f"JobStore.update: cannot set {', '.join(sorted(unknown))}")
        if "state" in changes:
            _check_state(changes["state"])
        row = self.get(job_id)
        if row is None:
            raise KeyError(job_id)
        if row.state in TERMINAL:
            changes = {k: v for k, v in changes.items() if getattr(row, k) is None}
        changes = {k: v for k, v in changes.items() if getattr(row, k) != v}
        if changes:
            sets = ", ".join(f"{k} = ?" for k in changes)
            values = [_encode(k, v) for k, v in changes.items()]
            self.db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", [*values, row.id])
            for k, v in changes.items():
                setattr(row, k, v)
        return row

    def get(self, job_id: str, *, submitted_by: int | None = None) -> JobRow | None:
        """By id or by a unique prefix of at least 4 characters; ValueError if ambiguous. A
        prefix matches only the jobs of uid `submitted_by` when given (a whole id, any job)."""
        row = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None and len(job_id) >= MIN_PREFIX and job_id.isascii() and job_id.isalnum():
            mine = " AND submitted_by = ?" if submitted_by is not None else ""
            rows = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id LIKE ?{mine} LIMIT 2",
                                   (job_id.lower() + "%", *([] if submitted_by is None else [submitted_by]))).fetchall()
            if len(rows) > 1:
                raise ValueError(f"{job_id!r} matches more than one job; give more of the id")
            row = rows[0] if rows else None
        return None if row is None else _row(row)

    def list(self, limit: int = 50, *, submitted_by: int | None = None) -> list[JobRow]:
        """Newest first; only the jobs of uid `submitted_by` when given."""
        where, args = ("WHERE submitted_by = ? ", [submitted_by]) if submitted_by is not None else ("", [])
        rows = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs {where}ORDER BY created DESC, id DESC LIMIT ?",
                               (*args, max(1, min(limit, 1000)))).fetchall()
        return [_row(r) for r in rows]

    def set_rank(self, row: RankRow) -> None:
        self.db.execute("INSERT OR REPLACE INTO ranks VALUES (?, ?, ?, ?, ?)",
                        (row.job_id, row.rank, row.node, row.state, row.exit_code))

    def ranks(self, job_id: str) -> list[RankRow]:
        rows = self.db.execute("SELECT job_id, rank, node, state, exit_code FROM ranks WHERE job_id = ? ORDER BY rank",
                               (job_id,)).fetchall()
        return [RankRow(job_id=r[0], rank=r[1], node=r[2], state=r[3], exit_code=r[4]) for r in rows]

    def set_attempt(self, job_id: str, attempt: dict[str, Any]) -> None:
        """An attempt as run.Attempt.to_dict gives it; written again as it changes (its groups kept)."""
        times = {k: attempt.get(k) for k in _ATTEMPT_TIMES}
        self.db.execute("INSERT INTO attempts (job_id, n, nodes, started, ended, why, resumed_from, times) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, n) DO UPDATE SET nodes = excluded.nodes, "
                        "started = excluded.started, ended = excluded.ended, why = excluded.why, "
                        "resumed_from = excluded.resumed_from, times = excluded.times",
                        (job_id, attempt["n"], json.dumps(list(attempt["nodes"])), attempt.get("started"),
                         attempt.get("ended"), attempt.get("why"), attempt.get("resumed_from"), json.dumps(times)))

    def set_groups(self, job_id: str, n: int, groups: dict[str, Any] | None) -> None:
        """Attempt `n`'s latency groups (the coordinator's ``_grouping``), once its attempt row is written."""
        self.db.execute("UPDATE attempts SET groups = ? WHERE job_id = ? AND n = ?",
                        (None if groups is None else json.dumps(groups), job_id, n))

    def groups(self, job_id: str) -> dict[str, Any] | None:
        """The latency groups of the job's latest attempt that had them: shown after it ended."""
        row = self.db.execute("SELECT groups FROM attempts WHERE job_id = ? AND groups IS NOT NULL "
                              "ORDER BY n DESC LIMIT 1", (job_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def attempts(self, job_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT n, nodes, started, ended, why, resumed_from, times FROM attempts "
                               "WHERE job_id = ? ORDER BY n", (job_id,)).fetchall()
        return [{"n": r[0], "nodes": json.loads(r[1]), "started": r[2], "ended": r[3], "why": r[4],
                 "resumed_from": r[5], **json.loads(r[6])} for r in rows]

    def set_host(self, job_id: str, node: str, **fields: Any) -> None:
        """What a host reported of the job: `sandbox` (the confinement it had), `peak_memory`
        (bytes), `cpu_seconds`, and a Ray job's node there (`ray`: a map); fields not given keep
        their value."""
        self.db.execute("INSERT OR IGNORE INTO hosts (job_id, node) VALUES (?, ?)", (job_id, node))
        if "ray" in fields:
            fields = {**fields, "ray": json.dumps(fields["ray"])}
        for name in ("sandbox", "peak_memory", "cpu_seconds", "ray"):
            if name in fields:
                self.db.execute(f"UPDATE hosts SET {name} = ? WHERE job_id = ? AND node = ?",
                                (fields[name], job_id, node))

    def hosts(self, job_id: str) -> dict[str, dict[str, Any]]:
        rows = self.db.execute("SELECT node, sandbox, peak_memory, cpu_seconds, ray FROM hosts WHERE job_id = ? "
                               "ORDER BY node", (job_id,)).fetchall()
        return {r[0]: {"sandbox": r[1], "peak_memory": r[2], "cpu_seconds": r[3],
                       **({"ray": json.loads(r[4])} if r[4] else {})} for r in rows}

    def prune(self, ended_before: float) -> list[str]:
        """Forget jobs that ended before `ended_before`: rows, ranks and logs."""
        terminal = tuple(TERMINAL)
        old = [r[0] for r in self.db.execute(
            f"SELECT id FROM jobs WHERE state IN ({', '.join('?' * len(terminal))}) AND ended < ? ORDER BY id",
            (*terminal, ended_before))]
        for job in old:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.execute("DELETE FROM ranks WHERE job_id = ?", (job,))
                self.db.execute("DELETE FROM hosts WHERE job_id = ?", (job,))
                self.db.execute("DELETE FROM attempts WHERE job_id = ?", (job,))
                self.db.execute("DELETE FROM jobs WHERE id = ?", (job,))
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            shutil.rmtree(self.dir / job, ignore_errors=True)
            self._trimmed.pop(job, None)
        return old

    def recover(self, reason: str, keep: Iterable[str] = ()) -> list[str]:
        """Mark every job still going failed with `reason`, but those in `keep` (their replicas
        carry them on: the origin follows them, issue 26); returns the ids failed."""
        kept = tuple(keep)
        going = f"state NOT IN ({', '.join('?' * len(TERMINAL))})" + \
            (f" AND id NOT IN ({', '.join('?' * len(kept))})" if kept else "")
        terminal = (*TERMINAL, *kept)
        self.db.execute("BEGIN IMMEDIATE")
        try:
            lost = [r[0] for r in self.db.execute(f"SELECT id FROM jobs WHERE {going} ORDER BY id", terminal)]
            self.db.execute(f"UPDATE ranks SET state = 'lost' WHERE exit_code IS NULL "
                            f"AND job_id IN (SELECT id FROM jobs WHERE {going})", terminal)
            self.db.execute(f"UPDATE attempts SET why = COALESCE(why, ?), ended = COALESCE(ended, ?) "
                            f"WHERE job_id IN (SELECT id FROM jobs WHERE {going})", (reason, time.time(), *terminal))
            self.db.execute(f"UPDATE jobs SET state = 'failed', reason = ?, ended = COALESCE(ended, ?) WHERE {going}",
                            (reason, time.time(), *terminal))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return lost

    # --- output -------------------------------------------------------------------------

    def _log(self, job_id: str) -> Path:
        return self.dir / job_id / "output.log"

    def append_log(self, job_id: str, rank: int, data: bytes) -> None:
        """`data` is a line (or several, split at newlines) of one rank's output."""
        path = self._log(job_id)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        if trimmed := output.append(path, output.records(rank, data), self.log_cap):
            self._trimmed[job_id] = self._trimmed.get(job_id, 0) + trimmed

    def append_logs(self, job_id: str, lines: list[tuple[int, bytes]]) -> None:
        """A batch of (rank, line) in one write: a host's batch costs one append, not one per line."""
        if not lines:
            return
        path = self._log(job_id)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        if trimmed := output.append(path, b"".join(output.records(r, d) for r, d in lines), self.log_cap):
            self._trimmed[job_id] = self._trimmed.get(job_id, 0) + trimmed

    def cut_log_at_attempt(self, job_id: str, attempt: int) -> None:
        """Cut the job's log back to where attempt `attempt`'s ranks began: after the line that
        opens it (a restart's, a growth's or a takeover's), or the start for the first attempt. A
        successor's copy of that attempt, whole, follows (issue 26). Blocking: call in a thread."""
        path = self._log(job_id)
        cut, pos = 0, 0
        try:
            with open(path, "rb") as f:
                for record in f:
                    pos += len(record)
                    head, _, text = record.rstrip(b"\n").partition(b"\t")
                    if head == b"0" and text.startswith(b"[swarmd] ") and _opens(text.decode("utf-8", "replace"),
                                                                                attempt):
                        cut = pos
            if cut or attempt == 1:
                os.truncate(path, cut)
        except FileNotFoundError:
            return

    def read_log(self, job_id: str, rank: int | None = None, offset: int = 0,
                 limit: int = _READ) -> tuple[list[tuple[int, str]], int]:
        """Whole records from byte `offset` on, of one rank or all, as (rank, line) in arrival
        order, and the offset to go on from (the same when there is nothing new)."""
        base = self._trimmed.get(job_id, 0)
        offset = max(offset, base)
        try:
            with open(self._log(job_id), "rb") as f:
                f.seek(offset - base)
                data = f.read(limit)
        except FileNotFoundError:
            return [], offset
        end = data.rfind(b"\n") + 1
        out = []
        for record in data[:end].splitlines():
            head, tab, text = record.partition(b"\t")
            if not (tab and head.isdigit()):
                continue  # torn by a power loss
            if rank is None or int(head) == rank:
                out.append((int(head), text.decode("utf-8", "replace")))
        return out, offset + end


_OPENS = re.compile(r"\[swarmd\] (?:restart \d+/\d+ after .*: attempt (\d+) on .*|"
                    r"growing from \d+ to \d+ nodes at checkpoint .*: attempt (\d+) on .*|"
                    r"\S+ took the job over at epoch \d+ .*: attempt (\d+)'s output from its start)")


def _opens(line: str, attempt: int) -> bool:
    """Whether `line` (rank 0's, from swarmd) opens attempt `attempt`: a restart's or a growth's
    marker, or a takeover's."""
    m = _OPENS.fullmatch(line)
    return m is not None and int(m.group(1) or m.group(2) or m.group(3)) == attempt


def _check_state(state: Any) -> None:
    if state not in STATES:
        raise ValueError(f"unknown job state {state!r}; expected one of {', '.join(STATES)}")


def _encode(column: str, value: Any) -> Any:
    return json.dumps(value) if column in ("spec", "nodes") else value


def _row(r: tuple[Any, ...]) -> JobRow:
    values = dict(zip(_COLUMNS, r))
    values["spec"] = json.loads(values["spec"])
    values["nodes"] = json.loads(values["nodes"])
    return JobRow(**values)
