"""A service controller's decisions (sans-IO): which replicas to start, drain and stop.

Theory of operation. A service wants ``replicas`` copies of one generation of its spec (``serve
up`` again with anything changed makes a new generation). Each copy is a *slot*: a replica
index (0-999, the lowest free one) and the one-node job that runs it (its coordinator is this
node; the job protocol places it, apart from the service's other replicas, and restarts it on
another host when its host dies, compute/coordinator). ``Controller.step(now, observed)`` reads
what the jobs and the registry say of each slot and returns actions; the trio side
(service.py) carries them out and persists the slots.

Rules:
- A slot whose job ended without being asked to (it failed for good, or was cancelled from
  outside) is started again after a back-off: 1 s, doubling per failure in a row, up to 60 s;
  a slot that served healthy resets its count.
- Scale up: new slots at the lowest free indexes. Scale down: the highest indexes drain.
- Roll out (a new generation): one surge slot of the new generation at a time; once it is
  healthy (its host's health check, as the registry shows it), one old slot drains; again
  until none is old. A new generation that never gets healthy leaves the old ones serving.
  A slot being moved (``relocate``: nearer its demand, service.py) is replaced the same way.
- Drain: the slot leaves the claim at once (gateways stop sending it new requests within a
  gossip round and their next poll), its job is stopped ``DRAIN_S`` later (requests in
  flight finish meanwhile; a longer one is cut), and the slot is forgotten once its job ended.
- The claim's assignment is every slot not draining whose job runs, with its host.
- A replica's start time (its job asked for, to its first healthy check) is measured on
  every start; ``start_s``, the median of the last few, is the autoscaler's lead time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..gossip.registry import MAX_ASSIGNED, MAX_INDEX

DRAIN_S = 5.0  # a draining replica runs this long out of the claim: gateways learn of it, requests finish
BACKOFF_S, BACKOFF_MAX_S = 1.0, 60.0
START_SAMPLES, START_DEFAULT_S = 5, 30.0
ENDED = ("succeeded", "failed", "cancelled")


@dataclass(slots=True, kw_only=True)
class Slot:
    index: int
    generation: int
    job: str | None = None  # None: to be started (at retry_at)
    draining_since: float | None = None
    stop_sent: bool = False
    failures: int = 0  # ends in a row without being asked
    retry_at: float = 0.0
    started_at: float | None = None  # when its job was last asked for, until it first served healthy
    moving: bool = False  # to be replaced by a replica placed anew (nearer its demand), as in a roll-out

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "generation": self.generation, "job": self.job,
                "draining": self.draining_since is not None, "failures": self.failures, "moving": self.moving}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Slot:
        index, generation, job = data.get("index"), data.get("generation"), data.get("job")
        if not (isinstance(index, int) and 0 <= index <= MAX_INDEX and isinstance(generation, int)
                and generation >= 0 and (job is None or isinstance(job, str))):
            raise ValueError(f"a slot must have index 0-{MAX_INDEX}, a generation and a job id, got {data!r:.200}")
        failures = data.get("failures", 0)
        return cls(index=index, generation=generation, job=job, failures=failures if isinstance(failures, int) else 0,
                   moving=data.get("moving") is True,
                   # a drain interrupted by a restart goes on at once
                   draining_since=float("-inf") if data.get("draining") else None)


@dataclass(frozen=True, slots=True, kw_only=True)
class Observed:
    """What this node knows of a slot's job now."""
    state: str  # the job's state (placing ... running, restarting, or ENDED)
    host: str | None = None  # where it runs, while it runs
    healthy: bool = False  # its host announces it healthy (the registry)


@dataclass(frozen=True, slots=True)
class StartReplica:
    index: int
    generation: int


@dataclass(frozen=True, slots=True)
class StopReplica:
    index: int
    job: str


Action = StartReplica | StopReplica


