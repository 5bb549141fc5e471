"""A host's side of jobs (trio): its slots, its workdir cache, the ranks it runs.

The same `Worker` answers its own coordinator directly and remote coordinators through the
job protocol (service.py), so a job placed on the coordinator's own host takes the same
path as one placed elsewhere. Rules:
- Reservations and commits go through the sans-IO `Ledger`; lapsed leases are swept.
- `start` emits events: ``{"started": ranks}``, batches of output ``{"out": [[rank, line]…]}``,
  and last ``{"exit": [[rank, code]…], "first": [rank, code] | None}`` (the rank that failed
  first: the others' codes may be the stop it caused). Whoever drives it going away cancels the ranks.
- When the ranks have exited, the job's slot and GPUs are released and its pin on the
  workdir dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio

from .executor import Executor, RankProc
from .ledger import Grant, Ledger, Refusal
from .torchenv import NodeRole, rank_env, resolve_argv
from .workdir import Cache

log = structlog.get_logger("swarmd.jobs")

HEARTBEAT = 2.0  # seconds of silent ranks after which the coordinator is still asked to listen
OUTPUT_BATCH = 0.05  # seconds output is gathered before it is sent on
OUTPUT_BATCH_BYTES = 256 * 1024


class WorkerError(Exception):
    """A request this host cannot carry out; the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StartRequest:
    job: str
    coordinator: str
    role: NodeRole
    cmd: tuple[str, ...]
    env: dict[str, str]
    python: str | None
    workdir: str | None  # digest of a cached tree, or None for an empty directory


class Worker:
    def __init__(self, *, ledger: Ledger, cache: Cache, jobs_dir: Path, user: str | None,
                 ifname: Callable[[], str | None] = lambda: None,
                 changed: Callable[[], None] = lambda: None) -> None:
        self.ledger = ledger
        self.cache = cache
        self.jobs_dir = jobs_dir
        self.user = user
        self.ifname = ifname  # the mesh interface, when the mesh is up
        self.changed = changed  # this host's offer changed: re-advertise
        self.running: dict[str, Executor] = {}

    # --- reservations --------------------------------------------------------------------

    def reserve(self, job: str, coordinator: str, gpus: int, lease: float) -> Grant | Refusal:
        answer = self.ledger.reserve(trio.current_time(), job, coordinator, gpus, lease)
        self.changed()
        return answer

    def commit(self, job: str, coordinator: str) -> Grant | Refusal:
        return self.ledger.commit(trio.current_time(), job, coordinator)

    def release(self, job: str) -> None:
        if job not in self.running and self.ledger.release(job):
            self.changed()

    async def sweep(self) -> None:
        """Give back reservations whose coordinator never committed."""
        while True:
            deadline = self.ledger.next_deadline()
            await (trio.sleep_until(deadline) if deadline is not None else trio.sleep(1.0))
            if self.ledger.expire(trio.current_time()):
                self.changed()

    @property
    def ranks(self) -> int:
        return sum(len(e.ranks) for e in self.running.values())

    # --- running ------------------------------------------------------------------------

    async def start(self, req: StartRequest, emit: Callable[[dict[str, Any]], Awaitable[None]]) -> dict[int, int]:
        """Run this host's ranks of a job to the end, telling `emit` as things happen; an
        exception out of `emit` (the coordinator went away) stops the ranks."""
        if not self.ledger.holds(req.job):
            raise WorkerError(f"job {req.job} holds no reservation on this host")
        if req.job in self.running:
            raise WorkerError(f"job {req.job} is already running here")
        if req.workdir is not None and not self.cache.has(req.workdir):
            raise WorkerError(f"workdir {req.workdir[:12]} is not on this host")
        top = self.jobs_dir / req.job
        role = dataclasses.replace(req.role, ifname=self.ifname(), gpus=self.ledger.gpus_of(req.job),
                                   checkpoint_dir=str(top / "checkpoints"))
        base = _base_env(top)
        argv = resolve_argv(req.cmd, req.python)
        pending: list[list[Any]] = []
        wake = trio.Event()

        def on_output(rank: int, line: bytes) -> None:
            pending.append([rank, line.decode("utf-8", "replace")])
            wake.set()

        codes: dict[int, int] = {}
        executor: Executor | None = None
        try:
            cwd = await trio.to_thread.run_sync(self._prepare, req.job, req.workdir)
            ranks = [RankProc(rank=role.node_rank * role.procs_per_node + i, local_rank=i, argv=argv,
                              env=rank_env(role, i, req.env, base), cwd=cwd)
                     for i in range(role.procs_per_node)]
            executor = Executor(req.job, ranks, user=self.user, on_output=on_output)
            self.running[req.job] = executor
            self.changed()
            async with _unwrapped(), trio.open_nursery() as nursery:
                async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                    codes.update(await executor.run(task_status=task_status))
                    wake.set()

                await nursery.start(run)
                await emit({"started": [r.rank for r in ranks]})
                while not codes or pending:
                    with trio.move_on_after(HEARTBEAT) as idle:
                        await wake.wait()
                    if idle.cancelled_caught:
                        await emit({"hb": True})  # fails once the coordinator is gone: the ranks stop
                        continue
                    wake = trio.Event()
                    if not codes:
                        await trio.sleep(OUTPUT_BATCH)
                    while pending:
                        batch, size = [], 0
                        while pending and size < OUTPUT_BATCH_BYTES:
                            batch.append(item := pending.pop(0))
                            size += len(item[1])
                        await emit({"out": batch})
            first = executor.first_failure
            await emit({"exit": sorted(codes.items()), "first": list(first) if first else None})
            return codes
        finally:
            if executor is not None:
                executor.cancel()
            self.running.pop(req.job, None)
            self.ledger.release(req.job)
            self.changed()

    def cancel(self, job: str) -> bool:
        executor = self.running.get(job)
        if executor is None:
            return False
        executor.cancel()
        return True

    def _prepare(self, job: str, workdir: str | None) -> Path:
        """The job's own writable copy of its workdir, and its checkpoint directory."""
        top = self.jobs_dir / job
        work, checkpoints = top / "work", top / "checkpoints"
        if work.exists():
            shutil.rmtree(work)
        top.mkdir(parents=True, exist_ok=True)
        if workdir is not None:
            with self.cache.hold(workdir) as tree:  # not evicted while it is copied
                shutil.copytree(tree, work, symlinks=False)
        else:
            work.mkdir()
        checkpoints.mkdir(exist_ok=True)
        if os.geteuid() == 0 and self.user:
            entry = pwd.getpwnam(self.user)
            _chown_tree(top, entry.pw_uid, entry.pw_gid)
        return work


