"""A host's job slots and GPUs: who holds what, and until when (sans-IO).

A hold belongs to (job, coordinator): the coordinator that reserved it is the only one
that can commit, start, cancel or release it. Its life, one row per move (`_MOVES`):

    (none) --reserve--> leased --commit--> committed --start--> running --finish--> (none)
                          |                    |                   |
                          +---release/lapse----+---release------>  +--release: the ranks are
                                                                      cancelled; freed at finish

Rules:
- A reservation takes one job slot, the GPUs and the number of ranks asked for, under a
  lease that ends at a deadline. Only a lease lapses (`expire`): a coordinator that dies
  between reserve and commit leaves nothing behind. A committed or running hold has no
  deadline, so no lease can lapse under running ranks.
- `start` needs a committed hold of the same coordinator and at most the ranks reserved;
  the hold is then running until the driver reports `finish` (the ranks have exited).
- `release` of a running hold does not free it (its ranks still use the slot and GPUs):
  it answers `Cancel` and the driver stops the ranks; the hold goes at `finish`.
- Work beyond the free slots or GPUs is refused with the reason; reserving twice for the
  same job by the same coordinator returns the same grant (a retried lost reply is
  harmless); any move by another coordinator is refused, naming neither its holder.
- GPUs are handed out lowest index first, so a host's choice is predictable.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    ("reserve", LEASED): LEASED,  # a retry: the lease renewed
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
    deadline: float | None  # only while leased


class Ledger:
    def __init__(self, slots: int, gpus: tuple[int, ...] = ()) -> None:
        if slots < 1:
            raise ValueError(f"a host needs at least one job slot, got {slots}")
        self.slots = slots
        self.gpus = tuple(sorted(gpus))
        self._holds: dict[str, _Hold] = {}

    @property
    def slots_free(self) -> int:
        return self.slots - len(self._holds)

    @property
    def gpus_free(self) -> tuple[int, ...]:
        taken = {g for h in self._holds.values() for g in h.gpus}
        return tuple(g for g in self.gpus if g not in taken)

    def holds(self, job: str) -> bool:
        return job in self._holds

    def held(self) -> list[str]:
        return list(self._holds)

    def state_of(self, job: str) -> str | None:
        hold = self._holds.get(job)
        return hold.state if hold else None

    def gpus_of(self, job: str) -> tuple[int, ...]:
        hold = self._holds.get(job)
        return hold.gpus if hold else ()

    def reserve(self, now: float, job: str, coordinator: str, gpus: int, ranks: int,
                lease: float) -> Grant | Refusal:
        self.expire(now)
        if (held := self._holds.get(job)) is not None:
            if (refusal := self._check(held, "reserve", coordinator)) is not None:
                return refusal
            if held.state == LEASED:
                held.deadline = now + lease
            return Grant(job, held.gpus)
        if ranks < 1:
            return Refusal("a reservation needs at least one rank")
        if self.slots_free < 1:
            return Refusal(f"no free job slot (all {self.slots} in use)")
        free = self.gpus_free
        if gpus > len(free):
            return Refusal(f"{len(free)} free GPU(s), {gpus} asked")
        hold = _Hold(job=job, coordinator=coordinator, gpus=free[:gpus], ranks=ranks, state=LEASED,
                     deadline=now + lease)
        self._holds[job] = hold
        return Grant(job, hold.gpus)

    def commit(self, now: float, job: str, coordinator: str) -> Grant | Refusal:
        self.expire(now)
        hold = self._holds.get(job)
        if hold is None:
            return Refusal(f"no reservation for job {job} (its lease lapsed or was released)")
        if (refusal := self._move(hold, "commit", coordinator)) is not None:
            return refusal
        return Grant(job, hold.gpus)

    def start(self, job: str, coordinator: str, ranks: int) -> Grant | Refusal:
        hold = self._holds.get(job)
        if hold is None:
            return Refusal(f"job {job} holds no reservation on this host", "no_reservation")
        if hold.coordinator == coordinator and ranks > hold.ranks:
            return Refusal(f"job {job} reserved {hold.ranks} rank(s) here, {ranks} asked", "ranks")
        if (refusal := self._move(hold, "start", coordinator)) is not None:
            return refusal
        return Grant(job, hold.gpus)

    def release(self, job: str, coordinator: str) -> bool | Cancel | Refusal:
        """True when freed, False when there was nothing to free, Cancel when running."""
        hold = self._holds.get(job)
        if hold is None:
            return False
        was = hold.state
        if (refusal := self._move(hold, "release", coordinator)) is not None:
            return refusal
        return Cancel(job) if was == RUNNING else True

    def finish(self, job: str) -> bool:
        """The job's ranks have exited (the driver's own report, never a peer's)."""
        hold = self._holds.get(job)
        return hold is not None and self._move(hold, "finish", hold.coordinator) is None

    def check_holder(self, job: str, coordinator: str) -> Refusal | None:
        """A Refusal unless `coordinator` holds `job` (or nobody does)."""
        hold = self._holds.get(job)
        return None if hold is None or hold.coordinator == coordinator else _foreign(job)

    def expire(self, now: float) -> list[str]:
        lapsed = [j for j, h in self._holds.items() if h.deadline is not None and h.deadline <= now]
        for job in lapsed:
            del self._holds[job]
        return lapsed

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self._holds.values() if h.deadline is not None), default=None)

    # --- moves ----------------------------------------------------------------------------

    def _check(self, hold: _Hold, move: str, coordinator: str) -> Refusal | None:
        if hold.coordinator != coordinator:
            return _foreign(hold.job)
        if (move, hold.state) not in _MOVES:
            why, code = _WHY.get((move, hold.state), (f"it is {hold.state}", "state"))
            return Refusal(f"cannot {move} job {hold.job}: {why}", code)
        return None

    def _move(self, hold: _Hold, move: str, coordinator: str) -> Refusal | None:
        if (refusal := self._check(hold, move, coordinator)) is not None:
            return refusal
        after = _MOVES[(move, hold.state)]
        if after is FREED:
            del self._holds[hold.job]
        else:
            hold.state = after
            if after != LEASED:
                hold.deadline = None
        return None


def _foreign(job: str) -> Refusal:
    return Refusal(f"job {job} is held for another coordinator", "not_holder")
