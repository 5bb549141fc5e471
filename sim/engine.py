"""The simulator's clock: one event heap, simulated seconds, no threads, no wall clock.

Rules:
- An event is a plain tuple ``(time, seq, fn, arg)``: ``fn(arg)`` runs when the clock
  reaches ``time``. ``seq`` (a counter) breaks ties, so events at the same time run in the
  order they were scheduled: the same inputs give the same order, in every process.
- Time never goes back: an event scheduled in the past runs at ``now``.
- Nodes' own deadlines (a core's ``next_deadline()``) go into the same heap; the caller
  keeps the time it armed for each node and skips an entry that no longer matches it (a
  lazy heap: re-arming pushes a new entry instead of searching for the old one).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class Engine:
    __slots__ = ("now", "events", "_heap", "_seq")

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.events = 0  # events run so far (for the summary)
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at simulated time ``t`` (``now`` if ``t`` is in the past)."""
        self._seq += 1
        heapq.heappush(self._heap, (t if t > self.now else self.now, self._seq, fn, arg))

    def after(self, delay: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self.at(self.now + delay, fn, arg)

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def run_until(self, t: float) -> None:
        """Run every event due at or before ``t``; the clock ends at ``t``."""
        heap = self._heap
        pop = heapq.heappop
        n = 0
        try:
            while heap and heap[0][0] <= t:
                when, _, fn, arg = pop(heap)
                self.now = when
                n += 1
                fn(arg)
        finally:
            self.events += n
        if t > self.now:
            self.now = t

    def __len__(self) -> int:
        return len(self._heap)
