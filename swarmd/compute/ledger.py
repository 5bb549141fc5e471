"""A host's job slots and GPUs: who holds what, and until when (sans-IO).

A hold is keyed by (coordinator, job): a job id is bound to the coordinator that minted it,
so another member that learned the id (as one of its hosts) holds, starts and frees only
its own (coordinator, id), never the first one's. Its life, one row per move (`_MOVES`):

    (none) --reserve--> leased --commit--> committed --start--> running --finish--> (none)
                          |                    |                   |
                          +---release/lapse----+--release/lapse->  +--release: the ranks are
                                                                      cancelled; freed at finish

Rules:
- A reservation takes one job slot, the GPUs and the number of ranks asked for, under a
  lease that ends at a deadline; a retry returns the same grant and does not renew the
  lease (reserving again cannot keep a slot forever). A commit gives the hold a start
  deadline (`start_within`, long enough for the workdir to be shipped): a coordinator that
  dies, or a member that never means to start, leaves nothing behind once it passes. A
  running hold has no deadline, so nothing lapses under running ranks.
- A coordinator may hold at most `max_unstarted` holds that are not running (default: all
  the slots). Not lower by default: one user submitting two jobs at once to a 2-slot host
  would see the second refused, and a member can fill every slot with jobs it really runs
  anyway; what the lapse above guarantees is that slots held without running anything come
  back. A per-member share of a host is a scheduling policy (fair share), not this check.
- `start` needs a committed hold of the same coordinator and at most the ranks reserved;
  the hold is then running until the driver reports `finish` (the ranks have exited).
- `release` of a running hold does not free it (its ranks still use the slot and GPUs):
  it answers `Cancel` and the driver stops the ranks; the hold goes at `finish`.
- Work beyond the free slots or GPUs is refused with the reason. A commit, start or
  release of an id that only another coordinator holds is refused as `not_holder`, naming
  neither that holder.
- GPUs are handed out lowest index first, so a host's choice is predictable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Grant:
    job: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str
    # set when the request broke the protocol (a metric label), empty when this host is
    # merely full or the request came too late
    code: str = ""


@dataclass(frozen=True, slots=True)
class Cancel:
    """The hold is running: stop its ranks; it is freed when they have exited."""
    job: str


LEASED, COMMITTED, RUNNING = "leased", "committed", "running"
FREED = None
# (move, state before) -> state after; a move missing here is refused
_MOVES: dict[tuple[str, str], str | None] = {
    ("reserve", LEASED): LEASED,  # a retry: the same grant
    ("reserve", COMMITTED): COMMITTED,
    ("reserve", RUNNING): RUNNING,
    ("commit", LEASED): COMMITTED,
    ("commit", COMMITTED): COMMITTED,  # a retry
    ("start", COMMITTED): RUNNING,
    ("release", LEASED): FREED,
    ("release", COMMITTED): FREED,
    ("release", RUNNING): RUNNING,  # Cancel: freed at finish
    ("finish", RUNNING): FREED,
}
_WHY = {  # (move, state) -> why it is refused, and its metric label
    ("commit", RUNNING): ("it is already running", "state"),
    ("start", LEASED): ("its reservation was never committed", "not_committed"),
    ("start", RUNNING): ("it is already running here", "state"),
}


@dataclass(slots=True)
class _Hold:
    job: str
    coordinator: str
    gpus: tuple[int, ...]
    ranks: int
    state: str
    deadline: float | None  # leased: the lease; committed: the start deadline; running: None


Key = tuple[str, str]  # (coordinator, job)


class Ledger:
    def __init__(self, slots: int, gpus: tuple[int, ...] = (), *, max_unstarted: int | None = None) -> None:
        if slots < 1:
            raise ValueError(f"a host needs at least one job slot, got {slots}")
        self.slots = slots
        self.gpus = tuple(sorted(gpus))
        self.max_unstarted = max_unstarted if max_unstarted is not None else slots
        self._holds: dict[Key, _Hold] = {}

    @property
    def slots_free(self) -> int:
        return self.slots - len(self._holds)

    @property
    def gpus_free(self) -> tuple[int, ...]:
        taken = {g for h in self._holds.values() for g in h.gpus}
        return tuple(g for g in self.gpus if g not in taken)

    def holds(self, job: str, coordinator: str) -> bool:
        return (coordinator, job) in self._holds

    def held(self) -> list[Key]:
        return list(self._holds)

    def state_of(self, job: str, coordinator: str) -> str | None:
        hold = self._holds.get((coordinator, job))
        return hold.state if hold else None

    def gpus_of(self, job: str, coordinator: str) -> tuple[int, ...]:
        hold = self._holds.get((coordinator, job))
        return hold.gpus if hold else ()

    def unstarted(self, coordinator: str) -> int:
        return sum(1 for (c, _), h in self._holds.items() if c == coordinator and h.state != RUNNING)

    def reserve(self, now: float, job: str, coordinator: str, gpus: int, ranks: int,
                lease: float) -> Grant | Refusal:
        self.expire(now)
        if (held := self._holds.get((coordinator, job))) is not None:
            if (refusal := self._check(held, "reserve")) is not None:
                return refusal
            return Grant(job, held.gpus)  # a retry: the same grant, the lease not renewed
        if ranks < 1:
            return Refusal("a reservation needs at least one rank")
        if self.slots_free < 1:
            return Refusal(f"no free job slot (all {self.slots} in use)")
        if self.unstarted(coordinator) >= self.max_unstarted:
            return Refusal(f"this coordinator already holds {self.max_unstarted} reservation(s) here "
                           "that have not started")
        free = self.gpus_free
        if gpus > len(free):
            return Refusal(f"{len(free)} free GPU(s), {gpus} asked")
        hold = _Hold(job=job, coordinator=coordinator, gpus=free[:gpus], ranks=ranks, state=LEASED,
                     deadline=now + lease)
        self._holds[(coordinator, job)] = hold
        return Grant(job, hold.gpus)

    def commit(self, now: float, job: str, coordinator: str, start_within: float) -> Grant | Refusal:
        """Commit a lease; the hold lapses unless started within `start_within` seconds."""
        self.expire(now)
        hold = self._holds.get((coordinator, job))
        if hold is None:
            return self._missing(job, coordinator, Refusal(
                f"no reservation for job {job} (its lease lapsed or was released)"))
        was = hold.state
        if (refusal := self._move(hold, "commit")) is not None:
            return refusal
        if was == LEASED:
            hold.deadline = now + start_within
        return Grant(job, hold.gpus)

    def start(self, job: str, coordinator: str, ranks: int) -> Grant | Refusal:
        hold = self._holds.get((coordinator, job))
        if hold is None:
            return self._missing(job, coordinator, Refusal(
                f"job {job} holds no reservation on this host", "no_reservation"))
        if ranks > hold.ranks:
            return Refusal(f"job {job} reserved {hold.ranks} rank(s) here, {ranks} asked", "ranks")
        if (refusal := self._move(hold, "start")) is not None:
            return refusal
        return Grant(job, hold.gpus)

    def release(self, job: str, coordinator: str) -> bool | Cancel | Refusal:
        """True when freed, False when there was nothing to free, Cancel when running."""
        hold = self._holds.get((coordinator, job))
        if hold is None:
            return self._missing(job, coordinator, False)
        was = hold.state
        if (refusal := self._move(hold, "release")) is not None:
            return refusal
        return Cancel(job) if was == RUNNING else True

    def finish(self, job: str, coordinator: str) -> bool:
        """The job's ranks have exited (the driver's own report, never a peer's)."""
        hold = self._holds.get((coordinator, job))
        return hold is not None and self._move(hold, "finish") is None

    def check_holder(self, job: str, coordinator: str) -> Refusal | None:
        """A Refusal when another coordinator holds `job` and `coordinator` does not."""
        return self._missing(job, coordinator, None)

    def expire(self, now: float) -> list[Key]:
        """Drop leases and start deadlines that have passed; running holds never lapse."""
        lapsed = [k for k, h in self._holds.items() if h.deadline is not None and h.deadline <= now]
        for key in lapsed:
            del self._holds[key]
        return lapsed

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self._holds.values() if h.deadline is not None), default=None)

    # --- moves ----------------------------------------------------------------------------

    def _missing(self, job: str, coordinator: str, otherwise: Any) -> Any:
        """What a move of a hold `coordinator` does not have answers: a refusal when only
        another coordinator holds that id (a member replaying an id it learned), else
        `otherwise`."""
        if any(j == job and c != coordinator for c, j in self._holds):
            return _foreign(job)
        return otherwise

    def _check(self, hold: _Hold, move: str) -> Refusal | None:
        if (move, hold.state) not in _MOVES:
            why, code = _WHY.get((move, hold.state), (f"it is {hold.state}", "state"))
            return Refusal(f"cannot {move} job {hold.job}: {why}", code)
        return None

    def _move(self, hold: _Hold, move: str) -> Refusal | None:
        if (refusal := self._check(hold, move)) is not None:
            return refusal
        after = _MOVES[(move, hold.state)]
        if after is FREED:
            del self._holds[(hold.coordinator, hold.job)]
        else:
            hold.state = after
            if after == RUNNING:
                hold.deadline = None
        return None


def _foreign(job: str) -> Refusal:
    return Refusal(f"job {job} is held for another coordinator", "not_holder")
