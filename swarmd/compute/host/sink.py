"""Where a running job's events go on a host (trio): its coordinator's stream, and, once that
coordinator is gone, a successor's (issue 26).

A host's ranks outlive their coordinator only when someone can take the job over: a job
whose charter names other replicas (succession.py). For such a job, the stream breaking, a
coordinator taking no event for `EMIT_TIMEOUT`, or membership declaring it gone makes the
sink *orphaned*, not the ranks stopped: the event in hand waits for `attach` (the job
protocol's, fenced to the successor's epoch there) to give it a new stream, at most
`patience` seconds (longer than a hand-over takes), and is then sent there; every event
after it follows. A job without a successor (``patience`` None) ends as before: the ranks
stop at once (`CoordinatorGone`).

Events are never reordered or lost by a hand-over: the successor first gets the host's log
of the attempt (`replay`, output.Replay), then the held event unless the replay already
covers it (output the gone coordinator may or may not have read), then every later one. An
attach while the old stream still works wins: the successor's epoch is higher, so the old
one is cut off.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio

Emit = Callable[[dict[str, Any]], Awaitable[None]]

EMIT_TIMEOUT = 60.0  # seconds a coordinator may take to accept one event before it counts as gone


class CoordinatorGone(Exception):
    """The coordinator's stream broke or stopped taking events, and no successor came."""


class Sink:
    def __init__(self, emit: Emit, *, patience: float | None = None, emit_timeout: float = EMIT_TIMEOUT,
                 holder: str = "") -> None:
        self._emit = emit
        self.holder = holder  # the peer whose stream takes the events (the origin, then each successor)
        self.patience = patience  # seconds to wait for a successor; None: the job has none
        self.emit_timeout = emit_timeout
        self.orphaned: str | None = None  # why, while no coordinator takes the events
        self.handovers = 0
        self._attached = trio.Event()
        self._replay: Callable[[], dict[str, Any] | None] | None = None  # a successor's catch-up, sent first
        self._stale: Callable[[dict[str, Any]], bool] = lambda event: False  # held events the catch-up covers
        self._sending: trio.CancelScope | None = None
        self._lock = trio.Lock()  # one event at a time, in order

    async def send(self, event: dict[str, Any]) -> None:
        """Deliver ``event`` to the coordinator of the moment; CoordinatorGone when there is none."""
        made = self.handovers  # an event made before an attach may be one the replay covers
        async with self._lock:
            while True:
                if self.orphaned is not None:
                    await self._wait_for_successor()
                emit = self._emit
                if self._replay is not None:  # a successor attached: what it has not seen first
                    if (caught_up := await self._catch_up(emit)) is not None:
                        if emit is self._emit:
                            self.orphan(caught_up)
                        continue
                if made != self.handovers and self._stale(event):
                    return
                why = await self._try(emit, event)
                if why is None:
                    return
                if emit is self._emit:  # not replaced meanwhile (that attach's stream gets it next)
                    self.orphan(why)

    async def _catch_up(self, emit: Emit) -> str | None:
        """The replay's events to the attached stream; why it broke, or None once all are sent."""
        while self._replay is not None:
            event = self._replay()
            if event is None:
                self._replay = None
                return None
            if (why := await self._try(emit, event)) is not None:
                return why
        return None

    async def _try(self, emit: Emit, event: dict[str, Any]) -> str | None:
        with trio.CancelScope() as self._sending:
            try:
                with trio.move_on_after(self.emit_timeout) as slow:
                    await emit(event)
            except CoordinatorGone as exc:
                return str(exc) or "the coordinator's stream broke"
            finally:
                self._sending = None
            if slow.cancelled_caught:
                return f"the coordinator took no event for {self.emit_timeout:g} s"
            return None
        return self.orphaned or "cut off"  # orphan() cancelled the send in flight

    def orphan(self, why: str) -> None:
        """The coordinator is gone (its stream, or membership said so): the send in flight is
        cut short and the events wait for a successor."""
        if self.orphaned is None:
            self.orphaned = why
            self._attached = trio.Event()
        if self._sending is not None:
            self._sending.cancel()

    def attach(self, emit: Emit, holder: str = "", *, replay: Callable[[], dict[str, Any] | None] | None = None,
               stale: Callable[[dict[str, Any]], bool] = lambda event: False) -> None:
        """A successor's stream (its epoch checked by the caller): every event from now goes
        there. `replay`: events it gets before any other (the host's log so far, once); `stale`:
        which held event that replay already covers (is not sent again)."""
        self._emit = emit
        self.holder = holder
        self._replay, self._stale = replay, stale
        self.handovers += 1
        if self._sending is not None:  # the old coordinator's send: cut, and resent to the successor
            self._sending.cancel()
        self.orphaned = None
        self._attached.set()

    async def _wait_for_successor(self) -> None:
        why = self.orphaned
        if self.patience is None:
            raise CoordinatorGone(why)
        with trio.move_on_after(self.patience):
            await self._attached.wait()
        if self.orphaned is not None:
            raise CoordinatorGone(f"{why}; no successor took the job over within {self.patience:g} s")
