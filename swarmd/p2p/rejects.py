"""What this node refuses of its peers: one counter, labelled by subsystem, logged once an hour.

Every refused input (a bad signature, a malformed sync, a stream over its peer's limit, a
record over its publisher's rate, a job request from a non-submitter, a coordinate request
over its rate) is counted under its subsystem and reason in
``swarmd_rejected_total{subsystem, reason}``, and in ``Rejects.rejected`` (every
subsystem's, by reason: `swarmctl status` shows them, no metrics port needed), and logged
once per (reason, peer) within the hour, whichever subsystem refused: a flood costs one line
an hour, not one per message. An unexpected exception in a loop that must go on (a disk
error, a bug) is counted the same way and logged with its stack once an hour per (where,
error type).

node.py makes the one ``Rejects``; each subsystem is handed its own ``Refusals``
(``Rejects.of("gossip")``, ``of("jobs")``, ``of("routing")``), which counts under its label.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import structlog

from .limits import Recent

log = structlog.get_logger("swarmd.p2p")


class Rejects:
    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics
        self.rejected: collections.Counter[str] = collections.Counter()  # every subsystem's, by reason
        self.by_subsystem: dict[str, collections.Counter[str]] = {}
        self._logged = Recent(size=10_000, window=3600.0)  # keys logged within the hour

    def of(self, subsystem: str) -> Refusals:
        """What ``subsystem`` counts its refusals with (the same object for the same name)."""
        return Refusals(self, subsystem, self.by_subsystem.setdefault(subsystem, collections.Counter()))

    def first(self, key: tuple) -> bool:
        """Whether ``key`` was not logged within the hour (and is now)."""
        return self._logged.first(key, time.monotonic())


class Refusals:
    """One subsystem's side of ``Rejects``: ``rejected`` holds its own counts, by reason."""

    def __init__(self, rejects: Rejects, subsystem: str, rejected: collections.Counter[str]) -> None:
        self._rejects = rejects
        self.subsystem = subsystem
        self.rejected = rejected

    def reject(self, reason: str, peer: str, detail: str) -> None:
        self.count(reason)
        if self.first((reason, peer)):
            log.warning("rejected input", subsystem=self.subsystem, reason=reason, peer=peer, detail=detail)

    def count(self, reason: str) -> None:
        """Counted, not logged: what is normal in small numbers (a record overtaken in flight)."""
        self.rejected[reason] += 1
        self._rejects.rejected[reason] += 1
        self._rejects.metrics.rejected.labels(self.subsystem, reason).inc()

    def internal(self, reason: str, peer: str, where: str, exc: Exception) -> None:
        """An unexpected exception in a loop that must go on."""
        self.count(reason)
        if self.first((reason, where, exc.__class__.__name__)):
            log.exception("unexpected error; carrying on", subsystem=self.subsystem, where=where, peer=peer,
                          exc_info=exc)

    def first(self, key: tuple) -> bool:
        """Whether ``key`` was not logged within the hour (and is now), across subsystems."""
        return self._rejects.first(key)
