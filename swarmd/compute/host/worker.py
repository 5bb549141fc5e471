"""A host's side of jobs (trio): its slots, its workdir cache, the ranks it runs.

The same `Worker` answers its own coordinator directly and remote coordinators through the
job protocol (service.py), so a job placed on the coordinator's own host takes the same
path as one placed elsewhere. Rules:
- Reservations, commits, starts and releases go through the sans-IO `Ledger`, which keys
  each hold by (coordinator, job); lapsed leases and commits never started (within
  `START_WITHIN`) are swept. Running ranks are kept by the same key.
- A job's directory is `jobs_dir/<job id>-<coordinator hash>` (ids.host_dir) for an id of
  ids.py's format only, checked to resolve inside `jobs_dir`: another member presenting an
  id it learned gets its own directory and never touches the coordinator's. It is made afresh for each start (a leftover is removed
  without following links), owned by the daemon (0711), with `home/`, `work/` (a copy of
  the cached workdir), `checkpoints/` and `tmp/` (the ranks' TMPDIR and caches: never the
  host's /tmp, _base_env) inside handed to the job user: only what the
  daemon just created is chowned, links never followed, and the job user reaches nothing
  until it is all in place. `output.log` beside them stays the daemon's, and so does
  `ckpt-cache/` (checkpoints/cache.py), the one thing a start keeps: the job's checkpoints by
  sha256, of which the start's listed ones are hard-linked into `checkpoints/`. A peer
  puts checkpoints only for its committed or running hold (`accept_checkpoint_put`); a
  cache it filled for a hold that went (released, lapsed) before the job ever started
  here is removed with the hold, and all caches together stay within `checkpoint_budget`
  (checkpoints.cache.Budget), a share per job, what a cache keeps going last. Which holds were put
  into is remembered in memory: after a restart of the daemon such a leftover waits for
  gc's retention, counted in the budget. What a cache keeps (`checkpoints_kept`: the
  latest start's listed checkpoints, or the hub's list) is recorded only once the ledger
  took the start, and at most MAX_KEPT_PER_COORDINATOR jobs per coordinator: a member's
  requests, refused or not, never push another coordinator's out.
- While the ranks run, `checkpoints/` is scanned every CHECKPOINT_SCAN; each checkpoint
  that completes (checkpoints/rules.py) is copied into the cache and told as ``{"ckpt": [name,
  sha256, size]}``, the last ones before the exit event, which waits for them at most
  LAST_CHECKPOINT_WAIT (a scan stuck in a job's file system never holds the slot).
- `start` emits events: ``{"started": ranks}``, batches of output ``{"out": [[rank, line]…]}``,
  ``{"dropped": [[rank, n]…]}`` when lines were left off the stream, and last ``{"exit":
  [[rank, code]…], "first": [rank, code] | None}`` (the rank that failed first: the others'
  codes may be the stop it caused). Every line goes to the job's log on this host first;
  the stream gets what a bounded queue holds (output.py), so a coordinator that does not
  read costs lines on its stream, never this host's memory. A coordinator that takes no
  event for `EMIT_TIMEOUT`, whose stream breaks, or that membership declares gone, is gone:
  a job whose charter names other replicas waits up to `HANDOVER_PATIENCE` for a successor's
  `attach` (sink.py), any other has its ranks stopped.
- Who may command a job here is the fence's (`authorize`, succession.Fence): its origin
  until a charter is known, then the coordinator of the highest epoch seen.
- A workdir shipped for a hold (`pin`) stays in the cache while the hold lasts, one tree per
  hold, so other uploads cannot evict it between ship and start.
- When the ranks have exited, the job's slot and GPUs are released and its pin on the
  workdir dropped; the directory stays until garbage collection (coordinator/gc.py). Each step of that
  clean-up runs whatever the others did (one that fails is logged), and a tree the job or a
  peer shaped (its Ray temp dir, the workdir copied out) is removed, copied and chowned
  only through trees.py, at any depth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pwd
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio

from ...p2p.signed import short

from .. import trees
from ..checkpoints.cache import BUDGET_FACTOR, CACHE_DIR, Budget, CheckpointError, CkptCache, Watcher, clear_job_dir
from ..checkpoints.rules import KEEP as CHECKPOINT_KEEP, is_sha256
from ..forward import Forwards
from ..ids import check_job_id, host_dir
from ..ledger import Cancel, Grant, Ledger, Refusal
from ..nursery import lone_error
from ..output import RankOutput
from ..spec import Serve
from ..succession import Charter, Fence
from ..torchenv import NodeRole, rank_env, resolve_argv
from ..workdir import Cache
from .executor import Executor, RankProc
from .rayhost import (RAY_STOP_GRACE, TEMP_IN_BOX, NoPorts, PortBlocks, RayNode, describe, install_launcher, make_temp_dir, rank_argv,
                      ray_cpus, ray_env, remove_temp_dirs, write_token)
from .sandbox.box import Box, Sandbox, SandboxError
from .sink import EMIT_TIMEOUT, CoordinatorGone, Sink

log = structlog.get_logger("swarmd.jobs")

HEARTBEAT = 0.25  # seconds of silent ranks after which the coordinator is still told the host is there
OUTPUT_BATCH = 0.05  # seconds output is gathered before it is sent on (and flushed to the log)
OUTPUT_BATCH_BYTES = 256 * 1024
# seconds a committed hold waits for its start: the longest a workdir upload may take
# (service.WORKDIR_TIMEOUT, 600 s) and a minute to start; a commit never started lapses
START_WITHIN = 660.0
# seconds a job's checkpoint cache outlives its ranks on a host that is not its hub: the hub
# fetches the checkpoint announced just before the ranks' exit (a failed rank) within seconds
CHECKPOINT_LINGER = 600.0
COORDINATOR_WATCH = 0.25  # seconds between looks at what membership says of a running job's coordinator
READY_TIMEOUT = 60.0  # seconds a start waits for the daemon to finish setting up the sandbox
CHECKPOINT_SCAN = 0.25  # seconds between scans of a rank's checkpoint directory (a rename is seen within 0.5 s)
CHECKPOINT_MAX = 8 * 1024**3  # bytes of one checkpoint this host copies and stores at most
# seconds the exit waits, once the ranks are gone, for the last checkpoint copy (checkpoint_max
# at ~140 MB/s); past it that copy is given up, logged, and the exit told without it
LAST_CHECKPOINT_WAIT = 60.0
# seconds a job's ranks wait for a successor once their coordinator is gone (sink.py): longer
# than membership takes to declare it dead (about 2 s in the lab, 10 s at 5,000 members) and a
# successor to gather the job's record and attach (issue 26)
HANDOVER_PATIENCE = 45.0
# why a peer may not command a job here (succession.Fence's reasons), as it is told
_FENCED = {
    "not_replica": "is not one of the job's replicas (its charter)",
    "not_its_epoch": "does not coordinate the job at that epoch",
    "stale_epoch": "presents an epoch older than the one this host obeys for the job: a successor took it over",
    "charter_changed": "presents a charter that is not the job's",
    "charter_mismatch": "presents the charter of another job",
    "not_coordinator": "is not the job's coordinator here",
    "full": "cannot be fenced here: this host tracks too many jobs",
}
# jobs per coordinator whose kept checkpoints are remembered (the latest start's, or its hub's list):
# more than any coordinator runs here at once, or coordinates live with checkpoints; past it the
# coordinator's own job heard of longest ago is forgotten, never another coordinator's
MAX_KEPT_PER_COORDINATOR = 256


class WorkerError(Exception):
    """A request this host cannot carry out; the message says why."""


class Refused(WorkerError):
    """The ledger refused a move that broke the protocol; `code` is the metric label."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.reason)
        self.code = refusal.code or "refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class StartRequest:
    job: str
    coordinator: str
    role: NodeRole
    cmd: tuple[str, ...]
    env: dict[str, str]
    python: str | None
    workdir: str | None  # digest of a cached tree, or None for an empty directory
    cpus: float = 0.0  # the job's --cpus on this host: its CPU quota (0: this host's share per slot)
    mem_mb: int = 0  # the job's --mem on this host: its memory limit (0: this host's share per slot)
    # (name, sha256, size) of the checkpoints the ranks find in $SWARM_CHECKPOINT_DIR, from the cache
    checkpoints: tuple[tuple[str, str, int], ...] = ()
    ray: str | None = None  # a Ray job (rayhost.py): its cluster's auth token
    serve: Serve | None = None  # a service's replica: given $PORT, checked and announced (Replicas)


