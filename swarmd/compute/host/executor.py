"""Running one job's ranks on this host (trio).

Rules:
- Each rank is its own session and process group, so a signal reaches all it started
  (dataloader workers, shells) and none of the daemon. A rank is over when its own process
  exits: what it leaves behind in its group is killed then. Only a process that left the
  group (setsid) can escape; output it still writes is read for `grace` seconds at most.
- A group is signalled only while its leader is unreaped (running, or a zombie holding its
  pid), so a signal never reaches a stranger that reused the pid.
- When the daemon is root, ranks run as `user` with that user's group and no others;
  otherwise as the daemon's own user, and `user` is None or that user. They inherit no
  descriptor of the daemon, and stdin is /dev/null. In a sandbox `box`, the daemon starts
  the box's command chain instead (it drops to the job's uid itself), and a stop's signals
  go to the job's own processes in its cgroup (a sandboxed rank has a session of its own;
  bubblewrap ends with it).
- stdout and stderr share one pipe (their order kept, as on a terminal) and come back as
  whole lines without the newline, a long line cut at 64 KiB, a last line without a newline
  flushed at exit.
- A rank that exits non-zero stops the others (SIGTERM to their groups, SIGKILL after
  `grace`); so does `cancel`, and so does cancelling `run`. A rank killed by a signal
  reports 128 + its number, as a shell does. `first_failure` is the first rank to exit
  non-zero before anything was stopped.
- Ranks never outlive the daemon: before the first rank starts, a reaper (sandbox/reaper.py)
  is started for the job and told each rank's group as it starts and before it is reaped;
  if the daemon dies, the reaper kills those groups and the job's cgroup. When `run` ends,
  the job's cgroup is emptied (what a rank left there with setsid), then the reaper is told
  `done` and exits killing nothing. A fence that cannot be told something is killed: one
  that might reach a stranger's reused group is worse than none.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import trio

from .sandbox import reaper
from .sandbox.cgroups import CgroupError, JobCgroup

if TYPE_CHECKING:
    from .sandbox.box import Box

log = structlog.get_logger("swarmd.jobs")

MAX_LINE = 64 * 1024
REAPER_EXIT = 5.0  # seconds the reaper may take to exit after `done` before it is killed


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
    """A TCP port free on `host` now, for a job's MASTER_PORT."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _credentials(user: str | None) -> dict[str, object]:
    """Popen's keywords to run a rank as `user`; raises ExecutorError when it may not."""
    entry = None
    if user is not None:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise ExecutorError(f"job user {user!r} does not exist on this host") from None
    if os.geteuid() != 0:
        if entry is not None and entry.pw_uid != os.geteuid():
            raise ExecutorError(f"ranks can run as job user {user!r} only when swarmd is root")
        return {}
    if entry is None:
        raise ExecutorError("swarmd is root and no job user is set: refusing to run ranks as root")
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


class Executor:
    def __init__(self, job_id: str, ranks: Sequence[RankProc], *, user: str | None,
                 on_output: Callable[[int, bytes], None], grace: float = 5.0, box: Box | None = None) -> None:
        self.job_id = job_id
        self.ranks = list(ranks)
        self.user = user
        self.box = box
        self.on_output = on_output
        self.grace = grace
        self.first_failure: tuple[int, int] | None = None
        self._live: dict[int, trio.Process] = {}  # rank -> process whose leader is not reaped
        self._stopping = trio.Event()
        self.fence: _Fence | None = None  # the job's reaper while `run` runs

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> dict[int, int]:
        """Start every rank, then wait for all; returns rank -> exit code."""
        creds = _credentials(self.user) if self.box is None else {}
        codes: dict[int, int] = {}
        self.fence = fence = await _Fence.start(self.job_id, self.box.cgroup if self.box is not None else None)
        try:
            for r in self.ranks:
                proc = self._live[r.rank] = await self._spawn(r, creds)
                fence.tell(reaper.watch(proc.pid))
            async with trio.open_nursery() as outer:
                outer.start_soon(self._stopper)
                task_status.started()
                async with trio.open_nursery() as nursery:
                    for rank, proc in self._live.items():
                        nursery.start_soon(self._rank, rank, proc, codes)
                outer.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._stop_all()
                if self.box is not None and self.box.cgroup is not None:
                    await _empty(self.box.cgroup)
                await fence.close()
        return codes

    def cancel(self) -> None:
        self._stopping.set()

    async def _spawn(self, r: RankProc, creds: dict[str, object]) -> trio.Process:
        try:
            argv, env = r.argv, r.env
            if self.box is not None:  # the chain execs the command last: a missing one is found here first
                if _program(r.argv[0], r.env.get("PATH", ""), r.cwd) is None:
                    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), r.argv[0])
                argv, env = self.box.command(r.argv, r.env, r.rank)
            return await trio.lowlevel.open_process(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                cwd=r.cwd, env=env, start_new_session=True, close_fds=True, **creds)
        except OSError as exc:
            raise ExecutorError(f"rank {r.rank} cannot start: {exc.strerror}: {exc.filename or r.argv[0]!r}") from None

    async def _rank(self, rank: int, proc: trio.Process, codes: dict[int, int]) -> None:
        assert proc.stdout is not None
        async with trio.open_nursery() as nursery:
            read_all = trio.Event()
            nursery.start_soon(self._read, rank, proc.stdout, read_all)
            await _exited(proc.pid)
            _signal_group(proc, signal.SIGKILL)  # what the rank left behind
            self._forget(proc)
            code = await proc.wait()
            del self._live[rank]
            code = 128 - code if code < 0 else code
            codes[rank] = code
            if code != 0 and self.first_failure is None and not self._stopping.is_set():
                self.first_failure = (rank, code)
                self.cancel()
            with trio.move_on_after(self.grace):
                await read_all.wait()
            nursery.cancel_scope.cancel()

    async def _read(self, rank: int, stream: trio.abc.ReceiveStream, read_all: trio.Event) -> None:
        pending = b""
        try:
            async with stream:
                while chunk := await stream.receive_some(MAX_LINE):
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        self._emit(rank, line)
                    while len(pending) >= MAX_LINE:
                        self._emit(rank, pending[:MAX_LINE])
                        pending = pending[MAX_LINE:]
            read_all.set()
        finally:
            if pending:
                self._emit(rank, pending)

    def _forget(self, proc: trio.Process) -> None:
        """Out of the fence before its leader is reaped: then its number may be a stranger's."""
        if self.fence is not None:
            self.fence.tell(reaper.forget(proc.pid))

    def _emit(self, rank: int, line: bytes) -> None:
        line = line.removesuffix(b"\r")
        for start in range(0, max(len(line), 1), MAX_LINE):
            self.on_output(rank, line[start:start + MAX_LINE])

    def _signal_all(self, sig: signal.Signals) -> None:
        """`sig` to every live rank and all it started: through the box's cgroup where there is
        one (a sandboxed rank has a session of its own, out of reach of its group's signal)."""
        if self.box is not None and self._live and self.box.signal(sig):
            return
        for proc in self._live.values():
            _signal_group(proc, sig)

    async def _stopper(self) -> None:
        await self._stopping.wait()
        self._signal_all(signal.SIGTERM)
        await trio.sleep(self.grace)
        self._signal_all(signal.SIGKILL)

    async def _stop_all(self) -> None:
        """Nothing outlives `run`: ranks still there get SIGTERM, SIGKILL after `grace`, and
        are reaped (a no-op when every rank has ended by itself)."""
        self._signal_all(signal.SIGTERM)
        with trio.move_on_after(self.grace):
            for proc in self._live.values():
                await _exited(proc.pid)
        self._signal_all(signal.SIGKILL)
        for proc in self._live.values():
            _signal_group(proc, signal.SIGKILL)
            self._forget(proc)
            await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.aclose()
        self._live.clear()