@contextlib.asynccontextmanager
async def _unwrapped() -> AsyncIterator[None]:
    """A nursery's lone error as itself (an ExecutorError, the coordinator's stream breaking),
    so callers handle it by its type rather than as an ExceptionGroup."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if len(leaves) == 1 and isinstance(leaves[0], Exception):
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup) -> Iterator[BaseException]:
    for exc in group.exceptions:
        yield from _leaves(exc) if isinstance(exc, BaseExceptionGroup) else (exc,)


def stop_orphans(jobs_dir: Path) -> list[int]:
    """Kill ranks a previous life of this daemon left running (after a kill -9 nobody told
    them to stop): processes of a job (SWARM_JOB_ID in their environment) working under
    `jobs_dir`. Returns their pids."""
    killed = []
    root = str(jobs_dir.resolve()) + os.sep
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not os.readlink(entry / "cwd").startswith(root):
                continue
            if b"\0SWARM_JOB_ID=" not in b"\0" + (entry / "environ").read_bytes():
                continue
            os.kill(int(entry.name), signal.SIGKILL)
            killed.append(int(entry.name))
        except (OSError, ValueError):
            continue  # gone, or not ours to see
    return killed


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)


def _base_env(home: Path) -> dict[str, str]:
    """A clean start: the interpreter's own bin first on PATH (a rank that runs `python` in a
    subprocess gets swarmd's, with torch), and HOME in the job's own directory (the job user's
    may not exist, `nobody`'s is /nonexistent, and torch keeps caches there)."""
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    return {"PATH": path, "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": str(home)}
