"""A host's job slots and GPUs: who holds what, and until when (sans-IO).

Rules:
- A reservation takes one job slot and the GPUs asked for, under a lease that ends at a
  deadline. Commit turns it into a hold with no deadline (the job runs); release frees it.
- A lease not committed by its deadline lapses (`expire`), so a coordinator that dies
  between reserve and commit leaves nothing behind.
- Work beyond the free slots or GPUs is refused with the reason; reserving twice for the
  same job returns the same grant (a coordinator retrying a lost reply is harmless).
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


@dataclass(slots=True)
class _Hold:
    job: str
    coordinator: str
    gpus: tuple[int, ...]
    deadline: float | None  # None once committed


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

    def gpus_of(self, job: str) -> tuple[int, ...]:
        hold = self._holds.get(job)
        return hold.gpus if hold else ()

    def reserve(self, now: float, job: str, coordinator: str, gpus: int, lease: float) -> Grant | Refusal:
        self.expire(now)
        if (held := self._holds.get(job)) is not None:
            if held.coordinator != coordinator:
                return Refusal(f"job {job} is already held for another coordinator")
            if held.deadline is not None:
                held.deadline = now + lease
            return Grant(job, held.gpus)
        if self.slots_free < 1:
            return Refusal(f"no free job slot (all {self.slots} in use)")
        free = self.gpus_free
        if gpus > len(free):
            return Refusal(f"{len(free)} free GPU(s), {gpus} asked")
        hold = _Hold(job=job, coordinator=coordinator, gpus=free[:gpus], deadline=now + lease)
        self._holds[job] = hold
        return Grant(job, hold.gpus)

    def commit(self, now: float, job: str, coordinator: str) -> Grant | Refusal:
        self.expire(now)
        hold = self._holds.get(job)
        if hold is None:
            return Refusal(f"no reservation for job {job} (its lease lapsed or was released)")
        if hold.coordinator != coordinator:
            return Refusal(f"job {job} is held for another coordinator")
        hold.deadline = None
        return Grant(job, hold.gpus)

    def release(self, job: str) -> bool:
        return self._holds.pop(job, None) is not None

    def expire(self, now: float) -> list[str]:
        lapsed = [j for j, h in self._holds.items() if h.deadline is not None and h.deadline <= now]
        for job in lapsed:
            del self._holds[job]
        return lapsed

    def next_deadline(self) -> float | None:
        return min((h.deadline for h in self._holds.values() if h.deadline is not None), default=None)