class _Fence:
    """The daemon's end of the job's reaper: the pipe's write end (close-on-exec, so no
    rank and no other reaper holds it) and the reaper's process."""

    def __init__(self, job: str, proc: trio.Process, fd: int) -> None:
        self.job = job
        self.proc = proc
        self._fd: int | None = fd

    @classmethod
    async def start(cls, job: str, cgroup: JobCgroup | None) -> _Fence:
        read, write = os.pipe()  # both close-on-exec; the reaper gets `read` as its stdin only
        try:
            os.set_blocking(write, False)  # a stuck reaper must not stall the event loop
            proc = await trio.lowlevel.open_process(
                reaper.command(job, cgroup), stdin=read, stdout=subprocess.DEVNULL, cwd="/",
                env=reaper.environment(), start_new_session=True, close_fds=True)
        except OSError as exc:
            os.close(write)
            raise ExecutorError(f"the job's reaper cannot start: {exc.strerror}") from None
        finally:
            os.close(read)
        return cls(job, proc, write)

    def tell(self, line: bytes) -> None:
        if self._fd is None:
            return
        try:
            if os.write(self._fd, line) == len(line):
                return
            error = "a short write"
        except OSError as exc:
            error = exc.strerror or str(exc)
        log.warning("job reaper lost: its ranks are not fenced against this daemon's death", job=self.job,
                    error=error)
        self._disarm()

    def _disarm(self) -> None:
        """Kill the reaper before closing its pipe (its end of file would be its cue)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def close(self) -> None:
        """Every rank is reaped: `done`, and the reaper exits having killed nothing."""
        self.tell(reaper.DONE)
        self._close()
        with trio.move_on_after(REAPER_EXIT):
            await self.proc.wait()
        if self.proc.returncode is None:
            log.warning("job reaper did not exit after done: killed", job=self.job)
            self.proc.kill()
            await self.proc.wait()


async def _empty(cgroup: JobCgroup) -> None:
    """Kill what the job's ranks left in its cgroup (a setsid'd process), so that nothing
    of the job runs unfenced between `done` and the box's close."""
    try:
        await trio.to_thread.run_sync(cgroup.kill)
    except CgroupError as exc:
        log.warning("job cgroup not emptied", cgroup=str(cgroup.dirs[0]), error=str(exc))


def _program(name: str, path: str, cwd: Path) -> str | None:
    """Where `name` is as exec would look for it (a path, else each PATH entry), or None."""
    if "/" in name:
        return name if os.path.isfile(cwd / name) else None
    return shutil.which(name, path=path)


def _signal_group(proc: trio.Process, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # the rank's session: its whole tree
    except ProcessLookupError:
        pass


async def _exited(pid: int) -> None:
    """Wait until `pid` has exited without reaping it: its zombie keeps the pid, and so its
    group, from being reused while we may still signal it."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # a kernel before 5.3: a thread blocks in waitid instead
        await trio.to_thread.run_sync(os.waitid, os.P_PID, pid, os.WEXITED | os.WNOWAIT,
                                      abandon_on_cancel=True, limiter=trio.CapacityLimiter(1))
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        trio.lowlevel.notify_closing(fd)
        os.close(fd)
