"""Running one job's ranks on this host (trio).

Rules:
- Each rank is its own session and process group, so a signal reaches all it started
  (dataloader workers, shells) and none of the daemon.
- When the daemon is root, ranks run as `user` with that user's group and no others;
  otherwise as the daemon's own user. They inherit no descriptor of the daemon.
- stdout and stderr come back as whole lines, a long line cut at 64 KiB, a last line
  without a newline flushed at exit.
- A rank that exits non-zero stops the others (SIGTERM to their groups, SIGKILL after
  `grace`); so does `cancel`. A rank killed by a signal reports 128 + its number, as a
  shell does.
"""

from __future__ import annotations

import os
import pwd
import signal
import socket
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

MAX_LINE = 64 * 1024


class ExecutorError(Exception):
    """The ranks cannot be started as asked (a missing user, a missing program)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankProc:
    rank: int
    local_rank: int
    argv: list[str]
    env: dict[str, str]
    cwd: Path


def free_port(host: str = "0.0.0.0") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _credentials(user: str | None) -> dict[str, object]:
    if os.geteuid() != 0:
        if user not in (None, pwd.getpwuid(os.geteuid()).pw_name):
            raise ExecutorError(f"ranks can run as {user!r} only when swarmd is root")
        return {}
    if user is None:
        raise ExecutorError("swarmd is root and no job user is set: refusing to run ranks as root")
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise ExecutorError(f"job user {user!r} does not exist on this host") from None
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


class Executor:
    def __init__(self, job_id: str, ranks: Sequence[RankProc], *, user: str | None,
                 on_output: Callable[[int, bytes], None], grace: float = 5.0) -> None:
        self.job_id = job_id
        self.ranks = list(ranks)
        self.user = user
        self.on_output = on_output
        self.grace = grace
        self.first_failure: tuple[int, int] | None = None
        self._procs: dict[int, trio.Process] = {}
        self._stopping = trio.Event()
        self._done = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> dict[int, int]:
        creds = _credentials(self.user)
        codes: dict[int, int] = {}
        try:
            async with trio.open_nursery() as nursery:
                for r in self.ranks:
                    try:
                        proc = await trio.lowlevel.open_process(
                            r.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=r.cwd, env=r.env, start_new_session=True, **creds)
                    except OSError as exc:
                        self.cancel()
                        raise ExecutorError(f"rank {r.rank}: cannot start {r.argv[0]}: {exc.strerror}") from None
                    self._procs[r.rank] = proc
                    nursery.start_soon(self._watch, r.rank, proc, codes)
                nursery.start_soon(self._stopper)
                task_status.started()
                await self._done.wait()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._kill_all()
        return codes

    def cancel(self) -> None:
        self._stopping.set()

    async def _watch(self, rank: int, proc: trio.Process, codes: dict[int, int]) -> None:
        assert proc.stdout is not None
        pending = b""
        async with proc.stdout:
            while chunk := await proc.stdout.receive_some(MAX_LINE):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._emit(rank, line)
                while len(pending) >= MAX_LINE:
                    self._emit(rank, pending[:MAX_LINE])
                    pending = pending[MAX_LINE:]
        if pending:
            self._emit(rank, pending)
        code = await proc.wait()
        code = 128 - code if code < 0 else code
        if code != 0 and self.first_failure is None and not self._stopping.is_set():
            self.first_failure = (rank, code)
            self.cancel()
        codes[rank] = code
        if len(codes) == len(self.ranks):
            self._done.set()

    def _emit(self, rank: int, line: bytes) -> None:
        self.on_output(rank, line[:-1] if line.endswith(b"\r") else line)

    async def _stopper(self) -> None:
        await self._stopping.wait()
        self._signal(signal.SIGTERM)
        await trio.sleep(self.grace)
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        for proc in self._procs.values():
            try:
                os.killpg(proc.pid, sig)  # the rank's session: its whole tree
            except (ProcessLookupError, PermissionError):
                pass

    async def _kill_all(self) -> None:
        """Nothing outlives the executor: the group of every rank is killed and reaped."""
        self._signal(signal.SIGKILL)
        for proc in self._procs.values():
            with trio.move_on_after(5):
                await proc.wait()