@dataclass(frozen=True, slots=True, kw_only=True)
class Serving:
    """A service replica running here (serve/ reads `Worker.serving`: it checks its health at
    127.0.0.1:`port` and announces it in this node's record)."""
    job: str
    origin: str  # the service's controller: the job's origin
    serve: Serve
    port: int


@dataclass(frozen=True, slots=True, kw_only=True)
class JobNodes:
    """What a job's firewall lets it reach, from the membership view: the addresses among
    the job's `node_ips` that belong to members, and every member's daemon (libp2p) ports,
    closed to it wherever they are."""
    addresses: tuple[str, ...] = ()
    daemon_ports: tuple[tuple[str, int], ...] = ()


class Worker:
    def __init__(self, *, ledger: Ledger, cache: Cache, jobs_dir: Path, user: str | None,
                 ifname: Callable[[], str | None] = lambda: None,
                 changed: Callable[[], None] = lambda: None, sandbox: Sandbox | None = None,
                 job_nodes: Callable[[tuple[str, ...]], JobNodes] = lambda ips: JobNodes(),
                 sandbox_later: bool = False, checkpoint_max: int = CHECKPOINT_MAX,
                 checkpoint_keep: int = CHECKPOINT_KEEP, checkpoint_budget: int | None = None,
                 coordinator_gone: Callable[[str], str | None] = lambda peer: None,
                 ray_ports: PortBlocks | None = None, serve_ports: tuple[int, int] = (30000, 30999)) -> None:
        self.ledger = ledger
        self.cache = cache
        self.jobs_dir = jobs_dir
        self.user = user
        self.sandbox = sandbox  # None: ranks run as `user`, unconfined (tests of the protocol alone)
        self.job_nodes = job_nodes
        # why membership says a coordinator is gone (dead, left), or None: its ranks here stop
        self.coordinator_gone = coordinator_gone
        # set once `sandbox` is what it will be: the daemon sets it up after this worker serves
        # requests, and no rank starts before (a start waits, then fails, never runs unconfined)
        self.ready = trio.Event()
        if not sandbox_later:
            self.ready.set()
        self.ifname = ifname  # the mesh interface, when the mesh is up
        self.changed = changed  # this host's offer changed: re-advertise
        self.running: dict[tuple[str, str], Executor] = {}  # (coordinator, job) -> its ranks
        self.dropped_lines = 0  # lines left off coordinators' streams (all are in the logs)
        self.pins: dict[tuple[str, str], str] = {}  # (coordinator, job) -> the workdir shipped for it
        self.checkpoint_max = checkpoint_max  # bytes of one checkpoint, copied or received
        self.checkpoint_keep = checkpoint_keep  # checkpoints kept per (coordinator, job), beside the latest start's
        # job directory (ids.host_dir) -> shas its cache keeps whatever their age: the latest start's,
        # or the hub's list; recorded only for a start the ledger took, bounded per coordinator
        self.checkpoints_kept: dict[str, frozenset[str]] = {}
        self._kept_of: dict[str, dict[str, None]] = {}  # coordinator -> its directories in checkpoints_kept, oldest first
        # (coordinator, job) whose cache here is a live job's hub (this node coordinates it): kept
        # while the job lives; any other job's cache goes when its ranks here end (the hub has them)
        self.hubs: set[tuple[str, str]] = set()
        self.lingering: dict[tuple[str, str], float] = {}  # (coordinator, job) -> when its cache here goes
        # bytes of every job's checkpoint cache on this host together (checkpoints.cache.Budget)
        # (its share per job, checkpoints/cache.py's header; what a cache keeps goes last, read from a thread)
        self.checkpoint_budget = Budget(jobs_dir.resolve(), checkpoint_budget if checkpoint_budget is not None
                                        else BUDGET_FACTOR * checkpoint_max,
                                        protect=lambda name: self.checkpoints_kept.get(name, frozenset()))
        # holds a peer put checkpoints for before their job started here: their caches go with them
        self.put_unstarted: set[tuple[str, str]] = set()
        # running jobs whose ports `swarmctl jobs forward` may reach, as their ranks' uid (forward.py)
        self.forwards = Forwards()
        self.ray_ports = ray_ports or PortBlocks()  # the Ray jobs' port blocks on this host
        self.serve_ports = serve_ports  # service replicas' ports (LOW, HIGH)
        self.serving: dict[tuple[str, str], Serving] = {}  # (origin, job) -> the replica it runs here
        # every replica given a port here, from the moment it is chosen (starts set up at once
        # must not choose the same one) until it ended; `serving` is those that run
        self.serve_held: dict[tuple[str, str], Serving] = {}
        # who may command each job here: its origin, then the highest epoch's coordinator (issue 26)
        self.fence = Fence()
        self.sinks: dict[tuple[str, str], Sink] = {}  # (origin, job) -> where its running ranks' events go
        self.ended: dict[tuple[str, str], trio.Event] = {}  # set when those ranks are done here
        self.outputs: dict[tuple[str, str], RankOutput] = {}  # their output (its log replays to a successor)

    # --- who commands a job (succession.py) ----------------------------------------------

    def authorize(self, job: str, peer: str, origin: str, epoch: int = 0, charter: Charter | None = None) -> None:
        """Whether `peer` may command the job (origin, job) here now: its origin while no charter
        is known, else the coordinator of the highest epoch seen (a higher one, presented
        with the job's charter, becomes it). Refused, counted by its reason, when not."""
        why = self.fence.command(job, peer, origin, epoch, charter,
                                 keep=lambda key: self.ledger.holds(key[1], key[0]) or key in self.running)
        if why is not None:
            raise Refused(Refusal(f"{short(peer)} {_FENCED.get(why, why)}", why))

    async def attach(self, job: str, origin: str, peer: str, emit: Callable[[dict[str, Any]], Awaitable[None]],
                     hello: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """A successor (authorized at its epoch) takes the events of the job's running ranks here
        from now on: `hello` tells it what runs, then `emit` gets every event the sink has
        (the one that waited first), until the ranks are done here."""
        key = (origin, job)
        sink, ended = self.sinks.get(key), self.ended.get(key)
        if sink is None or ended is None:
            raise WorkerError(f"job {job} is not running on this host")
        executor, out = self.running.get(key), self.outputs.get(key)
        await hello({"attached": {"ranks": sorted(r.rank for r in executor.ranks) if executor else [],
                                  "orphaned": sink.orphaned}})
        # every line of the attempt here, from its log, then the live ones: none lost with the
        # gone coordinator's stream (what it read before it went, it had), none sent twice
        replay = out.replay(OUTPUT_BATCH_BYTES) if out is not None else None
        sink.attach(emit, holder=peer, replay=replay.next if replay is not None else None,
                    stale=lambda event: "out" in event or "dropped" in event)
        log.info("a successor took the job's events over", job=job, successor=short(peer))
        await ended.wait()

    # --- reservations --------------------------------------------------------------------

    def reserve(self, job: str, coordinator: str, gpus: int, ranks: int, lease: float) -> Grant | Refusal:
        answer = self.ledger.reserve(trio.current_time(), job, coordinator, gpus, ranks, lease)
        self._unpin_gone()
        self.changed()
        return answer

    def commit(self, job: str, coordinator: str) -> Grant | Refusal:
        answer = self.ledger.commit(trio.current_time(), job, coordinator, START_WITHIN)
        self._unpin_gone()
        return answer

    def pin(self, job: str, coordinator: str, digest: str) -> None:
        """Keep `digest` cached for the hold (coordinator, job), in place of any tree before."""
        self._unpin_gone()
        if not self.ledger.holds(job, coordinator):
            return
        if (old := self.pins.pop((coordinator, job), None)) is not None:
            self.cache.unpin(old)
        if self.cache.pin(digest):
            self.pins[(coordinator, job)] = digest

    def _unpin_gone(self) -> None:
        """Drop the pins of holds that are gone (released, lapsed, finished), and the
        checkpoint caches a peer filled for holds that went without their job starting."""
        for key in [k for k in self.pins if not self.ledger.holds(k[1], k[0])]:
            self.cache.unpin(self.pins.pop(key))
        for coordinator, job in [k for k in self.put_unstarted if not self.ledger.holds(k[1], k[0])]:
            self.put_unstarted.discard((coordinator, job))
            self._remove_unstarted(job, coordinator)

    def _remove_unstarted(self, job: str, coordinator: str) -> None:
        """The job's directory, when it holds nothing but a checkpoint cache (no start of
        the job ever made its work/, home/, checkpoints/ here). A few files: done inline."""
        try:
            top = self.job_dir(job, coordinator)
            if {e.name for e in os.scandir(top)} <= {CACHE_DIR}:
                trees.remove(top)
                log.info("checkpoints put for a hold that ended before its job started here removed",
                         job=job, coordinator=short(coordinator))
        except FileNotFoundError:
            pass
        except (OSError, WorkerError) as exc:  # gc removes it after retention
            log.warning("checkpoints of an unstarted hold not removed", job=job, error=str(exc))

    def drop_checkpoints(self, job: str, coordinator: str) -> None:
        """Remove (coordinator, job)'s checkpoint cache here: its ranks here ended CHECKPOINT_LINGER
        ago, or its hub's job did. The newest checkpoints live on in the hub, which puts them back on any host of
        a later attempt; caches of finished jobs would hold the host's budget for a week."""
        try:
            trees.remove(self.job_dir(job, coordinator) / CACHE_DIR)
        except FileNotFoundError:
            pass
        except (OSError, WorkerError) as exc:  # gc removes it with the directory after retention
            log.warning("a finished job's checkpoints not removed", job=job, error=str(exc))

    def accept_checkpoint_put(self, job: str, coordinator: str) -> Refusal | None:
        """Whether a peer may put a checkpoint into (coordinator, job)'s cache here: only for
        its committed or running hold (a lease is a minute's promise, not a job that will
        run here). A put before the job ever started here is remembered: when the hold goes
        without a start, so does the cache."""
        state = self.ledger.state_of(job, coordinator)
        if state not in ("committed", "running"):
            return Refusal(f"job {job} holds no committed reservation on this host to put a checkpoint for",
                           "no_reservation")
        if state == "committed":
            self.put_unstarted.add((coordinator, job))
        return None

    def release(self, job: str, coordinator: str) -> Refusal | None:
        """Free the job's hold; a running job's ranks are stopped and the hold goes with them."""
        answer = self.ledger.release(job, coordinator)
        if isinstance(answer, Refusal):
            return answer
        if isinstance(answer, Cancel):
            if (executor := self.running.get((coordinator, job))) is not None:
                executor.cancel()
        elif answer:
            self._unpin_gone()
            self.changed()
        return None

    async def sweep(self) -> None:
        """Give back reservations never committed, and commits never started."""
        while True:
            deadlines = [d for d in (self.ledger.next_deadline(), *self.lingering.values()) if d is not None]
            await (trio.sleep_until(min(deadlines)) if deadlines else trio.sleep(1.0))
            if self.ledger.expire(trio.current_time()):
                self._unpin_gone()
                self.changed()
            for job, coordinator in self.lingered(trio.current_time()):
                await trio.to_thread.run_sync(self.drop_checkpoints, job, coordinator)

    def lingered(self, now: float) -> list[tuple[str, str]]:
        """(job, coordinator) whose checkpoint cache here has outlived its ranks by
        CHECKPOINT_LINGER and is not held again (a later attempt placed here keeps it)."""
        due = [k for k, t in self.lingering.items() if t <= now]
        for key in due:
            del self.lingering[key]
        return [(job, coordinator) for coordinator, job in due
                if not self.ledger.holds(job, coordinator) and (coordinator, job) not in self.hubs]

    @property
    def ranks(self) -> int:
        return sum(len(e.ranks) for e in self.running.values())

    def busy_dirs(self) -> list[str]:
        """Names of the job directories this host still holds or runs (kept by gc)."""
        return [host_dir(j, c) for c, j in {*self.running, *self.ledger.held()}]

    def job_dir(self, job: str, coordinator: str) -> Path:
        """`jobs_dir/<job>-<coordinator hash>`, for a job id only, and only if it resolves
        inside `jobs_dir`."""
        check_job_id(job)
        root = self.jobs_dir.resolve()
        top = (root / host_dir(job, coordinator)).resolve()
        if top.parent != root:
            raise WorkerError(f"job {job}: its directory would be {top}, outside {root}")
        return top

    # --- running ------------------------------------------------------------------------

    async def start(self, req: StartRequest, emit: Callable[[dict[str, Any]], Awaitable[None]]) -> dict[int, int]:
        """Run this host's ranks of a job to the end, telling `emit` as things happen; an
        exception out of `emit` (the coordinator went away) stops the ranks."""
        top = self.job_dir(req.job, req.coordinator)  # ValueError: not a job id
        if req.role.job_id != req.job:
            raise ValueError(f"'role.job_id' is {req.role.job_id[:40]!r}, not the job's id")
        if req.workdir is not None and not self.cache.has(req.workdir):
            raise WorkerError(f"workdir {req.workdir[:12]} is not on this host")
        if missing := [f"{name} ({sha[:12]})" for name, sha, _ in req.checkpoints
                       if self.checkpoint_path(req.job, req.coordinator, sha) is None]:
            raise WorkerError(f"checkpoint {', '.join(missing)} is not on this host")
        with trio.move_on_after(READY_TIMEOUT):
            await self.ready.wait()
        if not self.ready.is_set():
            raise WorkerError(f"this host's job sandbox was not set up within {READY_TIMEOUT:g} s")
        started = self.ledger.start(req.job, req.coordinator, req.role.procs_per_node)
        if isinstance(started, Refusal):
            raise Refused(started)
        self._started_with(req.job, req.coordinator, req.checkpoints)  # a refused start changes nothing
        self.put_unstarted.discard((req.coordinator, req.job))  # started: its cache stays (gc.py)
        codes: dict[int, int] = {}
        executor: Executor | None = None
        out = RankOutput(top / "output.log")
        try:
            role = dataclasses.replace(req.role, ifname=self.ifname(), gpus=started.gpus,
                                       checkpoint_dir=str(top / "checkpoints"))
            base = _base_env(top)
            argv = resolve_argv(req.cmd, req.python)
            wake = trio.Event()

            def on_output(rank: int, line: bytes) -> None:
                out.add(rank, line)
                wake.set()

            # the coordinator's stream (one frame at a time: the checkpoint watcher sends too);
            # a job nobody can take over (no charter with other replicas: patience None) stops
            # when it is gone, any other waits for a successor's attach (sink.py)
            key = (req.coordinator, req.job)
            seen = self.fence.seen(key)
            handover = seen is not None and len(seen.charter.replicas) > 1
            sink = Sink(emit, emit_timeout=EMIT_TIMEOUT, patience=HANDOVER_PATIENCE if handover else None,
                        holder=seen.coordinator if seen is not None else req.coordinator)
            self.sinks[key], self.ended[key], self.outputs[key] = sink, trio.Event(), out
            send = sink.send

            serving = self._serving(req) if req.serve is not None else None
            if serving is not None:
                self.serve_held[key] = serving
            async with self._box(req, top, started.gpus, serves=serving.port if serving else None) as box:
                if box.uid is not None:
                    base |= {"USER": f"job{box.uid}", "LOGNAME": f"job{box.uid}"}
                cwd = await trio.to_thread.run_sync(self._prepare, top, req.workdir, box.uid, req.checkpoints)
                watcher = Watcher(CkptCache(top, self.checkpoint_budget), top / "checkpoints", job_uid=self._job_uid(box),
                                  max_size=self.checkpoint_max, keep=self.checkpoint_keep,
                                  protect=lambda: self.kept_checkpoints(req.job, req.coordinator),
                                  listed=req.checkpoints)
                ray: dict[str, Any] = {}
                if req.ray is not None:
                    try:  # in this thread: the blocks are the trio side's alone
                        block = self.ray_ports.take((req.coordinator, req.job))
                    except NoPorts as exc:
                        raise WorkerError(str(exc)) from None
                    argv, extra, ray["ray"] = await trio.to_thread.run_sync(self._ray_node, req, role, top, box,
                                                                            block)
                    base |= extra
                if serving is not None:
                    base |= {"PORT": str(serving.port), "SWARM_SERVICE": serving.serve.service,
                             "SWARM_REPLICA": str(serving.serve.replica)}
                ranks = [RankProc(rank=role.node_rank * role.procs_per_node + i, local_rank=i, argv=argv,
                                  env=_confined_gpus(rank_env(role, i, req.env, base), box, role.gpus), cwd=cwd)
                         for i in range(role.procs_per_node)]
                executor = Executor(req.job, ranks, user=self.user, on_output=on_output,
                                    box=box if box.prefix else None, grace=RAY_STOP_GRACE if req.ray else 5.0)
                self.running[(req.coordinator, req.job)] = executor
                self.forwards.running((req.coordinator, req.job), _uid_or_own(self._job_uid(box)))
                if serving is not None:
                    self.serving[key] = serving
                self.changed()
                async with lone_error(), trio.open_nursery() as nursery:
                    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                        codes.update(await executor.run(task_status=task_status))
                        wake.set()

                    await nursery.start(run)
                    nursery.start_soon(_flusher, out)
                    watching, watched = trio.Event(), trio.Event()
                    nursery.start_soon(_watch, watcher, send, watching, watched)
                    nursery.start_soon(self._watch_coordinator, sink)
                    await send({"started": [r.rank for r in ranks], "sandbox": box.describe(), **ray})
                    while not codes or out.pending:
                        with trio.move_on_after(HEARTBEAT) as idle:
                            await wake.wait()
                        if idle.cancelled_caught:
                            await send({"hb": True})  # fails once the coordinator is gone: the ranks stop
                            continue
                        wake = trio.Event()
                        if not codes:
                            await trio.sleep(OUTPUT_BATCH)
                        while out.pending:
                            batch, dropped = out.take(OUTPUT_BATCH_BYTES)
                            if dropped:
                                await send({"dropped": dropped})
                            if batch:
                                await send({"out": batch})
                    watching.set()  # the ranks are gone: what they completed is told before the exit
                    give_up = trio.current_time() + LAST_CHECKPOINT_WAIT
                    while not watched.is_set() and trio.current_time() < give_up:
                        with trio.move_on_at(min(give_up, trio.current_time() + HEARTBEAT)):
                            await watched.wait()  # a large last copy: the coordinator still hears from us
                        if not watched.is_set():
                            await send({"hb": True})
                    if not watched.is_set():  # stuck (a job's FUSE mount) or too slow: the exit goes without it
                        log.warning("the last checkpoint copy of a job is given up", job=req.job,
                                    waited=LAST_CHECKPOINT_WAIT, directory=str(top / "checkpoints"))
                    nursery.cancel_scope.cancel()  # the flusher, and a watcher still at it
            out.flush()
            first = executor.first_failure
            await send({"exit": sorted(codes.items()), "first": list(first) if first else None,
                        **_usage(box, codes)})
            return codes
        finally:
            await self._clean_up(req, top, executor, out)

    async def _clean_up(self, req: StartRequest, top: Path, executor: Executor | None, out: RankOutput) -> None:
        """What a start took, given back, each step on its own: one that fails is logged and
        the others still run (a RecursionError out of the Ray temp dir's removal once skipped
        the ledger's finish: the slot and GPUs stayed held for good, issue 23, finding 5)."""
        key = (req.coordinator, req.job)

        def count_dropped() -> None:
            self.dropped_lines += out.dropped_total
            if out.dropped_total:
                log.info("rank output left off a slow coordinator's stream", job=req.job,
                         lines=out.dropped_total, log=str(out.log))

        def linger() -> None:
            if key not in self.hubs:  # the hub may still be fetching the last one
                self.lingering[key] = trio.current_time() + CHECKPOINT_LINGER

        def done() -> None:
            self.outputs.pop(key, None)
            if self.sinks.get(key) is not None:
                del self.sinks[key]
            if (ended := self.ended.pop(key, None)) is not None:
                ended.set()

        _each(req.job, [("stop the ranks", executor.cancel if executor is not None else lambda: None),
                        ("flush the output log", out.flush), ("count dropped output", count_dropped),
                        ("forget the ranks", lambda: self.running.pop(key, None)),
                        ("stop announcing the replica", lambda: self.serving.pop(key, None)),
                        ("give back the replica's port", lambda: self.serve_held.pop(key, None)),
                        ("end the forwards", lambda: self.forwards.ended(key)),
                        ("give back the Ray ports", lambda: self.ray_ports.give_back(key))])
        if req.ray is not None:  # Ray's temp dir outside the sandbox's private /tmp: the job shaped it
            with trio.CancelScope(shield=True):  # a cancelled start removes it too, before the slot goes
                try:
                    await trio.to_thread.run_sync(remove_temp_dirs, top)
                except Exception as exc:
                    _failed(req.job, "remove the Ray temp dir", exc)
        _each(req.job, [("release the slot and GPUs", lambda: self.ledger.finish(req.job, req.coordinator)),
                        ("let the checkpoint cache linger", linger), ("drop workdir pins", self._unpin_gone),
                        ("stamp the finish", lambda: _stamp(top)), ("readvertise", self.changed),
                        ("let a successor's attach end (the hold is free now)", done)])

    # --- checkpoints (checkpoints/cache.py) ---------------------------------------------------------

    def checkpoint_cache(self, job: str, coordinator: str) -> CkptCache:
        return CkptCache(self.job_dir(job, coordinator), self.checkpoint_budget)

    def checkpoint_path(self, job: str, coordinator: str, sha: str) -> Path | None:
        """The cached checkpoint `sha` of (coordinator, job) on this host, or None."""
        if not is_sha256(sha):
            return None
        return self.checkpoint_cache(job, coordinator).path(sha)

    def incoming_checkpoint(self, job: str, coordinator: str, size: int) -> Path:
        """A fresh temporary file in (coordinator, job)'s cache for a checkpoint of `size`
        bytes that the caller writes (RemoteHost.get_checkpoint) and then hands to
        `store_checkpoint`, which moves it into place; one left behind is removed by the
        cache's prune (checkpoints.cache.TEMP_AGE) or with the job's directory. WorkerError when
        the checkpoint is over checkpoint_max or the disk has no room for it."""
        self._check_size(size)
        try:
            return self.checkpoint_cache(job, coordinator).incoming_path(size)
        except (CheckpointError, OSError) as exc:
            raise WorkerError(f"no room for a checkpoint of {size} bytes: {exc}") from None

    def _check_size(self, size: int) -> None:
        if not 0 <= size <= self.checkpoint_max:
            raise WorkerError(f"a checkpoint of {size} bytes is over this host's checkpoint_max "
                              f"of {self.checkpoint_max}")

    async def store_checkpoint(self, job: str, coordinator: str, sha: str, size: int, src: Path) -> Path:
        """Copy the file `src` into (coordinator, job)'s cache as `sha`, verified (its sha256
        and `size`); the cache is then pruned. A file of `incoming_checkpoint` is moved into
        place, not copied, and removed whatever happens. WorkerError when it cannot be."""
        cache = self.checkpoint_cache(job, coordinator)
        if not 0 <= size <= self.checkpoint_max:
            if cache.is_incoming(src):
                await trio.to_thread.run_sync(functools.partial(src.unlink, missing_ok=True))
            self._check_size(size)

        def store() -> Path:
            path = cache.store_file(sha, size, src)
            cache.prune(self.checkpoint_keep, {sha, *self.kept_checkpoints(job, coordinator)})
            return path

        try:
            return await trio.to_thread.run_sync(store)
        except (CheckpointError, OSError) as exc:
            raise WorkerError(f"checkpoint {sha[:12]}: {exc}") from None

    def keep_checkpoints(self, job: str, coordinator: str, shas: Iterable[str]) -> None:
        """Keep `shas` in (coordinator, job)'s cache however old (until the next start or
        call names others): the hub's own list, which a prune by age must not undercut. At
        most MAX_KEPT_PER_COORDINATOR jobs per coordinator: its job heard of longest ago goes."""
        name = host_dir(job, coordinator)
        mine = self._kept_of.setdefault(coordinator, {})
        mine.pop(name, None)
        mine[name] = None
        self.checkpoints_kept[name] = frozenset(shas)
        while len(mine) > MAX_KEPT_PER_COORDINATOR:
            oldest = next(iter(mine))
            del mine[oldest]
            self.checkpoints_kept.pop(oldest, None)

    def kept_checkpoints(self, job: str, coordinator: str) -> frozenset[str]:
        return self.checkpoints_kept.get(host_dir(job, coordinator), frozenset())

    def _started_with(self, job: str, coordinator: str, listed: tuple[tuple[str, str, int], ...]) -> None:
        """A job's latest start here, once the ledger took it: its cache keeps the checkpoints
        it listed (a refused start must not rewrite, or evict, anyone's)."""
        self.keep_checkpoints(job, coordinator, (sha for _, sha, _ in listed))

    def _ray_node(self, req: StartRequest, role: NodeRole, top: Path, box: Box,
                  base: int) -> tuple[list[str], dict[str, str], dict[str, int]]:
        """A Ray job's rank here (rayhost.py): this host's Ray node, and on the first host the
        driver; its token file and launcher in the job's directory, `base` its port block."""
        memory, cpus = self._quota(req)
        uid = self._job_uid(box)
        token = top / "ray-token"
        write_token(token, req.ray or "", uid, None if box.uid is not None or uid is None else pwd.getpwuid(uid).pw_gid)
        head = role.node_rank == 0
        addr = f"[{role.master_addr}]" if ":" in role.master_addr else role.master_addr
        node = RayNode(head=head, ip=role.node_ips[role.node_rank], gcs=str(role.master_port) if head else
                       f"{addr}:{role.master_port}", base=base, nodes=role.nnodes, cpus=ray_cpus(cpus),
                       gpus=len(role.gpus), memory=memory,
                       temp=TEMP_IN_BOX if "namespaces" in box.parts else str(make_temp_dir(top, uid)))
        python = resolve_argv(["python"], req.python)[0]
        argv = rank_argv(python, install_launcher(top), node, resolve_argv(req.cmd, req.python))
        return argv, ray_env(token), describe(node)

    def _quota(self, req: StartRequest) -> tuple[int, float]:
        """The job's memory (bytes) and cores on this host: what it asked for, at most this
        whole host (placement saw what was free), else one slot's share."""
        total_memory, cores = _memory_total(), float(os.cpu_count() or 1)
        memory = min(req.mem_mb * 2**20, total_memory) if req.mem_mb else self.ledger_share(total_memory)
        cpus = min(req.cpus, cores) if req.cpus else self.ledger_share(cores)
        return int(memory), cpus

    def _job_uid(self, box: Box) -> int | None:
        """The uid the job's files are owned by, where this host knows it."""
        if box.uid is not None:
            return box.uid
        if os.geteuid() == 0 and self.user:
            return pwd.getpwnam(self.user).pw_uid
        return None

    async def _watch_coordinator(self, sink: Sink) -> None:
        """Ranks never run on for a coordinator membership declared dead or gone (a crash, or a
        partition that cut this host off from it): its job has been placed elsewhere by then,
        unless a successor takes it over (the sink waits for one, sink.py). Whoever holds the
        sink is watched: the origin, then each successor that attached."""
        while True:
            holder = sink.holder
            if sink.orphaned is None and (why := self.coordinator_gone(holder)) is not None:
                if sink.patience is None:
                    raise CoordinatorGone(f"membership declared the coordinator {why}")
                sink.orphan(f"membership declared the coordinator {short(holder)} {why}")
            await trio.sleep(COORDINATOR_WATCH)

    def cancel(self, job: str, coordinator: str) -> bool | Refusal:
        """Stop a running job's ranks; only its own coordinator may."""
        if (refusal := self.ledger.check_holder(job, coordinator)) is not None:
            return refusal
        executor = self.running.get((coordinator, job))
        if executor is None:
            return False
        executor.cancel()
        return True

    def _serving(self, req: StartRequest) -> Serving:
        """A port for a service replica: the lowest of the range no replica here holds (running or
        being set up: ``serve_held``) and nothing listens on; one replica of a (controller,
        service, index) at a time here."""
        assert req.serve is not None
        mine = (req.coordinator, req.serve.service, req.serve.replica)
        if any((s.origin, s.serve.service, s.serve.replica) == mine for s in self.serve_held.values()):
            raise WorkerError(f"replica {req.serve.replica} of {req.serve.service} already runs on this host")
        held = {s.port for s in self.serve_held.values()}
        low, high = self.serve_ports
        for port in range(low, high + 1):
            if port not in held and _bindable(port):
                return Serving(job=req.job, origin=req.coordinator, serve=req.serve, port=port)
        raise WorkerError(f"no free service port on this host ({low}-{high} all taken)")

    @contextlib.asynccontextmanager
    async def _box(self, req: StartRequest, top: Path, gpus: tuple[int, ...],
                   serves: int | None = None) -> AsyncIterator[Box]:
        """The job's sandbox on this host for as long as its ranks run (a bare Box without one)."""
        if self.sandbox is None:
            yield Box(uid=None, parts=())
            return
        nodes = self.job_nodes(req.role.node_ips)
        memory, cpus = self._quota(req)
        try:
            async with self.sandbox.open(job=req.job, top=top, cwd=top / "work", memory=memory, cpus=cpus,
                                         gpus=gpus, nodes=nodes.addresses, blocked=nodes.daemon_ports,
                                         serves=serves) as box:
                yield box
        except SandboxError as exc:
            raise WorkerError(str(exc)) from None

    def ledger_share(self, total: float) -> float:
        """One slot's share of this host's `total` (memory, cores): a job's limit when it asked for none."""
        return total / max(self.ledger.slots, 1)

    def _prepare(self, top: Path, workdir: str | None, uid: int | None = None,
                 listed: tuple[tuple[str, str, int], ...] = ()) -> Path:
        """The job's directory, made afresh: `home/`, a writable copy of its workdir in
        `work/`, and `checkpoints/` holding the listed checkpoints, handed to the job's uid
        (or user) once complete. Its checkpoint cache (checkpoints/cache.py) is kept."""
        clear_job_dir(top)  # nobody else reaches in while it is built (0700)
        work, checkpoints, home, tmp = top / "work", top / "checkpoints", top / "home", top / "tmp"
        if workdir is not None:
            with self.cache.hold(workdir) as tree:  # not evicted while it is copied
                trees.copy(tree, work)  # the cache caps its depth; never recursion here all the same
        else:
            os.mkdir(work)
        os.chmod(work, 0o700)  # the workdir's own mode aside: the job's alone
        os.mkdir(checkpoints, 0o700)
        os.mkdir(home, 0o700)
        os.mkdir(tmp, 0o700)
        if uid is not None:
            for d in (work, checkpoints, home, tmp):
                _chown_fresh(d, uid, uid)
        elif os.geteuid() == 0 and self.user:
            entry = pwd.getpwnam(self.user)
            for d in (work, checkpoints, home, tmp):
                _chown_fresh(d, entry.pw_uid, entry.pw_gid)
        if listed:  # after the chown: the links stay the daemon's, the job cannot change the cache
            cache = CkptCache(top)
            try:
                cache.install(checkpoints, listed)
            except CheckpointError as exc:
                raise WorkerError(str(exc)) from None
            cache.prune(self.checkpoint_keep, {sha for _, sha, _ in listed})
        os.chmod(top, 0o711)  # the job user passes through to its own directories, reads nothing else
        return work


def _bindable(port: int) -> bool:
    """Nothing listens on TCP `port` of any address here (a replica binds 0.0.0.0 or the overlay's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _uid_or_own(uid: int | None) -> int:
    """The ranks' uid: the job's, else this daemon's own (not root: ranks run as it)."""
    return os.geteuid() if uid is None else uid


def _confined_gpus(env: dict[str, str], box: Box, gpus: tuple[int, ...]) -> dict[str, str]:
    """Inside the sandbox a job's /dev holds only its own GPUs, which CUDA numbers from 0 (as
    under Slurm's ConstrainDevices); SWARM_GPUS keeps this host's indices."""
    env["SWARM_GPUS"] = ",".join(map(str, gpus))
    if "namespaces" in box.parts:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpus)))
    return env


