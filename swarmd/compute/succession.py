"""Who coordinates a job (sans-IO): the charter, epochs, fencing, replicas, the successor.

A job outlives the daemon that took it (its *origin*) because its own hosts carry it. This
module holds the rules; the coordinator and the hosts' job protocol apply them.

Theory of operation
- **The charter.** Once the first attempt is placed, the origin signs a charter: the job id,
  the owner (the origin's peer and the submitting uid), the digest of the spec, and the
  *replicas*: the origin first, then the first hosts in rank order, at most ``MAX_REPLICAS``
  in all. The signature is the origin's (its key is inside its peer id), so no replica can
  change the job's owner, spec, command or replicas: a charter that fails to verify, or
  that differs from the one a host or replica already holds for the job, is refused.
- **Epochs.** The coordinator of epoch ``e`` is ``replicas[e % len(replicas)]``: one peer
  per epoch, fixed by the charter, so two replicas can never act at the same epoch (no
  tie to break, as in Raft's one leader per term). Epoch 0 is the origin's.
- **Fencing** (`Fence`, the host side; Chubby's sequencers, ZooKeeper's zxid epochs). A host
  obeys a command about the job only from the coordinator of the highest epoch it has seen:
  a command at a lower epoch, or from a peer that is not that epoch's coordinator, is
  refused with a reason and counted. (No bound on how far ahead an epoch may be: a replica
  that restarted alone, partitioned, twice, is legitimately rounds ahead of hosts that never
  heard of it.) So at most one coordinator
  acts on a host at any time, and an old one that comes back, or was only partitioned
  away, is refused from the first command after the host saw the higher epoch.
- **Replication** (`Replicas`, every replica). The coordinator writes each transition of the
  job's record to every replica it can reach *before* acting on it (write-ahead). A record
  is signed by its epoch's coordinator, so replicas may pass records on and the receiver
  still knows who wrote each; a replica keeps the one with the highest (epoch, seq) and
  refuses an older one, which tells a superseded coordinator to stand down. Records are bounded
  (``MAX_RECORD`` bytes; ``MAX_JOBS`` jobs, ``MAX_PER_ORIGIN`` per origin: a member cannot
  push another's jobs out).
- **Quorums** (`quorum`). A coordinator writes its epoch to a majority of the replicas
  before it commands a host (a takeover), and again before it begins an attempt or takes an
  end it saw alone: a superseded one then meets the newer epoch in some replica (``stale``)
  and stands down; one cut off from the majority stands still. Replicas membership declares
  gone are removed from the configuration, one write at a time, by a majority of the old
  configuration and of the new, so a job survives its replicas failing one after another
  (down to two), never two halves of a partition acting at once.
- **Succession** (`takeover`). When membership says the coordinator of the epoch a replica
  knows is gone (dead or left, or it said it leaves), the next epoch whose coordinator is
  not gone has its successor, deterministically; that replica first gathers the records of
  every replica it can reach and continues from the newest (`newest`), then announces its
  epoch to replicas and hosts. Every host that obeyed a transition is a replica holding it
  (write-ahead), so a successor that reaches the surviving hosts loses none. A daemon that
  restarts never resumes a role from its past life: it learns the epoch from the others,
  and takes over only as the successor of a gone coordinator, or, when the newest epoch
  is its own from a past life, at a fresh epoch of its own one round later.

What a lying member can do: a non-replica nothing (refused: ``not_replica``); a replica
only what the charter lets it: coordinate at its own epochs, once the one before is gone
from its own view. It cannot rewrite the owner, spec or command (signed), replay an old
epoch (``stale_epoch``), or act at another's epoch (``not_its_epoch``). It can claim an
epoch near ``MAX_EPOCH`` at its own turn: then no successor follows it, which costs only the
job it already coordinates (its hosts took it as one of them).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from ..p2p.signed import Invalid, Signer, field, peer_bytes, peer_key, seal, unseal
from .ids import check_job_id

MAX_REPLICAS = 5  # the origin and 4 hosts: losing any 4 at once still leaves a successor
MAX_RECORD = 48 * 1024  # bytes of a job's replicated record (spec, attempts, checkpoints index)
MAX_JOBS = 512  # records a replica holds for others (each at most MAX_RECORD: 24 MiB at worst)
MAX_PER_ORIGIN = 64  # of them from one origin: one member's jobs never push another's out
MAX_EPOCH = (1 << 31) - 1  # every epoch stays a small int (a peer's 2**64 would feed arithmetic)
MAX_SEQ = (1 << 53) - 1
MAX_UID = (1 << 32) - 1
MAX_FENCED = 4096  # jobs a host remembers the epoch of (each held or run here, or recently)
_DIGEST = re.compile(r"[0-9a-f]{64}", re.ASCII)

Gone = Callable[[str], bool]  # what membership says of a peer: dead, left, or leaving


def spec_digest(spec_wire: dict[str, Any]) -> str:
    """The digest a charter binds: sha256 of the spec's wire form, packed."""
    return hashlib.sha256(msgpack.packb(spec_wire, use_bin_type=True)).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Charter:
    """A job's signed, immutable facts: whose it is, what it runs, who may coordinate it."""

    origin: str
    job: str
    owner_uid: int
    spec: str  # spec_digest of what runs
    replicas: tuple[str, ...]  # origin first
    blob: bytes  # the signed form, what crosses the wire and is compared

    @property
    def key(self) -> tuple[str, str]:
        """How hosts and replicas know the job: (origin, id), as the ledger keys its holds."""
        return self.origin, self.job

    @classmethod
    def make(cls, *, origin: str, job: str, owner_uid: int, spec: str, hosts: Iterable[str],
             sign: Signer) -> Charter:
        replicas = [origin]
        for peer in hosts:
            if peer not in replicas and len(replicas) < MAX_REPLICAS:
                replicas.append(peer)
        body = {"origin": origin, "job": job, "owner_uid": owner_uid, "spec": spec, "replicas": replicas}
        return cls.open(seal(body, sign))

    @classmethod
    def open(cls, blob: Any) -> Charter:
        """The charter in ``blob``, its format and the origin's signature checked; `Invalid`."""
        body, _, _ = unseal(blob)
        origin = field(body, "origin", str, "charter")
        unseal(blob, peer_key(peer_bytes(origin)))  # Invalid("signature") unless the origin signed it
        job = field(body, "job", str, "charter")
        try:
            check_job_id(job)
        except ValueError as exc:
            raise Invalid("malformed", str(exc)) from None
        uid = field(body, "owner_uid", int, "charter")
        if not 0 <= uid <= MAX_UID:
            raise Invalid("malformed", f"charter.owner_uid {uid} is not a uid")
        spec = field(body, "spec", str, "charter")
        if not _DIGEST.fullmatch(spec):
            raise Invalid("malformed", "charter.spec is not a sha256 digest")
        replicas = field(body, "replicas", list, "charter")
        if not 1 <= len(replicas) <= MAX_REPLICAS or replicas[0] != origin:
            raise Invalid("malformed", f"charter.replicas: 1 to {MAX_REPLICAS} peers, the origin first")
        for peer in replicas:
            if not isinstance(peer, str):
                raise Invalid("malformed", "charter.replicas holds a non-string")
            peer_bytes(peer)  # Invalid unless an Ed25519 peer id
        if len(set(replicas)) != len(replicas):
            raise Invalid("malformed", "charter.replicas names a peer twice")
        return cls(origin=origin, job=job, owner_uid=uid, spec=spec, replicas=tuple(replicas), blob=blob)

    def coordinator(self, epoch: int) -> str:
        return self.replicas[epoch % len(self.replicas)]

    def next_epoch(self, epoch: int, gone: Gone) -> int | None:
        """The first epoch after ``epoch`` whose coordinator is not gone; None when all are."""
        for e in range(epoch + 1, epoch + 1 + len(self.replicas)):
            if e <= MAX_EPOCH and not gone(self.coordinator(e)):
                return e
        return None