@dataclass(slots=True)
class Controller:
    replicas: int
    generation: int
    slots: dict[int, Slot] = field(default_factory=dict)
    start_times: list[float] = field(default_factory=list)  # the last START_SAMPLES replicas' starts, seconds

    @property
    def start_s(self) -> float:
        """A replica's start time as measured here (job asked for -> first healthy): the median of
        the last few, ``START_DEFAULT_S`` before any."""
        if not self.start_times:
            return START_DEFAULT_S
        ordered = sorted(self.start_times)
        return ordered[len(ordered) // 2]

    def __post_init__(self) -> None:
        if not 0 <= self.replicas <= MAX_ASSIGNED:
            raise ValueError(f"replicas must be 0-{MAX_ASSIGNED}, got {self.replicas}")

    def relocate(self, index: int) -> None:
        """Replace the slot by one placed anew: a surge slot first, this one drained once that is
        healthy (the roll-out's rule)."""
        self.slots[index].moving = True

    def started(self, index: int, job: str) -> None:
        """The trio side submitted the slot's job."""
        self.slots[index].job = job

    def step(self, now: float, observed: Mapping[str, Observed]) -> list[Action]:
        """``observed``: job id -> what is known of it (a job not in it is taken as still placing)."""
        actions: list[Action] = []
        for slot in list(self.slots.values()):
            seen = observed.get(slot.job) if slot.job is not None else None
            if slot.draining_since is not None:
                if slot.job is None or (seen is not None and seen.state in ENDED):
                    del self.slots[slot.index]
                elif not slot.stop_sent and now - slot.draining_since >= DRAIN_S:
                    slot.stop_sent = True
                    actions.append(StopReplica(slot.index, slot.job))
                continue
            if seen is not None and seen.state in ENDED:
                slot.failures += 1
                slot.job, slot.retry_at = None, now + min(BACKOFF_S * 2 ** (slot.failures - 1), BACKOFF_MAX_S)
            elif seen is not None and seen.healthy:
                slot.failures = 0
                if slot.started_at is not None:
                    self.start_times = [*self.start_times, now - slot.started_at][-START_SAMPLES:]
                    slot.started_at = None
            if slot.job is None and now >= slot.retry_at:
                slot.started_at = now
                actions.append(StartReplica(slot.index, slot.generation))

        active = [s for s in self.slots.values() if s.draining_since is None]
        old = sorted((s for s in active if s.generation != self.generation or s.moving), key=lambda s: s.index)
        new = [s for s in active if s.generation == self.generation and not s.moving]
        ready = all(self._healthy(s, observed) for s in new)
        if len(active) < self.replicas or (old and ready and len(active) == self.replicas):
            for _ in range(max(self.replicas - len(active), 1 if old else 0)):
                actions.append(self._new_slot(now))
        elif len(active) > self.replicas and (not old or ready):
            surplus = len(active) - self.replicas
            for slot in (old or sorted(active, key=lambda s: -s.index))[:surplus]:
                slot.draining_since = now
        return actions

    def assigned(self, observed: Mapping[str, Observed]) -> tuple[tuple[int, str], ...]:
        """The claim's (index, host) pairs: slots not draining whose job runs."""
        out = []
        for slot in sorted(self.slots.values(), key=lambda s: s.index):
            seen = observed.get(slot.job) if slot.job is not None else None
            if slot.draining_since is None and seen is not None and seen.state == "running" and seen.host:
                out.append((slot.index, seen.host))
        return tuple(out)

    def _new_slot(self, now: float) -> StartReplica:
        index = next(i for i in range(MAX_INDEX + 1) if i not in self.slots)
        self.slots[index] = Slot(index=index, generation=self.generation, started_at=now)
        return StartReplica(index, self.generation)

    @staticmethod
    def _healthy(slot: Slot, observed: Mapping[str, Observed]) -> bool:
        seen = observed.get(slot.job) if slot.job is not None else None
        return seen is not None and seen.healthy
