"""A job's checkpoints on its coordinator (trio): the hub that keeps them beyond the host that
wrote them, and puts them in front of every attempt.

- A host announces each complete checkpoint its ranks renamed into $SWARM_CHECKPOINT_DIR
  (``{ckpt: [name, sha256, size]}``, checked by events.py). Only rank 0's host writes the
  job's checkpoints (torchrun's convention): another host's are ignored, so no host but the
  one whose state the job resumes from can put files in front of the next attempt's ranks;
  one over this host's `checkpoint_max` is ignored too. The newest `checkpoint_keep` are kept.
- One transfer at a time per job, in the background (`replicator`): the newest checkpoint is
  copied into this coordinator's own cache for the job (the hub's: `Worker.hubs` keeps it as
  long as the job), pulled off the host that wrote it; one written on this host is pushed to
  the job's host nearest it. Checkpoints announced during a transfer are skipped but the
  newest. No error of a host, or of this host's disk, ever leaves the replicator.
- Before an attempt (`put_all`): every checkpoint still held by a live host is fetched into
  the hub where it is missing, then pushed to every other host of the attempt (one that has
  it answers at once). One whose only copy was on a lost host is never used. A host that
  refuses a put (its checkpoint budget, its disk, a broken stream) is named in
  `HostsRefused`: the coordinator places the attempt again without it, as after a refused
  reservation, rather than failing the job (issue 23 #4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog
import trio

from ...p2p.signed import short
from ..checkpoints.rules import check_name, choose_replica, is_sha256
from ..host.worker import Worker, WorkerError
from .hosts import Host, HostError
from .placement import Rtt
from .run import Run

log = structlog.get_logger("swarmd.jobs")

MAX_INDEX = 64  # checkpoints in a replicated index (the hub keeps checkpoint_keep)
MAX_INDEX_HOLDERS = 1024  # hosts said to hold one
Listed = tuple[tuple[str, str, int], ...]  # (name, sha256, size) as a start request lists them


@dataclasses.dataclass(slots=True)
class Checkpoint:
    name: str
    sha: str
    size: int
    source: str  # the host whose ranks wrote it
    holders: set[str]  # hosts whose cache for this job holds it


class HostsRefused(HostError):
    """Hosts that refused their part of an attempt's setup (a checkpoint put, the workdir):
    `refused` says why for each; the coordinator places the attempt again without them."""

    def __init__(self, what: str, refused: dict[str, str]) -> None:
        super().__init__(f"{what} failed: {'; '.join(refused.values())}")
        self.refused = refused


class Hub:
    def __init__(self, job: str, *, worker: Worker, me: str, host: Callable[[str], Host],
                 origin: str | None = None) -> None:
        self.job = job
        self.worker = worker
        self.me = me
        self.origin = origin or me  # whose job: its cache here is keyed by it (a successor's hub too)
        self.host = host  # a proxy for a host the attempt's own map lacks
        self.checkpoints: list[Checkpoint] = []  # oldest first
        self._wanted = trio.Event()  # set: a new checkpoint to copy

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": c.name, "sha256": c.sha, "size": c.size, "source": c.source, "holders": sorted(c.holders)}
                for c in self.checkpoints]

    def restore(self, listed: Any, max_size: int) -> None:
        """The index a predecessor replicated (`describe`'s form, from a replica: a member's
        bytes): each entry checked, at most checkpoint_keep kept. ValueError naming the first
        that is not one."""
        if not isinstance(listed, list) or len(listed) > MAX_INDEX:
            raise ValueError(f"record.checkpoints must be a list of at most {MAX_INDEX}")
        out = []
        for c in listed:
            if not isinstance(c, dict):
                raise ValueError("record.checkpoints holds a non-map")
            name = check_name(c.get("name"), "record.checkpoints name")
            sha, size = c.get("sha256"), c.get("size")
            if not is_sha256(sha) or isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= max_size:
                raise ValueError("record.checkpoints: a sha256 and a size within checkpoint_max each")
            source, holders = c.get("source"), c.get("holders")
            if not isinstance(holders, list) or len(holders) > MAX_INDEX_HOLDERS or \
                    not all(isinstance(p, str) and 0 < len(p) <= 64 for p in [source, *holders]):
                raise ValueError("record.checkpoints: source and holders must be peer ids")
            out.append(Checkpoint(name=name, sha=sha, size=size, source=source, holders=set(holders)))
        self.checkpoints = out[-max(self.worker.checkpoint_keep, 1):]
        self.worker.keep_checkpoints(self.job, self.origin, [c.sha for c in self.checkpoints])

    def announced(self, run: Run, peer: str, name: str, sha: str, size: int) -> bool:
        """Host `peer` of the current attempt of `run` announced a complete checkpoint; True when
        it is a new one, recorded (the moment a growth is looked at: growth.py)."""
        if not run.nodes or peer != run.nodes[0]:
            log.info("checkpoint not from rank 0's host ignored", job=self.job, name=name, host=short(peer))
            return False
        if size > self.worker.checkpoint_max:
            log.info("checkpoint over checkpoint_max ignored", job=self.job, name=name, size=size, host=short(peer))
            return False
        known = next((c for c in self.checkpoints if c.sha == sha), None)
        if known is not None:
            if known.size == size:
                known.holders.add(peer)
            return False
        self.checkpoints.append(Checkpoint(name=name, sha=sha, size=size, source=peer, holders={peer}))
        del self.checkpoints[:-max(self.worker.checkpoint_keep, 1)]
        self.worker.keep_checkpoints(self.job, self.origin, [c.sha for c in self.checkpoints])
        log.info("checkpoint", job=self.job, name=name, sha=sha[:12], size=size, host=short(peer))
        self._wanted.set()
        return True

    async def replicator(self, run: Run, hosts: Callable[[], Mapping[str, Host]], rtt_ms: Callable[[], Rtt]) -> None:
        """Copies the newest checkpoint off the host that wrote it, one transfer at a time."""
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            if not self.checkpoints:
                continue
            ckpt = self.checkpoints[-1]
            try:
                await self._replicate(run, hosts(), rtt_ms(), ckpt)
            except Exception as exc:  # a host's misbehaviour or this host's disk: never the daemon's end
                log.info("checkpoint not replicated", job=self.job, name=ckpt.name, sha=ckpt.sha[:12],
                         error=f"{exc.__class__.__name__}: {exc}")

    async def _replicate(self, run: Run, hosts: Mapping[str, Host], rtt_ms: Rtt, ckpt: Checkpoint) -> None:
        if ckpt.source != self.me:
            await self.fetch(run, hosts, ckpt)
            return
        others = [p for p in run.nodes if p != self.me and p not in run.lost]
        replica = choose_replica(self.me, others, rtt_ms)
        path = self.worker.checkpoint_path(self.job, self.origin, ckpt.sha)
        if replica is None or path is None or replica in ckpt.holders:
            return
        await hosts[replica].put_checkpoint(self.job, ckpt.name, ckpt.sha, ckpt.size, path)
        ckpt.holders.add(replica)

    async def fetch(self, run: Run, hosts: Mapping[str, Host], ckpt: Checkpoint) -> None:
        """`ckpt` into the hub, from a live host that holds it; HostError when none gave it."""
        if self.worker.checkpoint_path(self.job, self.origin, ckpt.sha) is not None:
            ckpt.holders.add(self.me)
            return
        errors = []
        for holder in sorted(ckpt.holders - run.lost - {self.me}):
            host = hosts.get(holder) or self.host(holder)
            try:
                dest = self.worker.incoming_checkpoint(self.job, self.origin, ckpt.size)
                await host.get_checkpoint(self.job, ckpt.sha, ckpt.size, dest)
                await self.worker.store_checkpoint(self.job, self.origin, ckpt.sha, ckpt.size, dest)
            except (HostError, WorkerError) as exc:  # that host, or this host's disk: try another
                errors.append(str(exc))
                continue
            ckpt.holders.add(self.me)
            return
        raise HostError(f"no live host gave checkpoint {ckpt.name}" + (f": {'; '.join(errors)}" if errors else ""))

    async def put_all(self, run: Run, hosts: Mapping[str, Host], peers: tuple[str, ...]) -> Listed:
        """The job's newest checkpoints still held by a live host, on every host of the attempt
        `peers`; what its start requests list (oldest first: the last is the one to resume from).
        HostsRefused naming the hosts that refused a put."""
        usable: list[tuple[Checkpoint, Path]] = []
        for ckpt in list(self.checkpoints):
            try:
                await self.fetch(run, hosts, ckpt)
            except HostError as exc:  # its host died before anyone copied it: never used
                log.info("checkpoint lost with its host", job=self.job, name=ckpt.name, why=str(exc))
                continue
            if (path := self.worker.checkpoint_path(self.job, self.origin, ckpt.sha)) is None:  # no host's doing
                log.warning("checkpoint gone from the hub's cache", job=self.job, name=ckpt.name, sha=ckpt.sha[:12])
                continue
            usable.append((ckpt, path))
        refused: dict[str, str] = {}

        async def put(peer: str, ckpt: Checkpoint, path: Path) -> None:
            try:
                await hosts[peer].put_checkpoint(self.job, ckpt.name, ckpt.sha, ckpt.size, path)
            except HostError as exc:
                refused.setdefault(peer, str(exc))
                return
            ckpt.holders.add(peer)

        async with trio.open_nursery() as nursery:  # to every other host: one that still has it answers at once
            for peer in peers:
                for ckpt, path in usable:
                    if peer != self.me:
                        nursery.start_soon(put, peer, ckpt, path)
        if refused:
            raise HostsRefused("putting the job's checkpoints on its hosts", refused)
        return tuple((c.name, c.sha, c.size) for c, _ in usable)