def _usage(box: Box, codes: dict[int, int]) -> dict[str, Any]:
    """The exit event's account of the job on this host: the sandbox it had, peak memory and
    CPU time from its cgroup, and the ranks the kernel killed for memory."""
    fields: dict[str, Any] = {"sandbox": box.describe()}
    if box.usage is None:
        return fields
    fields["usage"] = {"peak_memory": box.usage.peak_memory, "cpu_seconds": box.usage.cpu_seconds}
    if box.usage.oom_kills:
        killed = [rank for rank, code in sorted(codes.items()) if code == 128 + signal.SIGKILL]
        fields["oom"] = {"ranks": killed, "limit": box.memory_limit}
    return fields


def _memory_total() -> float:
    import psutil

    return float(psutil.virtual_memory().total)


async def _watch(watcher: Watcher, send: Callable[[dict[str, Any]], Awaitable[None]], stop: trio.Event,
                 done: trio.Event) -> None:
    """Tell each checkpoint as it completes, every CHECKPOINT_SCAN; once `stop` is set (the
    ranks have exited) two scans more, so a checkpoint renamed just before the end is stable
    and told; then `done`."""
    async def tell(name: str, sha: str, size: int) -> None:
        with trio.CancelScope(shield=True):  # never half a frame on the stream (send is bounded)
            await send({"ckpt": [name, sha, size]})

    try:
        while not stop.is_set():
            with trio.move_on_after(CHECKPOINT_SCAN):
                await stop.wait()
            for checkpoint in await watcher.poll():
                await tell(*checkpoint)
        for _ in range(2):
            for checkpoint in await watcher.poll():
                await tell(*checkpoint)
    finally:
        done.set()


