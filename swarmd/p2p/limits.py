"""Bounded bookkeeping every subsystem's protocol uses: per-key token buckets, a
time-windowed "seen lately" set, and concurrent streams per peer. Pure: every timed call is
given ``now``; memory is capped, so a flood of distinct keys (peer ids are free) costs at
most ``size`` entries (streams: one entry per peer with a stream open).
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterator


class TokenBuckets:
    """One token bucket per key: ``rate`` tokens a second, at most ``burst`` held.

    Records: an honest member publishes on a change and on its refresh (seconds apart); a
    burst of 20 covers a restart's or a partition heal's flurry, 4/s anything steady. Past
    ``size`` keys the least recently used bucket is dropped (it was full, or nearly: a
    dropped bucket comes back full, which only ever lets a key through).
    """

    def __init__(self, rate: float, burst: float, size: int = 10_000) -> None:
        self.rate, self.burst, self.size = rate, burst, size
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def allow(self, key: Hashable, now: float) -> bool:
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > self.size:
            self._buckets.popitem(last=False)
        return ok

    def __len__(self) -> int:
        return len(self._buckets)


class Recent:
    """Keys seen within the last ``window`` seconds, at most ``size`` of them (the oldest go
    first). ``first(key, now)`` is True when ``key`` was not seen within the window, and
    notes it: a rejection is logged once an hour per (reason, peer), and a flood of distinct
    keys can neither grow memory nor silence the log for good."""

    def __init__(self, size: int = 10_000, window: float = 3600.0) -> None:
        self.size, self.window = size, window
        self._seen: OrderedDict[Hashable, float] = OrderedDict()  # oldest first

    def first(self, key: Hashable, now: float) -> bool:
        while self._seen:
            oldest, at = next(iter(self._seen.items()))
            if now - at < self.window:
                break
            del self._seen[oldest]
        if key in self._seen:
            return False
        self._seen[key] = now
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return True

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seen

    def __len__(self) -> int:
        return len(self._seen)


class Streams:
    """Concurrent inbound streams, per peer and (optionally) in all: the one per-peer stream
    limit (gossip's gate for every protocol it guards, the job protocol's own two). A count
    never goes below zero; a peer with none open holds no entry."""

    def __init__(self, per_peer: int, total: int | None = None, what: str = "streams") -> None:
        self.per_peer = per_peer
        self.total = total
        self.what = what  # in the refusal: "8 job streams from this peer are already open"
        self.open: Counter[str] = Counter()

    def acquire(self, peer: str) -> str | None:
        """None when the stream may go on (it is counted), else why not."""
        if self.open[peer] >= self.per_peer:
            return f"{self.per_peer} {self.what} from this peer are already open"
        if self.total is not None and sum(self.open.values()) >= self.total:
            return f"this host already serves {self.total} {self.what}"
        self.open[peer] += 1
        return None

    def release(self, peer: str) -> None:
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]

    @contextlib.contextmanager
    def aside(self, peer: str) -> Iterator[None]:
        """A stream bounded elsewhere (a forward) stops counting here while it lasts."""
        self.release(peer)
        try:
            yield
        finally:
            self.open[peer] += 1