def check_epoch(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_EPOCH:
        raise Invalid("bad_epoch", f"epoch must be an integer from 0 to {MAX_EPOCH}")
    return value


def takeover(me: str, charter: Charter, epoch: int, gone: Gone, *, acting: bool) -> int | None:
    """The epoch at which ``me`` takes the job over, or None. ``epoch`` is the newest that
    the replicas ``me`` reaches hold (`newest`); ``acting``, whether ``me`` coordinates now.
    Either the coordinator of ``epoch`` is gone and ``me`` has the next epoch whose
    coordinator is not, or it was ``me`` in a past life (a restart) and nobody took over
    meanwhile: then ``me`` goes on at a fresh epoch of its own, one round later, so no host
    takes a command of its new life for one of its old."""
    if acting or me not in charter.replicas:
        return None
    current = charter.coordinator(epoch)
    if current == me:
        e = epoch + len(charter.replicas)
        return e if e <= MAX_EPOCH else None
    if not gone(current):
        return None
    e = charter.next_epoch(epoch, lambda p: p != me and gone(p))
    return e if e is not None and charter.coordinator(e) == me else None


@dataclass(frozen=True, slots=True)
class Seen:
    epoch: int
    coordinator: str
    charter: Charter


class Fence:
    """A host's side: the highest epoch seen per job, and who may command it."""

    def __init__(self, *, max_jobs: int = MAX_FENCED) -> None:
        self._seen: dict[tuple[str, str], Seen] = {}
        self.refused: dict[str, int] = {}  # by reason
        self.max_jobs = max_jobs

    def command(self, job: str, peer: str, origin: str, epoch: int, charter: Charter | None,
                keep: Callable[[tuple[str, str]], bool] = lambda key: True) -> str | None:
        """Why ``peer`` may not command the job (``origin``, ``job``) at ``epoch`` (a reason,
        counted), or None. With a ``charter`` (signed by the origin: checked by the caller),
        `admit`; without, the epoch this host obeys for the job decides, and a job it knows
        no charter of obeys its origin alone (a job's first reservation comes before its
        charter). ``keep``: whether a job's entry must stay when the fence is full (a hold
        or ranks of it here); the others are forgotten, oldest first."""
        if charter is not None:
            if charter.key != (origin, job):
                return self._count("charter_mismatch")
            if charter.key not in self._seen and len(self._seen) >= self.max_jobs:
                for key in [k for k in self._seen if not keep(k)][:max(1, self.max_jobs // 8)]:
                    del self._seen[key]
                if len(self._seen) >= self.max_jobs:
                    return self._count("full")
            return self.admit(charter, peer, epoch)
        seen = self._seen.get((origin, job))
        if seen is None:
            return None if peer == origin else self._count("not_coordinator")
        return self.admit(seen.charter, peer, epoch)

    def _count(self, why: str) -> str:
        self.refused[why] = self.refused.get(why, 0) + 1
        return why

    def check(self, charter: Charter, peer: str, epoch: int) -> str | None:
        """Why ``peer`` may not command the job at ``epoch`` (a reason label), or None."""
        if peer not in charter.replicas:
            return "not_replica"
        if peer != charter.coordinator(epoch):
            return "not_its_epoch"
        seen = self._seen.get(charter.key)
        if seen is None:
            return None
        if charter.blob != seen.charter.blob:
            return "charter_changed"
        if epoch < seen.epoch:
            return "stale_epoch"
        return None

    def admit(self, charter: Charter, peer: str, epoch: int) -> str | None:
        """`check`, and on success the epoch becomes the one this host obeys; counts refusals."""
        why = self.check(charter, peer, epoch)
        if why is not None:
            return self._count(why)
        seen = self._seen.get(charter.key)
        if seen is None or epoch > seen.epoch:
            self._seen[charter.key] = Seen(epoch, peer, charter)
        return None

    def seen(self, key: tuple[str, str]) -> Seen | None:
        return self._seen.get(key)

    def forget(self, key: tuple[str, str]) -> None:
        """The job's hold here is over (its ranks ended and lingered): nothing left to fence."""
        self._seen.pop(key, None)


@dataclass(frozen=True, slots=True)
class Record:
    """A job's replicated record: its charter, the epoch and sequence that wrote it, and the
    coordinator's state of the job (opaque here: msgpack bytes, at most MAX_RECORD), signed
    by that epoch's coordinator, so any replica may pass it on (a successor gathering, an
    origin catching up) and the receiver still knows who wrote it."""

    charter: Charter
    epoch: int
    seq: int
    body: bytes
    blob: bytes

    @property
    def version(self) -> tuple[int, int]:
        return self.epoch, self.seq

    @classmethod
    def make(cls, charter: Charter, epoch: int, seq: int, body: bytes, sign: Signer) -> Record:
        return cls.open(seal({"charter": charter.blob, "epoch": epoch, "seq": seq, "body": body}, sign))

    @classmethod
    def open(cls, blob: Any, charter: Charter | None = None) -> Record:
        """The record in ``blob``, signed by its epoch's coordinator; `Invalid` otherwise. With
        ``charter``, the record's must be that one."""
        if isinstance(blob, bytes) and len(blob) > MAX_RECORD + 4096:
            raise Invalid("too_large", f"a record of {len(blob)} bytes, the limit is {MAX_RECORD + 4096}")
        body, _, _ = unseal(blob)
        raw = field(body, "charter", bytes, "record")
        if charter is not None and raw != charter.blob:
            raise Invalid("charter_changed", "the record's charter is not the job's")
        charter = charter or Charter.open(raw)
        epoch = check_epoch(body.get("epoch"))
        seq = field(body, "seq", int, "record")
        if not 0 <= seq <= MAX_SEQ:
            raise Invalid("malformed", f"record.seq must be from 0 to {MAX_SEQ}")
        state = field(body, "body", bytes, "record")
        if len(state) > MAX_RECORD:
            raise Invalid("too_large", f"a record body of {len(state)} bytes, the limit is {MAX_RECORD}")
        unseal(blob, peer_key(peer_bytes(charter.coordinator(epoch))))  # Invalid("signature") otherwise
        return cls(charter=charter, epoch=epoch, seq=seq, body=state, blob=blob)


def quorum(replicas: Iterable[str], configs: Iterable[Iterable[str]], acks: Iterable[str]) -> bool:
    """Whether the replicas that took a write (``acks``) are a majority of every configuration
    in ``configs``, each given as the replicas *removed* from ``replicas``: the committed one,
    one a coordinator began and may not have finished, and the one being written. A write
    that changes the configuration so needs a majority of the old one and of the new (joint
    consensus, as in Raft's membership changes), so two coordinators' writes always meet in a
    replica, whatever each removed."""
    everyone, took = set(replicas), set(acks)
    for removed in configs:
        members = everyone - set(removed)
        if not members or len(took & members) < len(members) // 2 + 1:
            return False
    return True


def check_removed(value: Any, charter: Charter) -> frozenset[str]:
    """A record's configuration (replicas removed), from a replica: peers of the charter only."""
    if not isinstance(value, list) or len(value) > MAX_REPLICAS or \
            not all(isinstance(p, str) and p in charter.replicas for p in value):
        raise Invalid("malformed", "record.removed must list replicas of the job's charter")
    return frozenset(value)


def newest(records: Iterable[Record | None]) -> Record | None:
    """What a successor continues from: the record with the highest (epoch, seq)."""
    found = [r for r in records if r is not None]
    return max(found, key=lambda r: r.version) if found else None


class Replicas:
    """The records this node holds as a replica of others' jobs (and its own)."""

    def __init__(self, me: str, *, max_jobs: int = MAX_JOBS, max_per_origin: int = MAX_PER_ORIGIN) -> None:
        self.me = me
        self.max_jobs, self.max_per_origin = max_jobs, max_per_origin
        self._records: dict[tuple[str, str], Record] = {}
        self.refused: dict[str, int] = {}

    def check(self, record: Record) -> str | None:
        """Why ``record`` (opened: its writer verified) is not taken (a reason label), or None."""
        charter = record.charter
        if self.me not in charter.replicas:
            return "not_replica"
        held = self._records.get(charter.key)
        if held is None:
            if len(self._records) >= self.max_jobs:
                return "full"
            if sum(1 for o, _ in self._records if o == charter.origin) >= self.max_per_origin:
                return "full"
            return None
        if held.charter.blob != charter.blob:
            return "charter_changed"
        if record.version <= held.version:
            return "stale"
        return None

    def offer(self, record: Record) -> str | None:
        """Take ``record`` if `check` allows; the reason otherwise (counted). ``stale`` tells a
        superseded coordinator that a higher epoch (or its own newer write) is here."""
        why = self.check(record)
        if why is not None:
            self.refused[why] = self.refused.get(why, 0) + 1
            return why
        self._records[record.charter.key] = record
        return None

    def get(self, key: tuple[str, str]) -> Record | None:
        return self._records.get(key)

    def keys(self) -> list[tuple[str, str]]:
        return list(self._records)

    def drop(self, key: tuple[str, str]) -> None:
        """The job ended and its record is kept by its front end: no longer replicated here."""
        self._records.pop(key, None)

    def __len__(self) -> int:
        return len(self._records)
