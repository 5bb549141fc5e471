"""Jobs on this daemon (trio): the coordinator of jobs submitted here, and their records.

`swarmctl jobs run` → `submit` → one task per job, which lives on in the daemon whether
or not the client stays: placement (sans-IO, placement.py) → gang reservation (gang.py)
over the job protocol, retried with other hosts → commit (rank 0's host picks MASTER_PORT)
→ the workdir shipped to hosts that lack it → every host starts its ranks, and their
output and exit codes stream back here. The job's states (run.py) and output are written
to the store as they happen; `watch` lets any number of clients follow a job.

Elastic jobs (run.py has the rules): an attempt ends at the first of a host's stream or
heartbeat breaking, membership declaring a host dead (`watch` in `_start_all`, every
WATCH_EVERY), or a rank exiting non-zero; every other host is told to stop at once. With
restarts left, the survivors are kept (placement's `require`), the lost hosts avoided (placed
again only where nothing else fits: a replica pinned to its host), the gang reserved again,
the workdir shipped where it is missing, the job's newest checkpoints put on every host
(hub.py), and the ranks started with the next restart count.

Growth (growth.py has the rule): right after a new checkpoint of a running MIN:MAX job below
MAX is recorded, placement is asked for a bigger gang that keeps every running host; the
hosts it adds are reserved and committed, and given the workdir and the job's checkpoints
while the attempt still runs (`_grow`, `_stage`): only once all of that is done is the
attempt stopped (`Run.grow`) and the next placed on the survivors and those hosts, exactly as
a restart, from that checkpoint, spending none of `max_restarts` (its setup then finds the
transfers done: the pause is the stop and the start, not the copies). A refused reservation
or setup leaves the job running as it is. A joining host that is gone by the next placement
is left out.

A host that refuses its part of an attempt's setup (the workdir ship, a checkpoint put: its
checkpoint budget, its disk, a broken stream) is treated as a refused reservation: the gang
is released and the attempt placed again without it (`HostsRefused`), at most
gang.MAX_ATTEMPTS times, rather than failing the job (issue 23 #4).

A host's events are a peer's input (events.py): anything malformed is counted as
`job_event` and the host is lost to the job. A host silent past hosts.EVENT_TIMEOUT is
lost too, so no host can leave a job running or shipping forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import Any

import msgpack
import structlog
import trio

from ...atomic import write_atomically
from ...gossip.membership import State, View
from ...gossip.wire import JobSlots, Record
from ...p2p import multiaddrs
from ...p2p.signed import Invalid, short
from ...p2p.transport import Transport
from .. import groups as latency
from ..events import checked_event
from ..host.sandbox.box import Sandbox, Settings
from ..host.worker import StartRequest, Worker, stop_orphans
from ..ids import host_dir
from ..messages import TOKEN
from ..nursery import lone_error
from ..ports import Swarm
from ..spec import MAX_TEXT, JobSpec, SpecError, describe
from ..succession import Charter, check_removed, quorum, spec_digest, takeover
from ..succession import Record as JobRecord
from ..torchenv import NodeRole
from ..workdir import WorkdirError, is_digest, pack
from . import gang as gangmod
from . import gc, growth
from .hosts import Authority, Host, HostError, LocalHost, RemoteHost
from .hub import HostsRefused, Hub, Listed
from .placement import Candidate, NoFit, Placement, Rtt, place
from .replication import Writer, ended
from .run import TERMINAL, Run
from .store import JobRow, JobStore, RankRow

log = structlog.get_logger("swarmd.jobs")

KEEPALIVE = 5.0  # seconds of silence after which a follower is told the job goes on
LOST_BEFORE = "lost in an earlier attempt"  # placement's word for a host it avoids
WAIT_POLL = 1.0  # seconds between placement attempts of a job that waits for capacity
LOST_REASON = "the coordinating daemon restarted while the job was running"
WATCH_EVERY = 0.25  # seconds between looks at the membership view for a job's dead hosts
SUCCESSION_EVERY = 0.25  # seconds between looks for jobs this node is a replica of whose coordinator is gone
FOLLOW_EVERY = 1.0  # seconds between an origin's looks at its job that another replica coordinates
CONFIRM_RETRY = 2.0  # seconds between writes of a record that no majority of its replicas took
DRAIN_TIMEOUT = 30.0  # seconds a successor waits for ranks its predecessor started to stop
TAKEOVER_RETRY = 1.0  # seconds between two tries of one job's takeover (one short of a majority)
MIN_REPLICAS = 3  # a job's charter names at least this many replicas where the swarm has them (witnesses)
# seconds a coordinator cut off from a majority of the job's replicas waits (commanding nothing)
# before it fails the job, or takes the end it saw: beyond a partition this long, a successor
# on the other side and this node may both have ended it their own way (Slurm's SlurmctldTimeout)
CONFIRM_PATIENCE = 120.0
# seconds an origin following its job waits, every other replica gone (dead, left, or unknown to
# a swarm it is in), before it marks the job lost: the hosts stopped its ranks after 45 s without a
# coordinator, and a takeover needs a majority of the replicas. As long as a coordinator cut off
# waits (above): only a partition longer than that ends a job on one side that goes on on the other
LOST_AFTER = CONFIRM_PATIENCE


@dataclasses.dataclass(slots=True)
class _Live:
    run: Run
    spec: JobSpec
    hub: Hub  # the job's checkpoints
    store: JobStore  # where its row, ranks and output are kept: this node's own, or its successor's store
    auth: Authority  # its origin, and the epoch and charter this node commands its hosts by
    changed: trio.Event = dataclasses.field(default_factory=trio.Event)
    workdir: str | None = None
    shipped: int = 0
    ship_total: int = 0
    hosts: dict[str, Host] = dataclasses.field(default_factory=dict)
    setup: trio.CancelScope | None = None  # shipping and checkpoint transfers: a cancel cuts them short
    checkpointed: trio.Event = dataclasses.field(default_factory=trio.Event)  # set: a new checkpoint recorded
    joining: dict[str, Host] = dataclasses.field(default_factory=dict)  # held by a growth, not yet placed
    ray: str | None = None  # a Ray job's auth token, given to its hosts with the start
    addresses: dict[str, str] = dataclasses.field(default_factory=dict)  # the attempt's hosts' addresses in the job
    grouping: dict[str, Any] | None = None  # the attempt's latency groups and the RTTs that made them (_grouping)
    # its replicas (succession.py): the sequence of its last write, what each replica said of
    # it, and since when this node coordinates the job (its submission, or its takeover)
    seq: int = 0
    since: float = dataclasses.field(default_factory=time.time)
    replicated: dict[str, str | None] = dataclasses.field(default_factory=dict)
    dirty: bool = False  # a transition not yet written to the replicas
    writing: bool = False
    cut_off: bool = False  # no majority of the replicas answered for CONFIRM_PATIENCE
    # the quorum's configuration (succession.quorum): replicas removed, committed and being removed
    removed: frozenset[str] = frozenset()
    removing: frozenset[str] | None = None
    recorded_removed: frozenset[str] = frozenset()  # the configuration a majority holds as committed
    reconfiguring: bool = False

    def touch(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def charter(self) -> Charter | None:
        return self.auth.charter

    @property
    def epoch(self) -> int:
        return self.auth.epoch


class Superseded(Exception):
    """A replica holds the job at a higher epoch: another node coordinates it now."""


class Jobs:
    def __init__(self, *, store: JobStore, worker: Worker, gossip: Swarm, archives: Path,
                 retention: float = 7 * 86400.0, sandbox: Settings | None = None,
                 path_rtt: Callable[[], Rtt] | None = None,
                 reject: Callable[[str, str, str], None] | None = None,
                 transport: Transport | None = None, replication: Writer | None = None,
                 handed: JobStore | None = None, grow_every: float = growth.GROW_EVERY_S) -> None:
        self.store = store
        self.grow_every = grow_every  # seconds between two growths of a job (growth.py)
        # jobs this node took over from another origin: their rows and output, never listed to
        # this node's users (the owner is a member elsewhere), served to the origin alone
        self.handed = handed or store
        self.transport = transport  # the job protocol's streams to other hosts (None: a test's own hosts)
        self.worker = worker
        self.sandbox = sandbox  # what the worker's sandbox is set up from, at run
        self.gossip = gossip
        self.archives = archives
        self.retention = retention  # finished jobs' directories, records and logs (gc.py)
        self.live: dict[str, _Live] = {}
        self._nursery: trio.Nursery | None = None
        # the node's path choice (routing's rtt_function), wired by node.py: then pairs are
        # measured by the paths jobs will use and pairs nobody probed by coordinates
        self.path_rtt = path_rtt
        self.reject = reject or gossip.reject  # a member's bad input, counted (node.py: under "jobs")
        self.replication = replication  # jobs' records to their replicas (replication.py); None: not kept
        self.following: dict[str, dict[str, Any]] = {}  # this node's jobs another replica coordinates
        self._heads: dict[str, tuple[str, Charter]] = {}  # of those running: their first host, the charter
        self._tried: dict[tuple[str, str], int] = {}  # the epoch this process last tried to take a job over at
        self._retry: dict[tuple[str, str], float] = {}  # no new try at a takeover before then

    def job_slots(self) -> JobSlots:
        """What this node's record says of its job slots (gossip's `Above.job_slots`)."""
        ledger = self.worker.ledger
        return JobSlots(slots=ledger.slots, free=ledger.slots_free, gpus_free=len(ledger.gpus_free),
                        ranks=self.worker.ranks)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        handed_over: list[str] = []  # this node's jobs its replicas carry on: followed, not failed
        if self.replication is not None:
            store = self.replication.store
            held = await trio.to_thread.run_sync(store.load)
            log.info("jobs' records held as a replica", records=held, removed=store.removed)
            handed_over = [job for origin, job in store.held.keys()
                           if origin == self.gossip.me and (r := store.get((origin, job))) is not None and not ended(r)]
        lost = self.store.recover(LOST_REASON, keep=handed_over)
        if lost:
            log.warning("jobs lost in a restart marked failed", jobs=lost)
        if orphans := await trio.to_thread.run_sync(stop_orphans, self.worker.jobs_dir):
            log.warning("ranks left by the previous run killed", pids=orphans)
        if stale := await trio.to_thread.run_sync(lambda: gc.parts(self.archives)):
            log.info("unfinished uploads of the previous run removed", files=stale)
        try:
            await self._serve(task_status, handed_over)
        finally:
            if self.worker.sandbox is not None:
                await self.worker.sandbox.close()

    async def _serve(self, task_status: trio.TaskStatus[None], handed_over: list[str]) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.replication is not None:
                nursery.start_soon(self._succession)
                for job in handed_over:
                    log.info("a job of this node's is carried on by its replicas: followed", job=job)
                    nursery.start_soon(self._follow, job)
            nursery.start_soon(self.worker.sweep)
            nursery.start_soon(functools.partial(
                gc.collect, jobs_dir=self.worker.jobs_dir, archive_dir=self.archives, retention=self.retention,
                held=lambda: [*self.worker.busy_dirs(), *(host_dir(j, v.auth.origin) for j, v in self.live.items())],
                needed=lambda: [live.workdir for live in self.live.values() if live.workdir],
                prune=lambda before: [*self.store.prune(before),
                                      *(self.handed.prune(before) if self.handed is not self.store else [])]))
            if self.sandbox is not None:  # after the orphans: what they left in cgroups goes too
                self.worker.sandbox = await Sandbox.start(self.sandbox)
            self.worker.ready.set()  # starts that came in meanwhile waited for it
            task_status.started()
            await trio.sleep_forever()

    def status(self) -> dict[str, Any]:
        ledger = self.worker.ledger
        return {"slots": ledger.slots, "slots_free": ledger.slots_free, "gpus_free": list(ledger.gpus_free),
                "ranks_here": self.worker.ranks, "user": self._rank_user(),
                "coordinating": sorted(self.live), "output_dropped": self.worker.dropped_lines,
                # what holds this host's slots: a provider sees whose jobs run here
                "holding": [{"job": job, "coordinator": coordinator, "state": ledger.state_of(job, coordinator)}
                            for coordinator, job in sorted(ledger.held(), key=lambda k: (k[1], k[0]))]}

    def _rank_user(self) -> str | None:
        sandbox = self.worker.sandbox
        if sandbox is not None and sandbox.pool is not None:
            return f"a uid of its own per job ({sandbox.settings.uids[0]}-{sandbox.settings.uids[1]})"
        return self.worker.user

    def sandbox_status(self) -> dict[str, Any]:
        if self.worker.sandbox is None:
            return {"mode": self.sandbox.mode if self.sandbox else "off", "active": False, "complete": False,
                    "parts": {}}
        return self.worker.sandbox.status()

    # --- the RPC side -------------------------------------------------------------------

    def submit(self, spec: JobSpec, workdir: str | None, uid: int) -> str:
        assert self._nursery is not None
        me = self.gossip.me
        job = self.store.new_id()
        self.store.add(JobRow(id=job, name=spec.name, spec={**spec.to_wire(), "workdir_digest": workdir},
                              state="placing", coordinator=me, submitted_by=uid, created=time.time(),
                              started=None, ended=None, exit_code=None, reason=None, nodes=[]))
        auth = Authority(me)
        live = _Live(run=Run(job=job, procs_per_node=spec.procs_per_node, min_nodes=spec.least_nodes,
                             max_restarts=spec.max_restarts, driver=spec.ray), spec=spec, workdir=workdir,
                     ray=secrets.token_hex(32) if spec.ray else None, store=self.store, auth=auth,
                     hub=Hub(job, worker=self.worker, me=me, host=functools.partial(self._host, auth=auth)))
        if workdir is not None:  # archives are evicted least recently used first (gc.py)
            with contextlib.suppress(OSError):
                os.utime(self.archives / f"{workdir}.tar.gz")
        self.live[job] = live
        self.worker.hubs.add((me, job))  # its checkpoint cache here lives as long as the job
        self._nursery.start_soon(self._coordinate, job, live, workdir)
        log.info("job submitted", job=job, cmd=list(spec.cmd), nodes=spec.nodes, by_uid=uid)
        return job

    def cancel(self, job: str) -> str:
        live = self.live.get(job)
        if live is None:
            row = self.store.get(job)
            if row is None:
                raise KeyError(job)
            if (followed := self.following.get(job)) is not None and row.state not in TERMINAL and \
                    self._nursery is not None and self.replication is not None:
                self._nursery.start_soon(self._cancel_remote, job, followed["coordinator"])
                return "cancelling"
            return row.state
        live.run.cancel()
        if live.setup is not None:
            live.setup.cancel()
        live.touch()
        if self._nursery is not None:
            for host in live.hosts.values():
                self._nursery.start_soon(_quietly, host.cancel, job)
        return live.run.state

    async def _cancel_remote(self, job: str, coordinator: str) -> None:
        assert self.replication is not None
        why = await self.replication.cancel(coordinator, (self.gossip.me, job))
        if why is not None:
            log.warning("the job's coordinator did not take the cancel", job=job, coordinator=short(coordinator),
                        why=why)

    def head(self, job: str) -> tuple[str, str, Host]:
        """The running job's first host (node rank 0: a Ray job's head), where `jobs forward`
        connects: (peer, its address, the host). HostError saying why when it is not running."""
        live = self.live.get(job)
        if live is None and (followed := self._heads.get(job)) is not None:  # a successor coordinates it
            peer, charter = followed
            return peer, self._address_of(peer), self._host(peer, Authority(origin=self.gossip.me, charter=charter))
        if live is None or live.run.state != "running" or not live.run.nodes:
            row = self.store.get(job)
            state = live.run.state if live is not None else row.state if row is not None else "unknown"
            raise HostError(f"job {job} is not running ({state})")
        peer = live.run.nodes[0]
        if live.run.node_state.get(peer) != "running" or peer not in live.hosts:
            raise HostError(f"job {job} is not running on its first host {short(peer)} "
                            f"({live.run.node_state.get(peer, 'not placed')})")
        return peer, self._address_of(peer), live.hosts[peer]

    def _address_of(self, peer: str) -> str:
        try:
            return self._address(peer)
        except (HostError, KeyError):  # gone from the view this instant: the forward itself will say
            return "?"

    async def watch(self, job: str, *, progress: bool, output: bool, rank: int | None = None,
                    follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        """A job's progress (``{"job": …}`` when it changes) and output (``{"out": [[rank,
        line]…]}``) until it ends with ``{"end": …}``; without follow, what there is now."""
        cursor = 0
        last: dict[str, Any] | None = None
        quiet_since = trio.current_time()
        while True:
            live = self.live.get(job)
            changed = live.changed if live is not None else None
            row = self.store.get(job)
            if row is None:
                raise KeyError(job)
            over = row.state in TERMINAL and live is None
            if progress and (snapshot := self.describe(row)) != last:
                last = snapshot
                if not over:
                    yield {"job": snapshot}
            if output:
                lines, cursor = self.store.read_log(row.id, rank=rank, offset=cursor)
                if lines:
                    quiet_since = trio.current_time()
                    yield {"out": [[r, line] for r, line in lines]}
                elif follow and trio.current_time() - quiet_since > KEEPALIVE:
                    quiet_since = trio.current_time()
                    yield {"state": row.state}  # a silent job: tell the client we are still here
            if over:
                yield {"end": self.describe(row)}
                return
            if not follow:
                return
            with trio.move_on_after(1.0):
                if changed is not None:
                    await changed.wait()
                else:
                    await trio.sleep_forever()

    def describe(self, row: JobRow) -> dict[str, Any]:
        live = self.live.get(row.id)
        ended = row.ended or (time.time() if row.started else None)
        restarts = [live.run.restart_count, live.run.max_restarts] if live else None
        attempts = self.store.attempts(row.id)
        grew = [a for a in attempts if (a["why"] or "").startswith(growth.PREFIX)]  # a growth ended them
        if restarts is None and attempts:
            restarts = [len(attempts) - 1 - len(grew), row.spec.get("max_restarts", 0)]
        return {
            "id": row.id, "name": row.name, "state": row.state, "cmd": row.spec.get("cmd"),
            "phase": live.run.phase if live else None, "restarts": restarts, "attempts": attempts,
            "growth": {"on": row.spec.get("grow", True) is True, "every_s": self.grow_every,
                       "events": [{"attempt": a["n"], "at": a.get("detected"), "why": a["why"]} for a in grew]}
            if isinstance(row.spec.get("nodes"), str) and not row.spec.get("ray") else None,  # MIN:MAX jobs only
            "checkpoints": live.hub.describe() if live else [],
            "nodes": row.nodes, "node_state": dict(live.run.node_state) if live else {},
            "coordinator": row.coordinator, "created": row.created, "started": row.started,
            "ended": row.ended, "exit_code": row.exit_code, "reason": row.reason,
            "wall_s": None if not row.started or not ended else round(ended - row.started, 3),
            "shipped": [live.shipped, live.ship_total] if live else None,
            "replicas": self._replicas_row(live),
            "groups": live.grouping if live else self.store.groups(row.id),
            "handover": self._handover_row(row.id, live),
            "ranks": [dataclasses.asdict(r) for r in self.store.ranks(row.id)],
            "hosts": self.store.hosts(row.id),
        }

    def _grouping(self, job: str, spec: JobSpec, attempt: int, peers: tuple[str, ...],
                  found: tuple[tuple[int, ...], ...] | None = None) -> dict[str, Any] | None:
        """Attempt ``attempt``'s hosts (node-rank order) in groups by latency when the job asked for them
        (compute/groups.py, capped at ``spec.groups`` ms), with the RTTs that made them. ``found``: the
        groups a job taken over runs with (its record's), shown with this node's RTTs."""
        if spec.groups is None:
            return None
        rtt = self._rtt(self.gossip.view())
        ms = {(a, b): rtt(a, b) for a in peers for b in peers if a != b}
        if found is None:
            found = latency.form(peers, lambda a, b: ms[(a, b)], spec.groups)
            log.info("latency groups", job=job, groups=[list(g) for g in found], max_rtt_ms=spec.groups)
        return {"attempt": attempt, "groups": [list(g) for g in found], "max_rtt_ms": spec.groups, "nodes": list(peers),
                "rtt_ms": [[None if a == b or not latency.known(ms[(a, b)]) else round(ms[(a, b)], 2) for b in peers]
                           for a in peers]}

    def _handover_row(self, job: str, live: _Live | None) -> dict[str, Any] | None:
        """Who coordinates the job now, at which epoch, since when: this node, or the replica
        that took it over (followed)."""
        if live is not None and live.charter is not None:
            return {"coordinator": self.gossip.me, "epoch": live.epoch, "since": live.since}
        return self.following.get(job)

    @staticmethod
    def _replicas_row(live: _Live | None) -> dict[str, Any] | None:
        if live is None or live.charter is None:
            return None
        return {"epoch": live.epoch, "seq": live.seq, "replicas": list(live.charter.replicas),
                "removed": sorted(live.recorded_removed),
                "holding": sorted(p for p, why in live.replicated.items() if why is None),
                "missing": {p: why for p, why in live.replicated.items() if why is not None}}

    # --- the coordinator ----------------------------------------------------------------

    async def _coordinate(self, job: str, live: _Live, workdir: str | None, *, resume: bool = False) -> None:
        """The job's coordination on this node until it ends: from its submission, or (`resume`)
        from the record this node took it over with; until another replica supersedes it."""
        run = live.run
        superseded: Superseded | None = None
        try:
            async with lone_error(), trio.open_nursery() as nursery:  # a HostError or Superseded as itself
                nursery.start_soon(live.hub.replicator, run, lambda: live.hosts,
                                   lambda: self._rtt(self.gossip.view()))
                if resume:
                    await self._resume(job, live)
                if not run.over:
                    await self._attempts(job, live, workdir)
                nursery.cancel_scope.cancel()
        except Superseded as exc:
            superseded = exc
        except HostError as exc:
            run.fail(str(exc))
        except Exception as exc:  # a bug must not leave a job running forever in the store
            log.exception("job coordinator failed", job=job)
            run.fail(f"coordinator error: {exc.__class__.__name__}: {exc}")
        finally:
            # cancelled from outside (nothing else cancels a coordination): the daemon stops,
            # and a job its replicas can carry on is theirs now
            if trio.current_effective_deadline() == -math.inf and superseded is None and not run.over \
                    and live.charter is not None and len(live.charter.replicas) > 1:
                superseded = Superseded("this daemon stops; the job's replicas carry it on")
            with trio.CancelScope(shield=True):
                await self._coordinated(job, live, superseded)

    async def _coordinated(self, job: str, live: _Live, superseded: Superseded | None) -> None:
        """This node's coordination of the job is over: the job ended (its hosts released, its
        end written), or a replica at a higher epoch coordinates it now (this node commands
        nothing more, and the origin follows the successor as the owner's front end)."""
        run, origin = live.run, live.auth.origin
        if superseded is None and run.over and not live.cut_off:  # an end seen alone may be a successor's job
            try:
                await self._confirm(job, live, patience=CONFIRM_PATIENCE)
            except Superseded as exc:
                superseded = exc
            except HostError as exc:  # no majority for CONFIRM_PATIENCE: the end stands
                log.warning("the job's end could not be confirmed by its replicas", job=job, why=str(exc))
        self.live.pop(job, None)
        self.worker.hubs.discard((origin, job))
        if superseded is not None:
            log.warning("this node stands down from the job's coordination", job=job, epoch=live.epoch,
                        why=str(superseded))
            live.touch()
            if origin == self.gossip.me and self._nursery is not None and not self._nursery.cancel_scope.cancel_called:
                self._nursery.start_soon(self._follow, job)
            return
        for peer, host in live.hosts.items():
            if peer not in run.lost:
                await _quietly(host.release, job)
        await self._let_go(job, live, live.hosts)
        if not run.over:
            run.fail("the coordinating daemon stopped")
        self._save(job, live)
        await trio.to_thread.run_sync(self.worker.drop_checkpoints, job, origin)
        live.touch()
        log.info("job ended", job=job, state=run.state, exit_code=run.exit_code, reason=run.reason,
                 attempts=len(run.attempts))

    async def _attempts(self, job: str, live: _Live, workdir: str | None) -> None:
        """Place, hold, ship, put checkpoints and run, once per attempt, until the job is over."""
        run = live.run
        left_out: dict[str, str] = {}  # hosts that refused this attempt's setup: placed around
        setups = 0  # of this attempt, refused
        while True:
            chosen = await self._place_and_hold(job, live, left_out)
            if chosen is None:
                return
            peers, gpus, port = chosen
            run.attempts[-1].reserved = time.time()
            if live.charter is None and self.replication is not None:  # its hosts are known: they carry it
                live.auth.charter = self._charter(job, live, peers)
            if run.cancelled:  # while the hosts were reserved: they are released below, nothing starts
                return
            run.to("shipping")
            self._save(job, live)
            installed: tuple[tuple[str, str, int], ...] = ()
            try:
                with trio.CancelScope() as live.setup:  # a cancel stops a transfer a slow host holds up
                    if workdir is not None:
                        await self._ship(job, live, workdir)
                    installed = await self._put_checkpoints(job, live, peers)
            except HostsRefused as exc:  # like a refused reservation: those hosts are left out
                for host in live.hosts.values():
                    await _quietly(host.release, job)
                live.hosts = {}
                left_out |= exc.refused
                setups += 1
                log.info("hosts refused the attempt's setup", job=job, refused=exc.refused, attempt=setups)
                if setups >= gangmod.MAX_ATTEMPTS:
                    run.fail(f"{exc}, {setups} times with other hosts")
                    return
                continue
            finally:
                live.setup = None
            left_out, setups = {}, 0
            if run.cancelled:
                run.to("cancelled")
                return
            run.to("starting")
            if run.restart_count == 0 and run.growth is None:  # the first attempt
                live.store.update(job, started=time.time())
            self._save(job, live)
            await self._start_all(job, live, peers, port, workdir, installed)
            if run.state != "restarting":
                return
            run.begin_attempt()  # every host of the ended attempt reported or was lost
            self._save(job, live)
            # no other replica took the job over meanwhile; the gone ones leave the quorum
            await self._confirm(job, live, remove=self._gone_of(live.charter) if live.charter else ())

    async def _place_and_hold(self, job: str, live: _Live, left_out: dict[str, str]
                              ) -> tuple[tuple[str, ...], dict[str, tuple[int, ...]], int] | None:
        """Place the attempt and hold its gang; a restart keeps its survivors and places neither a
        host lost in an earlier attempt nor one in `left_out` (it refused this attempt's setup)
        while others fit. None when the job ended (no fit, cancelled, refused too often)."""
        run, spec = live.run, live.spec
        give_up = trio.current_time() + spec.wait_s
        refused: dict[str, str] = {p: LOST_BEFORE for p in run.lost} | left_out
        survivors = tuple(p for p in run.kept if p not in refused) if run.state == "restarting" else ()
        joining = tuple(p for p in run.joining if p not in refused and p not in survivors)  # a growth's hosts
        survivors += joining
        attempts = 0
        lost_tried = False  # the hosts lost earlier, tried again once nothing else fits
        while True:
            if run.cancelled:
                run.to("cancelled")
                return None
            # off the event loop (1,000 members take 0.6 s, make bench; about 1.1 s when every pair
            # is a coordinate estimate), so probes do not wait;
            # the thread gets an immutable snapshot of the view, never the live membership
            view = self.gossip.view()
            candidates, rtt_ms = self._candidates(view), self._rtt(view)
            siblings = self._siblings(job, spec)

            def choose() -> Placement | NoFit:  # apart from its siblings where it can be, else beside one
                chosen = place(spec, candidates, rtt_ms, exclude=siblings | refused, require=survivors)
                if isinstance(chosen, NoFit) and siblings:
                    chosen = place(spec, candidates, rtt_ms, exclude=dict(refused), require=survivors)
                return chosen

            placement = await trio.to_thread.run_sync(choose)
            placed_since = set(self._siblings(job, spec)) - set(siblings)
            if not isinstance(placement, NoFit) and set(placement.peers) & placed_since:
                continue  # a sibling replica was placed there while this one was chosen: choose again
            if isinstance(placement, NoFit) and set(joining) & set(survivors):
                # a host a growth held is gone now: the attempt is placed without the growth's hosts
                survivors = tuple(p for p in survivors if p not in joining)
                await self._let_go(job, live, ())
                continue
            if isinstance(placement, NoFit) and left_out:
                # only hosts that refused this attempt's setup would fit (a job pinned to one host, a
                # stream that failed once): they are tried again; the setups' count still bounds it
                for peer in left_out:
                    refused.pop(peer, None)
                left_out.clear()
                continue
            if isinstance(placement, NoFit) and not lost_tried and LOST_BEFORE in refused.values():
                # only a host lost in an earlier attempt would fit (a replica pinned to its host, whose
                # stream broke once): placed again where it is alive now, after a pause that doubles
                # with each restart (a host that breaks every start is not hammered)
                lost_tried = True
                resume = trio.current_time() + run.lost_retry_pause
                while trio.current_time() < resume and not run.cancelled:
                    await trio.sleep(min(WAIT_POLL, resume - trio.current_time()))
                for peer in run.lost:
                    if refused.get(peer) == LOST_BEFORE:
                        del refused[peer]
                continue
            if isinstance(placement, NoFit):
                if trio.current_time() < give_up:
                    await trio.sleep(WAIT_POLL)
                    continue
                run.fail(placement.reason)
                return None
            run.to("reserving")
            run.placed(placement.peers, now=time.time())
            self._save(job, live)
            hosts = {p: self._host(p, live.auth) for p in placement.peers}
            live.hosts = hosts
            outcome = await self._reserve(job, spec, hosts)
            if isinstance(outcome, gangmod.Commit):
                await self._let_go(job, live, placement.peers)  # a growth's hosts not placed
                try:
                    return await self._commit(job, hosts, placement.peers, outcome)
                except HostError as exc:  # a lease lapsed between reserve and commit
                    run.fail(f"commit failed: {exc}")
                    return None
            for peer in outcome.peers:
                await _quietly(hosts[peer].release, job)
            live.hosts = {}
            refused |= outcome.refused
            survivors = tuple(p for p in survivors if p not in outcome.refused)
            attempts += 1
            log.info("reservation refused", job=job, refused=outcome.refused, attempt=attempts)
            if attempts >= gangmod.MAX_ATTEMPTS:
                why = "; ".join(outcome.refused.values())
                run.fail(f"could not reserve {describe(spec)} after {attempts} attempts: {why}")
                return None

    async def _let_go(self, job: str, live: _Live, placed: Collection[str]) -> None:
        """The hosts a growth held that the attempt placed on `placed` does not have: released."""
        for peer, host in list(live.joining.items()):
            if peer not in placed:
                await _quietly(host.release, job)
        live.joining = {}

    def _siblings(self, job: str, spec: JobSpec) -> dict[str, str]:
        """The hosts a service replica is placed on only when no other fits: those of the other
        replicas of its service that this node coordinates (a host's death should take one
        replica, not two; a swarm of one host still rolls a new version out beside the old)."""
        if spec.serve is None:
            return {}
        name = spec.serve.service
        return {peer: f"runs another replica of {name}" for other, live in self.live.items()
                if other != job and live.spec.serve is not None and live.spec.serve.service == name
                and live.run.state not in TERMINAL for peer in live.run.nodes}

    async def _reserve(self, job: str, spec: JobSpec, hosts: dict[str, Host]) -> gangmod.Commit | gangmod.Release:
        g = gangmod.Gang(peers=tuple(hosts), deadline=trio.current_time() + gangmod.RESERVE_TIMEOUT)

        async def one(peer: str) -> None:
            try:
                g.grant(peer, await hosts[peer].reserve(job, spec.gpus_per_node, spec.procs_per_node, gangmod.LEASE))
            except HostError as exc:
                g.refuse(peer, str(exc))

        with trio.move_on_after(gangmod.RESERVE_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for peer in hosts:
                    nursery.start_soon(one, peer)
        decision = g.decide(trio.current_time() + gangmod.RESERVE_TIMEOUT)
        assert decision is not None
        return decision

    async def _commit(self, job: str, hosts: dict[str, Host], order: tuple[str, ...],
                      held: gangmod.Commit) -> tuple[tuple[str, ...], dict[str, tuple[int, ...]], int]:
        port = 0
        gpus: dict[str, tuple[int, ...]] = {}
        for i, peer in enumerate(order):
            gpus[peer], got = await hosts[peer].commit(job, port=(i == 0))
            if i == 0:
                assert got is not None
                port = got
        return order, gpus, port

    async def _ship(self, job: str, live: _Live, digest: str, to: dict[str, Host] | None = None) -> None:
        """The workdir on every host of the attempt (its progress shown), or on `to` (a growth's
        hosts, staged while the attempt runs: its progress not the attempt's)."""
        archive = self.archives / f"{digest}.tar.gz"
        if not archive.exists():  # a successor: packed again from its own copy of the tree
            await trio.to_thread.run_sync(self._repack, digest, archive)
        hosts = live.hosts if to is None else to
        if to is None:
            live.ship_total = archive.stat().st_size * len(hosts)
        done: dict[str, int] = {}

        def progress(peer: str, n: int) -> None:
            if to is not None:
                return
            done[peer] = n
            live.shipped = sum(done.values())
            live.touch()

        refused: dict[str, str] = {}

        async def one(peer: str, host: Host) -> None:
            try:
                await host.ship(job, digest, archive, lambda n: progress(peer, n))
            except HostError as exc:
                refused[peer] = str(exc)

        async with trio.open_nursery() as nursery:
            for peer, host in hosts.items():
                nursery.start_soon(one, peer, host)
        if refused:
            raise HostsRefused("shipping the workdir", refused)
        if to is None:
            live.shipped = live.ship_total
            live.touch()

    async def _start_all(self, job: str, live: _Live, peers: tuple[str, ...], port: int, workdir: str | None,
                         checkpoints: tuple[tuple[str, str, int], ...] = (), *, attach: bool = False) -> None:
        """Run the attempt on `peers` until every host reported its ranks' exit or was lost;
        `attach`: the attempt runs already (this node took the job over), its hosts' events
        are taken over where they run and the others are lost."""
        run, spec = live.run, live.spec
        addrs = [self._address(p) if not attach else self._address_or(p) for p in peers]
        live.addresses = dict(zip(peers, addrs))
        if not attach:  # a job taken over runs with the groups its ranks were started with
            live.grouping = self._grouping(job, spec, run.attempts[-1].n, peers)
            if live.grouping is not None:  # kept with the attempt: shown after the job ended
                live.store.set_attempt(job, run.attempts[-1].to_dict())
                live.store.set_groups(job, run.attempts[-1].n, live.grouping)
        grouped = tuple(tuple(g) for g in live.grouping["groups"]) if live.grouping else ()
        for peer in peers:
            state = run.node_state.get(peer, "starting") if attach else "starting"
            for i in range(spec.procs_per_node):
                live.store.set_rank(RankRow(job_id=job, rank=peers.index(peer) * spec.procs_per_node + i,
                                            node=peer, state=state if state != "exited" else "exited",
                                            exit_code=None))
        scopes: dict[str, trio.CancelScope] = {}
        live.checkpointed = trio.Event()  # only this attempt's checkpoints make it grow

        def stop_others(peer: str) -> None:
            for other, host in live.hosts.items():
                if other != peer and run.node_state.get(other) in ("starting", "running"):
                    nursery.start_soon(_quietly, host.cancel, job)

        async def node(i: int, peer: str) -> None:
            role = NodeRole(job_id=job, node_rank=i, nnodes=len(peers), procs_per_node=spec.procs_per_node,
                            master_addr=addrs[0], master_port=port, ifname=None, gpus=(),
                            node_ips=tuple(addrs), checkpoint_dir="", restart_count=run.restart_count,
                            max_restarts=run.max_restarts, groups=grouped)
            req = StartRequest(job=job, coordinator=live.auth.origin, role=role, cmd=spec.cmd, env=spec.env,
                               python=spec.python, workdir=workdir, cpus=spec.cpus, mem_mb=spec.mem_mb,
                               checkpoints=checkpoints, ray=live.ray, serve=spec.serve)

            ranks = range(i * spec.procs_per_node, (i + 1) * spec.procs_per_node)

            async def emit(event: dict[str, Any]) -> None:
                try:
                    checked = checked_event(event, ranks, started=run.node_state.get(peer) != "starting")
                except ValueError as exc:
                    self.reject("job_event", peer, f"job {job}: {exc}")
                    raise HostError(f"{short(peer)} broke the job protocol: {exc}") from None
                self._event(job, live, peer, checked)

            try:
                with scopes.setdefault(peer, trio.CancelScope()):
                    if attach:
                        await live.hosts[peer].attach(job, emit)
                    else:
                        await live.hosts[peer].start(req, emit)
                if run.node_state.get(peer) not in ("exited", "lost"):
                    run.node_lost(peer, "its ranks ended without an exit report", now=time.time())
            except HostError as exc:
                run.node_lost(peer, str(exc).removeprefix(f"{short(peer)}: "), now=time.time())
            finally:
                self._save(job, live)
                if run.stop_others:
                    stop_others(peer)

        async def watch() -> None:
            """Membership's word on the attempt's hosts: one declared dead (or gone from the
            view) is lost now, whatever its stream still says."""
            while True:
                view = self.gossip.view()
                for peer in peers:
                    if peer == view.me or run.node_state.get(peer) not in ("starting", "running"):
                        continue
                    member = view.get(peer)
                    state = "gone from the membership view" if member is None else member.state.value
                    if state in ("dead", "left", "gone from the membership view"):
                        run.node_lost(peer, f"membership: {state}", now=time.time())
                        scopes.setdefault(peer, trio.CancelScope()).cancel()
                        self._save(job, live)
                        if run.stop_others:  # a Ray job goes on without a worker node
                            stop_others(peer)
                await trio.sleep(WATCH_EVERY)

        async def grower() -> None:
            """After each new checkpoint of the attempt: grow, when growth.py says so and the
            hosts that join are held; then every node is stopped for the next attempt."""
            while True:
                await live.checkpointed.wait()
                live.checkpointed = trio.Event()
                if await self._grow(job, live, peers):
                    stop_others("")
                    return

        async with trio.open_nursery() as outer:
            outer.start_soon(watch)
            outer.start_soon(grower)
            async with trio.open_nursery() as nursery:
                for i, peer in enumerate(peers):
                    if not attach or run.node_state.get(peer) in ("starting", "running"):
                        nursery.start_soon(node, i, peer)
                if attach and run.stop_others:  # the predecessor was stopping them
                    stop_others("")
            outer.cancel_scope.cancel()

    async def _grow(self, job: str, live: _Live, peers: tuple[str, ...]) -> bool:
        """Right after a new checkpoint of the attempt on `peers`: True when the job grows (the
        hosts that join are held, in `live.joining`, and the run is stopping for the next
        attempt); False when growth.py says not now, no more hosts fit, or they were not all held."""
        run, spec = live.run, live.spec
        if not live.hub.checkpoints:
            return False
        not_now = growth.ready(grow=spec.grow, driver=run.driver, most=spec.nodes, size=len(peers),
                               running=run.state == "running" and not run.stopping, last=run.grown_at,
                               now=time.time(), every=self.grow_every)
        if not_now is not None:
            log.debug("no growth", job=job, why=not_now)
            return False
        view = self.gossip.view()
        candidates, rtt_ms = self._candidates(view), self._rtt(view)
        lost = {p: LOST_BEFORE for p in run.lost}
        placement = await trio.to_thread.run_sync(
            lambda: place(spec, candidates, rtt_ms, exclude=lost, require=peers))
        joining = growth.joining(spec.nodes, peers, placement.peers) if isinstance(placement, Placement) else ()
        if not joining:
            return False
        hosts = {p: self._host(p, live.auth) for p in joining}
        try:
            outcome = await self._reserve(job, spec, hosts)
            staged = None if isinstance(outcome, gangmod.Release) else await self._stage(job, live, hosts)
        except trio.Cancelled:  # the attempt ended meanwhile: what was granted goes back now
            with trio.CancelScope(shield=True):
                for host in hosts.values():
                    await _quietly(host.release, job)
            raise
        if isinstance(outcome, gangmod.Release) or staged is not None or run.state != "running" or run.stopping:
            for peer in (outcome.peers if isinstance(outcome, gangmod.Release) else joining):
                await _quietly(hosts[peer].release, job)
            why = "; ".join(outcome.refused.values()) if isinstance(outcome, gangmod.Release) else staged or run.state
            log.info("no growth: the hosts that would join were not all held and set up", job=job, why=why)
            return False
        # the newest checkpoint (the hub never empties its list): the one the next attempt resumes from
        reason = growth.why(peers, joining, live.hub.checkpoints[-1].name)
        live.joining = hosts
        run.grow(joining, reason, now=time.time())
        log.info("job grows", job=job, why=reason)
        self._save(job, live)
        return True

    async def _stage(self, job: str, live: _Live, hosts: dict[str, Host]) -> str | None:
        """A growth's held hosts, while the attempt runs: committed (a host takes a checkpoint
        only for a committed hold), given the workdir and the job's checkpoints, so that the
        next attempt's setup finds them there. None when done, else why not."""
        try:
            for host in hosts.values():
                await host.commit(job, port=False)
            if live.workdir is not None:
                await self._ship(job, live, live.workdir, hosts)
            await live.hub.put_all(live.run, hosts, tuple(hosts))
        except HostError as exc:  # HostsRefused included
            return str(exc)
        return None

    def _event(self, job: str, live: _Live, peer: str, event: dict[str, Any]) -> None:
        run = live.run
        if "sandbox" in event:
            live.store.set_host(job, peer, sandbox=event["sandbox"])
        if "usage" in event:
            live.store.set_host(job, peer, **event["usage"])
        if "ray" in event:
            live.store.set_host(job, peer, ray={"address": live.addresses.get(peer), **event["ray"]})
        if "started" in event:
            run.node_started(peer, now=time.time())
            for rank in event["started"]:
                live.store.set_rank(RankRow(job_id=job, rank=rank, node=peer, state="running", exit_code=None))
            if run.stop_others and self._nursery is not None:  # the stop crossed the start on the wire
                self._nursery.start_soon(_quietly, live.hosts[peer].cancel, job)
        if "out" in event:
            live.store.append_logs(job, [(rank, line.encode("utf-8", "replace")) for rank, line in event["out"]])
        if "dropped" in event:  # the host kept them in its own log; this one says what is missing
            live.store.append_logs(job, [(rank, f"[swarmd] {n} line(s) of this rank were not streamed here (this "
                                                f"daemon fell behind); {short(peer)} keeps them in its copy of the "
                                                "job's log".encode()) for rank, n in event["dropped"]])
        if "ckpt" in event and live.hub.announced(run, peer, *event["ckpt"]):
            live.checkpointed.set()  # the moment a growth is looked at (`grower` in _start_all)
        if "exit" in event:
            codes = event["exit"]
            for rank, code in codes.items():
                live.store.set_rank(RankRow(job_id=job, rank=rank, node=peer, state="exited", exit_code=code))
            oom = event.get("oom") or {}
            run.node_exited(peer, codes, first=event["first"], oom=tuple(oom.get("ranks", ())),
                            memory_limit=oom.get("limit"), now=time.time())
        if "started" in event or "exit" in event:
            self._save(job, live)
        elif "ckpt" in event:  # the index a successor resumes from: on the replicas too
            self._replicate(job, live)
            live.touch()
        else:  # output or a heartbeat: the job's row is unchanged, its followers read the log
            live.touch()

    async def _put_checkpoints(self, job: str, live: _Live, peers: tuple[str, ...]) -> Listed:
        """Before an attempt starts: the job's newest checkpoints on every host of it (hub.py); the
        attempt records the newest as `resumed_from`, and a restart's marker line says so."""
        run = live.run
        installed = await live.hub.put_all(run, live.hosts, peers)
        attempt = run.attempts[-1]
        attempt.checkpoints_ready = time.time()
        attempt.resumed_from = installed[-1][0] if installed else None
        if run.restart_count or run.growth:
            self._marker(job, live, peers, attempt.resumed_from)
        return installed

    def _marker(self, job: str, live: _Live, peers: tuple[str, ...], resumed_from: str | None) -> None:
        """The line in the job's output where a restart, or a growth, begins (store.py's `_OPENS`
        knows both)."""
        run = live.run
        why = run.growth or f"restart {run.restart_count}/{run.max_restarts} after {run.reason}"
        line = (f"[swarmd] {why}: attempt {len(run.attempts)} on {len(peers)} host(s) "
                f"({', '.join(short(p) for p in peers)}), "
                + (f"resuming from checkpoint {resumed_from}" if resumed_from else "from the start (no checkpoint)"))
        live.store.append_logs(job, [(0, line.encode())])

    def _save(self, job: str, live: _Live) -> None:
        run = live.run
        fields: dict[str, Any] = {"state": run.state, "reason": run.reason}
        if run.nodes:
            fields["nodes"] = list(run.nodes)
        if run.over:
            fields |= {"ended": time.time(), "exit_code": run.exit_code}
        live.store.update(job, **fields)
        if run.attempts:
            live.store.set_attempt(job, run.attempts[-1].to_dict())
        self._replicate(job, live)
        self._prune(job, live)
        live.touch()

    def _prune(self, job: str, live: _Live) -> None:
        """A replica membership declares gone leaves the job's quorum now, while a majority is
        there: at each change of the job (`_save`), and every SUCCESSION_EVERY while nothing
        changes (a restart waiting for capacity, a long transfer), so that a coordinator lost
        next still leaves a majority to a successor."""
        if live.charter is not None and not live.reconfiguring and not live.run.over and \
                self._gone_of(live.charter) - live.removed - {self.gossip.me} and self._nursery is not None:
            live.reconfiguring = True
            self._nursery.start_soon(self._reconfigure, job, live)

    async def _reconfigure(self, job: str, live: _Live) -> None:
        try:
            assert live.charter is not None
            await self._confirm(job, live, once=True, remove=self._gone_of(live.charter))
        except (Superseded, HostError) as exc:  # the next confirm of the job meets it again
            log.info("the job's quorum could not change", job=job, why=str(exc))
        except Exception:
            log.exception("changing the job's quorum failed", job=job)
        finally:
            live.reconfiguring = False

    # --- the job's replicas (succession.py, replication.py) -----------------------------

    def _charter(self, job: str, live: _Live, peers: tuple[str, ...]) -> Charter | None:
        """The job's charter: its replicas are this node and the hosts, and, when that is this node
        and one other, witnesses up to ``MIN_REPLICAS``: the nearest other alive members running the
        job service (a gossiping member without job slots keeps no record; a suspect may be gone). A
        majority of two is both, so a one-host job on another node (a service's replica) could
        not survive its host; with a witness, origin and witness carry on without it. (A job on
        this node alone needs none: this node's death is its ranks' too.)"""
        row = live.store.get(job)
        me, hosts = self.gossip.me, list(peers)
        if set(hosts) - {me} and len({me, *hosts}) < MIN_REPLICAS:
            view = self.gossip.view()
            rtt = self._rtt(view)

            def distance(peer: str) -> tuple[float, str]:
                ms = rtt(me, peer)
                return (ms if ms is not None and ms >= 0 else math.inf), peer

            # alive (not merely suspect) and running the job service: a member that only gossips
            # (a record without job slots) keeps no replica's record
            others = sorted((m.peer for m in view.in_service() if m.peer not in (me, *hosts)
                             and m.state is State.ALIVE and m.record.jobs is not None), key=distance)
            hosts += others[:MIN_REPLICAS - len({me, *hosts})]
        try:
            return Charter.make(origin=me, job=job, owner_uid=row.submitted_by if row else 0,
                                spec=spec_digest(live.spec.to_wire()), hosts=hosts, sign=self.gossip.sign)
        except Invalid as exc:  # a bug: the charter is built from checked values only
            log.warning("the job's charter could not be made: it is not replicated", job=job, error=str(exc))
            return None

    def _replicate(self, job: str, live: _Live) -> None:
        """The transition just saved goes to the job's replicas (after the ones before it: one
        write at a time per job, each of the newest state)."""
        if self.replication is None or live.charter is None or self._nursery is None:
            return
        live.seq += 1
        live.dirty = True
        self._kick(job, live)

    def _kick(self, job: str, live: _Live) -> None:
        if not live.writing and self._nursery is not None:
            live.writing = True
            self._nursery.start_soon(self._write_records, job, live)

    async def _write_records(self, job: str, live: _Live) -> None:
        assert self.replication is not None and live.charter is not None
        try:
            while live.dirty:
                live.dirty = False
                record = self.replication.record(live.charter, live.epoch, live.seq, self._replica_state(job, live))
                live.replicated = await self.replication.write(record, self._gone_of(live.charter))
                live.touch()
        except Invalid as exc:  # too large a record (a job of hundreds of hosts): not handed over
            log.warning("the job's record is not replicated", job=job, error=str(exc))
            live.auth.charter = None
        except Exception as exc:  # this node's own disk (full, read-only): the job goes on, unreplicated
            log.warning("the job's record could not be written", job=job, error=f"{type(exc).__name__}: {exc}")
            live.replicated = {self.gossip.me: f"{type(exc).__name__}: {exc}"[:200]}
        finally:
            live.writing = False

    def _replica_state(self, job: str, live: _Live) -> dict[str, Any]:
        """What a successor needs to go on: the run, the spec, the workdir, the Ray token."""
        row = live.store.get(job)
        return {"run": live.run.to_wire(), "spec": live.spec.to_wire(), "workdir": live.workdir, "ray": live.ray,
                "name": row.name if row else None, "created": row.created if row else None,
                "started": row.started if row else None, "checkpoints": live.hub.describe(), "since": live.since,
                "removed": sorted(live.removed), "removing": sorted(live.removing) if live.removing is not None else None,
                # the groups the attempt's ranks run with (not their nodes again, nor the RTT matrix: 128 nodes'
                # would not fit a record)
                "groups": {"attempt": live.grouping["attempt"], "groups": live.grouping["groups"]}
                if live.grouping else None}

    # --- hand-over (succession.py): a job taken over, or followed from its origin -------

    def _gone(self, peer: str) -> bool:
        """Whether membership declares `peer` dead or left (this node never is)."""
        return peer != self.gossip.me and self.worker.coordinator_gone(peer) is not None

    async def _newest(self, key: tuple[str, str]) -> JobRecord | None:
        """The newest record of the job among this node's and its live replicas' (kept here
        too), or None when this node holds none."""
        assert self.replication is not None
        writer = self.replication
        held = writer.store.get(key)
        if held is None:
            return None
        record = await writer.gather(key, held.charter.replicas, self._gone_of(held.charter)) or held
        if record.version > held.version:
            await trio.to_thread.run_sync(writer.store.put, record)
        return record

    def _gone_of(self, charter: Charter) -> set[str]:
        """The job's replicas membership declares gone: not asked (they would only time out)."""
        return {p for p in charter.replicas if self._gone(p)}

    async def _succession(self) -> None:
        """Every SUCCESSION_EVERY: the gone replicas of the jobs this node coordinates leave
        their quorums (`_prune`); each live job this node is a replica of whose coordinator
        is gone (or was this node, in a past life) is taken over when this node is next in
        line (`takeover`); one takeover per job at a time."""
        assert self.replication is not None and self._nursery is not None
        store, me = self.replication.store, self.gossip.me
        taking: set[tuple[str, str]] = set()
        over: dict[tuple[str, str], tuple[int, int]] = {}  # the version of a record read as ended
        while True:
            await trio.sleep(SUCCESSION_EVERY)
            now = trio.current_time()
            for job, live in list(self.live.items()):
                self._prune(job, live)
            for key in store.held.keys():
                record = store.get(key)
                if record is None or key in taking or key[1] in self.live or now < self._retry.get(key, 0.0):
                    continue
                if takeover(me, record.charter, record.epoch, self._gone, acting=False) is None:
                    continue
                if over.get(key) == record.version or ended(record):  # read once per version
                    over[key] = record.version
                    continue
                taking.add(key)
                self._retry[key] = now + TAKEOVER_RETRY
                self._nursery.start_soon(self._take_over, key, taking)
            for key in [k for k in over if store.get(k) is None]:
                del over[key]

    async def _take_over(self, key: tuple[str, str], taking: set[tuple[str, str]]) -> None:
        try:
            await self._take_over_now(key)
        except Exception:  # a bug, or this node's disk: the next look tries again
            log.exception("taking a job over failed", job=key[1], origin=short(key[0]))
        finally:
            taking.discard(key)

    async def _take_over_now(self, key: tuple[str, str]) -> None:
        """Gather the newest record among the replicas; if this node is still the one to take
        the job over from it, write its new epoch to a majority of them (write-ahead: a
        coordinator at an older epoch is refused from then on) and go on with the job."""
        assert self.replication is not None and self._nursery is not None
        me, job = self.gossip.me, key[1]
        record = await self._newest(key)
        if record is None:
            return
        if self._tried.get(key) == record.epoch and record.charter.coordinator(record.epoch) == me:
            epoch: int | None = record.epoch  # this life's own try, short of a majority: again, same epoch
        else:
            epoch = takeover(me, record.charter, record.epoch, self._gone, acting=job in self.live)
        if epoch is None or ended(record) or job in self.live:
            return
        self._tried[key] = epoch
        try:
            live = self._rebuild(record, epoch)
        except (ValueError, SpecError, Invalid) as exc:
            log.warning("a job's record cannot be taken over", job=job, origin=short(key[0]), error=str(exc)[:300])
            return
        try:
            if not await self._confirm(job, live, once=True, remove=self._gone_of(record.charter)):
                log.info("a takeover found no majority of the job's replicas: tried again", job=job, epoch=epoch)
                return
        except Superseded:
            return
        if job in self.live:  # a submission of that id meanwhile (a member's forged one): not ours to mix
            return
        self.live[job] = live
        self.worker.hubs.add(key)
        log.warning("took a job over: its coordinator is gone", job=job, origin=short(key[0]), epoch=epoch,
                    predecessor=short(record.charter.coordinator(record.epoch)), state=live.run.state)
        self._nursery.start_soon(functools.partial(self._coordinate, job, live, live.workdir, resume=True))

    def _rebuild(self, record: JobRecord, epoch: int) -> _Live:
        """The job as its newest record has it (a member's bytes: every field checked), for
        this node to coordinate at `epoch`. ValueError (SpecError, Invalid) naming what is wrong."""
        charter = record.charter
        origin, job = charter.key
        state = msgpack.unpackb(record.body, raw=False)
        if not isinstance(state, dict):
            raise ValueError("a job's record must be a map")
        run = Run.from_wire(state.get("run"))
        if run.job != job:
            raise ValueError("record.run is another job's")
        spec = JobSpec.from_wire(state.get("spec"))
        if spec_digest(spec.to_wire()) != charter.spec:
            raise ValueError("record.spec is not the spec its origin signed")
        workdir, ray, name = state.get("workdir"), state.get("ray"), state.get("name")
        if workdir is not None and not is_digest(workdir):
            raise ValueError("record.workdir must be a workdir digest")
        if ray is not None and not (isinstance(ray, str) and TOKEN.fullmatch(ray)):
            raise ValueError("record.ray must be a Ray token")
        if name is not None and not (isinstance(name, str) and len(name) <= MAX_TEXT):
            raise ValueError("record.name must be a short string")
        times = {k: state.get(k) for k in ("created", "started", "since")}
        if not all(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < 2**40)
                   for t in times.values()):
            raise ValueError("record times must be seconds since the epoch")
        found = self._carried_groups(state.get("groups"), spec, run)
        auth = Authority(origin, epoch, charter)
        store = self.store if origin == self.gossip.me else self.handed
        row = store.get(job)
        if row is None:
            store.add(JobRow(id=job, name=name, spec={**spec.to_wire(), "workdir_digest": workdir}, state=run.state,
                             coordinator=origin, submitted_by=charter.owner_uid, created=times["created"] or time.time(),
                             started=times["started"], ended=None, exit_code=None, reason=run.reason,
                             nodes=list(run.nodes)))
        elif row.coordinator != origin or row.state in TERMINAL:
            raise ValueError(f"job {job} is here already, {'of another origin' if row.coordinator != origin else 'ended'}")
        for attempt in run.attempts:
            store.set_attempt(job, attempt.to_dict())
        grouping = self._grouping(job, spec, run.attempts[-1].n, run.nodes, found) if found is not None else None
        if grouping is not None and run.attempts:
            store.set_groups(job, run.attempts[-1].n, grouping)
        hub = Hub(job, worker=self.worker, me=self.gossip.me, host=functools.partial(self._host, auth=auth),
                  origin=origin)
        hub.restore(state.get("checkpoints", []), self.worker.checkpoint_max)
        removing, removed = state.get("removing"), check_removed(state.get("removed", []), charter)
        return _Live(run=run, spec=spec, hub=hub, store=store, auth=auth, workdir=workdir, ray=ray,
                     removed=removed, recorded_removed=removed,
                     removing=check_removed(removing, charter) if removing is not None else None,
                     seq=record.seq if epoch == record.epoch else 0, grouping=grouping)

    @staticmethod
    def _carried_groups(value: Any, spec: JobSpec, run: Run) -> tuple[tuple[int, ...], ...] | None:
        """The groups a record says the running attempt's ranks have (ValueError if malformed); None
        when it has none, or they were an earlier attempt's (the next start forms its own)."""
        if value is None:
            return None
        if spec.groups is None or not (isinstance(value, dict) and set(value) == {"attempt", "groups"}):
            raise ValueError("record.groups must be {attempt, groups}, of a job that asked for groups")
        if not run.nodes or not run.attempts or value["attempt"] != run.attempts[-1].n:
            return None
        return latency.check(value["groups"], len(run.nodes))

    async def _resume(self, job: str, live: _Live) -> None:
        """Go on where the predecessor was: the running attempt's hosts attached (their ranks
        are not restarted: each host's events, held for a successor, come here); an attempt
        being set up is released and set up again; an ended one's restart goes on."""
        run = live.run
        setting_up = ("placing", "reserving", "shipping")
        if "running" not in run.node_state.values():  # nothing runs yet: a start may not have reached all
            setting_up += ("starting",)
        if run.state in setting_up or (run.state == "restarting" and run.phase in setting_up):
            await self._drain(job, live, run.nodes)
            for peer in run.nodes:
                await _quietly(self._host(peer, live.auth).release, job)
            run.redo_setup()
            self._save(job, live)
            return
        if any(s in ("starting", "running") for s in run.node_state.values()):
            # this node's copy of the output starts with the attempt taken over: each host replays
            # its log of it on attach (the origin puts this in place of its own, partial, copy)
            predecessor = live.charter.coordinator(live.epoch - 1) if live.charter else "?"
            live.store.append_logs(job, [(0, takeover_marker(self.gossip.me, live.epoch, predecessor,
                                                             len(run.attempts)).encode())])
            live.hosts = {p: self._host(p, live.auth) for p in run.nodes}
            await self._start_all(job, live, run.nodes, 0, live.workdir, attach=True)
        if run.state == "restarting" and run.verdict == "restart" and run.settled:
            run.begin_attempt()
            self._save(job, live)

    async def _drain(self, job: str, live: _Live, peers: tuple[str, ...]) -> None:
        """Ranks the predecessor may have started on `peers` before its record said so: stopped,
        and their end waited for (an attach lasts until the ranks are done and their hold is
        given back; at most DRAIN_TIMEOUT), so the attempt set up again finds the hosts free."""
        async def ignore(event: dict[str, Any]) -> None:
            pass

        async def one(peer: str) -> None:
            host = self._host(peer, live.auth)
            await _quietly(host.cancel, job)
            with trio.move_on_after(DRAIN_TIMEOUT):
                try:
                    await host.attach(job, ignore)
                except HostError:  # nothing runs there (the usual case), or the host is gone
                    pass

        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(one, peer)

    async def _confirm(self, job: str, live: _Live, *, once: bool = False, patience: float = CONFIRM_PATIENCE,
                       remove: Collection[str] = ()) -> bool:
        """Write-ahead: the job's record at this node's epoch on a majority of its replicas,
        before this node commands its hosts anew (a takeover, a restart) or takes an end it saw
        alone for the job's. Superseded when a replica holds a newer epoch; retried every
        CONFIRM_RETRY while no majority answers (a partition: this side stands still), for
        `patience` seconds, then a HostError; False at once with `once`. `remove`: replicas
        to take out of the quorum's configuration with this write (membership's gone ones),
        which then needs a majority of the old configuration and of the new."""
        if self.replication is None or live.charter is None:
            return True
        replicas = live.charter.replicas
        give_up = trio.current_time() + patience
        while True:
            while live.writing:  # one write at a time per job: versions reach replicas in order
                await trio.sleep(0.05)
            target = frozenset((live.removed | set(remove)) & set(replicas)) - {self.gossip.me}
            configs = [live.removed, *([live.removing] if live.removing is not None else []), target]
            if target != live.removed:
                live.removing = target
            live.writing = True
            try:
                live.seq += 1
                live.dirty = False
                record = self.replication.record(live.charter, live.epoch, live.seq, self._replica_state(job, live))
                answers = await self.replication.write(record, self._gone_of(live.charter))
            except Invalid:  # too large to replicate: it never was (_write_records says so)
                return True
            finally:
                live.writing = False
            live.replicated = answers
            live.touch()
            if live.dirty:
                self._kick(job, live)
            if "stale" in answers.values():
                raise Superseded(f"a replica holds job {job} at a newer epoch than {live.epoch}")
            if quorum(replicas, configs, (p for p, why in answers.items() if why is None)):
                if target != live.removed or live.removing is not None:
                    # committed: written as such (again, to a majority of it) before any other
                    # step, so a successor reads the new configuration, not a pending one
                    live.removed, live.removing = target, None
                    log.info("the job's quorum of replicas changed", job=job, removed=[short(p) for p in target])
                    continue
                live.recorded_removed = live.removed
                return True
            if once:
                return False
            if trio.current_time() >= give_up:
                live.cut_off = True
                raise HostError(f"no majority of the job's {len(live.charter.replicas)} replicas answered for "
                                f"{patience:g} s (a partition, or its hosts are gone)")
            log.info("no majority of the job's replicas took its record: waiting", job=job, answers=answers)
            await trio.sleep(CONFIRM_RETRY)

    async def _follow(self, job: str) -> None:
        """The origin's side of a job another replica coordinates: the owner's row, attempts and
        output kept up from the newest record and from the coordinator's copy of the output,
        until the job ends and all of it is here (`jobs show` and `jobs logs -f` read them
        as ever), or this node coordinates it again."""
        try:
            await self._keep_up(job)
        finally:
            self._heads.pop(job, None)

    async def _keep_up(self, job: str) -> None:
        me = self.gossip.me
        away_since: float | None = None  # since when every other replica has been gone
        while job not in self.live:
            record = await self._newest((me, job))
            if record is None or job in self.live:  # or this node took it over meanwhile
                return
            if (away := self._carried_by_none(record.charter)) is None:
                away_since = None
            elif away_since is None:
                away_since = trio.current_time()
            elif trio.current_time() - away_since >= LOST_AFTER:
                await self._lose(job, record, away)
                return
            coordinator = record.charter.coordinator(record.epoch)
            try:
                state = msgpack.unpackb(record.body, raw=False)
                run = Run.from_wire(state["run"])
            except Exception as exc:  # signed by a replica of the job, yet not a record this daemon reads
                log.warning("a job's record cannot be followed", job=job, error=str(exc)[:200])
                return
            since = state.get("since")  # a replica's word: a time, or nothing shown
            if isinstance(since, bool) or not isinstance(since, (int, float)) or not 0 <= since < 2**40:
                since = None
            self.following[job] = {"coordinator": coordinator, "epoch": record.epoch, "since": since}
            head = run.nodes[0] if run.state == "running" and run.nodes else None
            if head is not None and run.node_state.get(head) == "running":
                self._heads[job] = (head, record.charter)  # where `jobs forward` goes (the host lets its origin)
            else:
                self._heads.pop(job, None)
            drained = coordinator == me or await self._pull_log(job, coordinator)
            if job in self.live:
                return
            if drained or not run.over:  # the end once every line is here
                self._mirror(job, run)
            if run.over and drained:
                return
            await trio.sleep(FOLLOW_EVERY)

    def _carried_by_none(self, charter: Charter) -> list[str] | None:
        """The job's other replicas when every one is gone (dead or left, or unknown to a view
        that holds a live member: this node is in a swarm, not cut off alone), else None."""
        view, me = self.gossip.view(), self.gossip.me
        others = [p for p in charter.replicas if p != me]
        if not others or not all(view.get(p) is None or self._gone(p) for p in others):
            return None
        return others if any(m.state.value == "alive" for m in view) else None

    async def _lose(self, job: str, record: JobRecord, replicas: list[str]) -> None:
        """Every replica that could carry the job on is gone for ``LOST_AFTER``: the owner's row
        fails saying so, and the record goes (no takeover, nothing followed after a restart)."""
        assert self.replication is not None
        names = ", ".join(short(p) for p in replicas)
        reason = f"lost: every replica that carried the job on is gone ({names}) and nobody coordinates it"
        log.warning("a job of this node's is lost: its replicas are gone", job=job, replicas=names)
        self.following.pop(job, None)
        row = self.store.get(job)
        if row is not None and row.state not in TERMINAL:
            self.store.update(job, state="failed", reason=reason, ended=time.time())
        await trio.to_thread.run_sync(self.replication.store.drop, record.charter.key)

    def _mirror(self, job: str, run: Run) -> None:
        """The owner's row as the coordinator's record has it."""
        fields: dict[str, Any] = {"state": run.state, "reason": run.reason}
        if run.nodes:
            fields["nodes"] = list(run.nodes)
        if run.over:
            fields |= {"ended": time.time(), "exit_code": run.exit_code}
        row = self.store.get(job)
        if row is None or row.state in TERMINAL:
            return
        if row.started is None and run.attempts and run.attempts[0].started:
            fields["started"] = run.attempts[0].started
        self.store.update(job, **fields)
        for attempt in run.attempts:
            self.store.set_attempt(job, attempt.to_dict())

    async def _pull_log(self, job: str, coordinator: str) -> bool:
        """The output the coordinator received since it took the job over, from where this node
        left off (kept in the job's directory): True once nothing more is there."""
        assert self.replication is not None
        mark = self.store.dir / job / f"pulled-{coordinator[-16:]}"
        try:
            offset = int(mark.read_text())
        except (OSError, ValueError):
            offset = 0
        for _ in range(64):  # at most 64 reads a look: a long backlog comes over several
            got = await self.replication.log(coordinator, (self.gossip.me, job), offset)
            if isinstance(got, str):
                log.info("the job's output could not be fetched from its coordinator", job=job, why=got)
                return False
            lines, after = got
            if offset == 0 and lines and lines[0][0] == 0 and (n := taken_over_at(lines[0][1])) is not None:
                # the coordinator's copy holds the attempt it took over whole: in place of ours from there
                await trio.to_thread.run_sync(self.store.cut_log_at_attempt, job, n)
            if lines:
                self.store.append_logs(job, [(rank, text.encode("utf-8", "replace")) for rank, text in lines])
            if after == offset:
                return True
            offset = after
            mark.parent.mkdir(mode=0o700, exist_ok=True)
            write_atomically(mark, str(offset).encode())
        return False

    def handed_log(self, origin: str, job: str, offset: int, limit: int) -> tuple[list[tuple[int, str]], int] | None:
        """A taken-over job's output here from `offset`, for its origin (replication's ``log``)."""
        store = self.store if origin == self.gossip.me else self.handed
        row = store.get(job)
        if row is None or row.coordinator != origin:
            return None
        return store.read_log(job, offset=offset, limit=limit)

    def cancel_handed(self, origin: str, job: str) -> str | None:
        """The origin's cancel of a job this node took over (replication's ``cancel``)."""
        live = self.live.get(job)
        if live is None or live.auth.origin != origin:
            return None
        return self.cancel(job)

    # --- the view -----------------------------------------------------------------------

    def _host(self, peer: str, auth: Authority) -> Host:
        if peer == self.gossip.me:
            return LocalHost(peer, self.worker, auth)
        assert self.gossip.swarm is not None
        assert self.transport is not None
        return RemoteHost(peer, self.transport.host, self.gossip.swarm.cert.blob, auth)

    def _records(self, view: View | None = None) -> dict[str, tuple[str, Record]]:
        """peer -> (state, record), this node included; a member whose record is past its ttl
        is "stale" (placement leaves it out, saying so)."""
        records: dict[str, tuple[str, Record]] = {}
        for m in view if view is not None else self.gossip.view():
            records[m.peer] = ("stale" if m.stale else m.state.value, m.record)
        own = self.gossip.own_record
        if own is not None:
            records[own.peer] = ("alive", own)
        return records

    def _candidates(self, view: View) -> list[Candidate]:
        out = []
        for peer, (state, r) in self._records(view).items():
            if r.jobs is None:
                continue
            gpu = r.resources.gpus[0].name if r.resources.gpus else None
            out.append(Candidate(peer=peer, state=state, gpus_free=r.jobs.gpus_free, gpu_model=gpu,
                                 slots_free=r.jobs.free, cpu_free=r.resources.cpu_free,
                                 memory_free_mb=r.resources.memory_free_mb, labels=r.labels,
                                 load=float(r.jobs.ranks)))
        return out

    def _rtt(self, view: View) -> Rtt:
        """How placement and checkpoint replication measure a pair, from a worker thread: with
        routing, the RTT of the path the pair's traffic takes where this node is an end, else
        what was measured, else the network-coordinate estimate (`Routing.rtt_ms`, which reads
        only immutable snapshots), so no pair of members with coordinates is unknown; without
        it, the probes in ``view`` only."""
        if self.path_rtt is not None:
            return self.path_rtt()
        return functools.partial(_rtt_ms, view)

    def _repack(self, digest: str, archive: Path) -> None:
        """The workdir archive `digest` made from this host's unpacked copy (workdir.pack is
        deterministic), for a job taken over from its origin, which had the client's. HostError
        when this host has no copy or packs another digest."""
        if not self.worker.cache.has(digest):
            raise HostError(f"the job's workdir {digest[:12]} is not on this node (it took the job over)")
        try:
            with self.worker.cache.hold(digest) as tree:
                packed = pack(tree)
        except WorkdirError as exc:
            raise HostError(f"the job's workdir {digest[:12]}: {exc}") from None
        if packed.digest != digest:
            raise HostError(f"the job's workdir {digest[:12]} packs as {packed.digest[:12]} here")
        write_atomically(archive, packed.data)

    def _address_or(self, peer: str) -> str:
        """`_address`, or "?" for a host gone from the view (a taken-over attempt's address is a
        Ray job's only; its ranks have theirs)."""
        try:
            return self._address(peer)
        except (HostError, KeyError):
            return "?"

    def _address(self, peer: str) -> str:
        """Where the other ranks reach this host: its overlay address, else its first IPv4."""
        _, record = self._records()[peer]
        if record.wg is not None:
            return record.wg.addr4
        for addr in record.addrs:
            if (ip := multiaddrs.ip_of(addr)) is not None and ip.version == 4:
                return str(ip)
        raise HostError(f"{short(peer)} advertises no IPv4 address")


_TAKEN_OVER = re.compile(r"\[swarmd\] \S+ took the job over at epoch \d+ .*: attempt (\d+)'s output from its start")


def takeover_marker(me: str, epoch: int, predecessor: str, attempt: int) -> str:
    """The first line of a successor's copy of a job's output (`taken_over_at` reads it back)."""
    return (f"[swarmd] {short(me)} took the job over at epoch {epoch} ({short(predecessor)} is gone): "
            f"attempt {attempt}'s output from its start")


def taken_over_at(line: str) -> int | None:
    """The attempt a successor's copy of the output begins with, from its first line."""
    m = _TAKEN_OVER.fullmatch(line)
    return int(m.group(1)) if m else None


def _rtt_ms(view: View, a: str, b: str) -> float | None:
    """This node's own probes for pairs it is in; else what either end's record reports (each
    lists its nearest members); None when neither knows. Reads only the immutable ``view``:
    placement calls it from a worker thread."""
    if view.me in (a, b):
        m = view.get(b if a == view.me else a)
        return None if m is None or m.rtt_min is None else m.rtt_min * 1000
    for x, y in ((a, b), (b, a)):
        m = view.get(x)
        if m is not None and y in m.record.rtts:
            return m.record.rtts[y]
    return None


async def _quietly(fn: Any, *args: Any) -> None:
    try:
        with trio.move_on_after(5):
            await fn(*args)
    except HostError as exc:
        log.info("job request to a host failed", error=str(exc))
