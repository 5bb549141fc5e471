"""Jobs that survive a restart: a SQLite table of jobs and ranks, and each job's output.

Rules:
- STATE_DIR/jobs.sqlite3 (WAL; every change committed at once) holds jobs and ranks;
  STATE_DIR/jobs/<id>/output.log holds the ranks' output in arrival order, one
  ``rank<TAB>line`` per line, so a reader follows it with a byte offset as its cursor.
- A job in a terminal state never leaves it.
- `recover` at start marks every job that was still going as failed, with the reason: the
  process that drove it is gone.
- Ids are 12 lowercase characters, time-ordered, and can be given by a unique prefix.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
MIN_PREFIX = 4
_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford's base32: no i, l, o, u

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


class JobStore:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "jobs"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_dir / "jobs.sqlite3"
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        os.chmod(path, 0o600)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        self._last = 0  # ids only grow: two jobs in one millisecond still differ

    def close(self) -> None:
        self.db.close()

    def new_id(self) -> str:
        n = max((int(time.time() * 1000) << 19) | secrets.randbits(19), self._last + 1)
        self._last = n
        out = ""
        for _ in range(12):
            n, digit = divmod(n, 32)
            out = _ALPHABET[digit] + out
        return out

    def add(self, job: JobRow) -> None:
        values = [json.dumps(v) if k in ("spec", "nodes") else v for k, v in zip(_COLUMNS, _values(job))]
        self.db.execute(f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})", values)

    def update(self, job_id: str, **changes: Any) -> JobRow:
        unknown = set(changes) - set(_COLUMNS) - {"id"}
        if unknown or "id" in changes:
            raise TypeError(f"cannot update {sorted(unknown | ({'id'} & set(changes)))}")
        row = self.get(job_id)
        if row is None:
            raise KeyError(job_id)
        if row.state in TERMINAL:
            changes.pop("state", None)
            changes = {k: v for k, v in changes.items() if getattr(row, k) is None} if changes else {}
        if changes:
            sets = ", ".join(f"{k} = ?" for k in changes)
            values = [json.dumps(v) if k in ("spec", "nodes") else v for k, v in changes.items()]
            self.db.execute(f"UPDATE jobs SET {sets} WHERE id = ?", [*values, row.id])
            for k, v in changes.items():
                setattr(row, k, v)
        return row

    def get(self, job_id: str) -> JobRow | None:
        """By id or by a unique prefix of at least 4 characters; ValueError if ambiguous."""
        row = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None and len(job_id) >= MIN_PREFIX and job_id.isalnum():
            rows = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id LIKE ? LIMIT 2",
                                   (job_id.lower() + "%",)).fetchall()
            if len(rows) > 1:
                raise ValueError(f"{job_id!r} matches more than one job; give more of the id")
            row = rows[0] if rows else None
        return None if row is None else _row(row)

    def list(self, limit: int = 50) -> list[JobRow]:
        rows = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM jobs ORDER BY created DESC, id DESC LIMIT ?",
                               (max(1, min(limit, 1000)),)).fetchall()
        return [_row(r) for r in rows]

    def set_rank(self, row: RankRow) -> None:
        self.db.execute("INSERT OR REPLACE INTO ranks VALUES (?, ?, ?, ?, ?)",
                        (row.job_id, row.rank, row.node, row.state, row.exit_code))

    def ranks(self, job_id: str) -> list[RankRow]:
        rows = self.db.execute("SELECT job_id, rank, node, state, exit_code FROM ranks WHERE job_id = ? ORDER BY rank",
                               (job_id,)).fetchall()
        return [RankRow(job_id=r[0], rank=r[1], node=r[2], state=r[3], exit_code=r[4]) for r in rows]

    def recover(self, reason: str) -> list[str]:
        placeholders = ", ".join("?" * len(TERMINAL))
        lost = [r[0] for r in self.db.execute(f"SELECT id FROM jobs WHERE state NOT IN ({placeholders})",
                                              tuple(TERMINAL))]
        for job_id in lost:
            self.db.execute("UPDATE jobs SET state = 'failed', reason = ?, ended = ? WHERE id = ?",
                            (reason, time.time(), job_id))
            self.db.execute("UPDATE ranks SET state = 'lost' WHERE job_id = ? AND exit_code IS NULL", (job_id,))
        return lost

    # --- output -------------------------------------------------------------------------

    def _log(self, job_id: str) -> Path:
        return self.dir / job_id / "output.log"

    def append_log(self, job_id: str, rank: int, data: bytes) -> None:
        path = self._log(job_id)
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700)
        with open(path, "ab") as f:
            f.write(b"%d\t%s\n" % (rank, data.replace(b"\n", b" ")))

    def read_log(self, job_id: str, rank: int | None = None, offset: int = 0) -> tuple[list[tuple[int, str]], int]:
        """Whole lines from byte `offset` on, of one rank or all, and the offset to go on from."""
        try:
            with open(self._log(job_id), "rb") as f:
                f.seek(offset)
                data = f.read(4 * 1024 * 1024)
        except FileNotFoundError:
            return [], offset
        end = data.rfind(b"\n") + 1
        out = []
        for line in data[:end].splitlines():
            head, _, text = line.partition(b"\t")
            r = int(head)
            if rank is None or r == rank:
                out.append((r, text.decode("utf-8", "replace")))
        return out, offset + end


def _values(job: JobRow) -> list[Any]:
    return [getattr(job, k) for k in _COLUMNS]


def _row(r: tuple[Any, ...]) -> JobRow:
    values = dict(zip(_COLUMNS, r))
    values["spec"] = json.loads(values["spec"])
    values["nodes"] = json.loads(values["nodes"])
    return JobRow(**values)