async def _flusher(out: RankOutput) -> None:
    while True:
        await trio.sleep(OUTPUT_BATCH)
        out.flush()


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


def _chown_fresh(root: Path, uid: int, gid: int) -> None:
    """Hand a tree the daemon has just created (inside a directory only it can reach) to the
    job user, links never followed, at any depth (trees.py)."""
    trees.give(root, uid, gid)


def _each(job: str, steps: Iterable[tuple[str, Callable[[], object]]]) -> None:
    """Run every step of a clean-up, whatever the ones before did; a failure is logged."""
    for what, do in steps:
        try:
            do()
        except Exception as exc:  # the next steps matter more than this one's reason
            _failed(job, what, exc)


def _failed(job: str, step: str, exc: Exception) -> None:
    log.warning("a step of a job's clean-up failed", job=job, step=step, error=f"{exc.__class__.__name__}: {exc}")


def _stamp(top: Path) -> None:
    """The job finished now: garbage collection counts from here (no directory: nothing to collect)."""
    with contextlib.suppress(FileNotFoundError):
        os.utime(top)


def _base_env(top: Path) -> dict[str, str]:
    """A clean start: the interpreter's own bin first on PATH (a rank that runs `python` in a
    subprocess gets swarmd's, with torch), HOME in the job's own directory (the job user's
    may not exist, `nobody`'s is /nonexistent, and torch keeps caches there), and its temp
    and caches there too, in every sandbox mode: never in the host's /tmp, where a job that
    ran before under the same uid or user could have planted them (TorchInductor's default
    /tmp/torchinductor_$USER holds code it runs; Triton's and the XDG caches follow HOME).
    The job's env may point them elsewhere: its own choice."""
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    home, tmp = top / "home", top / "tmp"
    return {"PATH": path, "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": str(home), "TMPDIR": str(tmp),
            "XDG_CACHE_HOME": str(home / ".cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp / "torchinductor"),
            "TRITON_CACHE_DIR": str(home / ".triton" / "cache")}
