"""Gang reservation, the coordinator's side (sans-IO): hold every chosen host, or none.

One `Gang` is one attempt over one placement. The driver asks every host to reserve (a
lease with a deadline) and feeds each answer in; the gang then says what to do:
- every host granted: `Commit` to all of them;
- any host refused, failed or did not answer by the deadline: `Release` those that did
  grant, and report the hosts to leave out of the next placement.
The driver retries with a new placement a bounded number of times (`MAX_ATTEMPTS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_ATTEMPTS = 3
RESERVE_TIMEOUT = 5.0  # seconds every host has to answer a reservation
LEASE = 30.0  # seconds a reservation holds a host without a commit


@dataclass(frozen=True, slots=True)
class Commit:
    gpus: dict[str, tuple[int, ...]]  # peer -> GPUs it granted


@dataclass(frozen=True, slots=True)
class Release:
    peers: tuple[str, ...]  # hosts that granted and must give the reservation back
    refused: dict[str, str]  # peer -> why; leave these out of the next attempt


@dataclass(slots=True)
class Gang:
    peers: tuple[str, ...]
    deadline: float
    granted: dict[str, tuple[int, ...]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def grant(self, peer: str, gpus: tuple[int, ...]) -> None:
        if peer in self.peers and peer not in self.refused:
            self.granted[peer] = gpus

    def refuse(self, peer: str, reason: str) -> None:
        if peer in self.peers:
            self.granted.pop(peer, None)
            self.refused[peer] = reason

    def decide(self, now: float) -> Commit | Release | None:
        """None while answers are outstanding and the deadline has not passed."""
        if self.refused or (now >= self.deadline and len(self.granted) < len(self.peers)):
            late = {p: "no answer to the reservation in time" for p in self.peers
                    if p not in self.granted and p not in self.refused}
            return Release(peers=tuple(p for p in self.peers if p in self.granted),
                           refused={**self.refused, **late})
        if len(self.granted) == len(self.peers):
            return Commit(gpus={p: self.granted[p] for p in self.peers})
        return None
