"""What the gossip driver refuses and carries: counted, and logged once an hour.

Every refused input (a bad signature, a malformed sync, a stream over its peer's limit, a
record over its publisher's rate) is counted under its reason in
``swarmd_gossip_rejected_total{reason}`` and in ``rejected`` (for `swarmctl status`, which
needs no metrics port), and logged once per (reason, peer) within the hour: a flood costs
one line an hour, not one per message. An unexpected exception in a loop that must go on
(a disk error, a bug) is counted the same way and logged with its stack once an hour per
(where, error type). ``traffic`` counts the swarm topic's messages and bytes each way and
the messages pubsub dropped for a slow peer.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import structlog

from .limits import Recent

log = structlog.get_logger("swarmd.gossip")


class Rejects:
    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics
        self.traffic: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        self._logged = Recent(size=10_000, window=3600.0)  # keys logged within the hour

    def reject(self, reason: str, peer: str, detail: str) -> None:
        self.count(reason)
        if self.first((reason, peer)):
            log.warning("rejected input", reason=reason, peer=peer, detail=detail)

    def count(self, reason: str) -> None:
        """Counted, not logged: what is normal in small numbers (a record overtaken in flight)."""
        self.rejected[reason] += 1
        self.metrics.gossip_rejected.labels(reason).inc()

    def internal(self, reason: str, peer: str, where: str, exc: Exception) -> None:
        """An unexpected exception in a loop that must go on."""
        self.count(reason)
        if self.first((reason, where, exc.__class__.__name__)):
            log.exception("unexpected error; carrying on", where=where, peer=peer, exc_info=exc)

    def first(self, key: tuple) -> bool:
        """Whether ``key`` was not logged within the hour (and is now)."""
        return self._logged.first(key, time.monotonic())

    def carried(self, direction: str, size: int) -> None:
        self.traffic[f"messages_{direction}"] += 1
        self.traffic[f"bytes_{direction}"] += size
        self.metrics.gossip_messages.labels(direction).inc()
        self.metrics.gossip_bytes.labels(direction).inc(size)

    def dropped(self, peer: Any) -> None:
        self.traffic["dropped"] += 1
        self.metrics.gossip_dropped.inc()
