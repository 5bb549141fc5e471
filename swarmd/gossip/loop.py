"""The membership core's clock and actions: where the driver does what the core decided.

One task sleeps until the core's next deadline, or until an input from another task wakes
it, hands the core the time and performs its actions:

- ``PublishRecord``: our record is built (records.py) and goes to the publish channel;
  ``PublishRumor``: a signed rumor does too. One writer task puts the channel's blobs on
  the swarm topic in order.
- ``Probe`` and ``ProbeVia`` become tasks (probes.py); ``Sync`` asks sync.py for a
  push-pull with that peer (once more right after one in progress).
- ``Changed`` wakes the view's readers and logs the change; a member gone dead or left, or
  dropped, has our connections to it closed (peers.py).

Inputs fed to the core from other tasks end with ``input()``: perform at once, then let
the timer task re-arm. An exception here (a disk error, a bug) is counted (``internal``)
and the loop goes on after a short pause: never a busy loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import trio
from libp2p.peer.id import ID

from .membership import Changed, Probe, ProbeVia, PublishRecord, PublishRumor, State, Sync
from .state import Shared
from .wire import make_rumor

log = structlog.get_logger("swarmd.gossip")

INTERNAL_BACKOFF = 0.1  # after an unexpected error in the action loop: never a busy loop


class Loop:
    """The core's actions, each performed through what service.py wires in: ``make_record``
    (records.py), ``probe`` and ``probe_via`` (probes.py), ``sync`` (sync.py), ``hang_up``
    (peers.py), ``set_members`` (the members gauge)."""

    def __init__(self, shared: Shared, *, make_record: Callable[[int], bytes | None],
                 probe: Callable[[int, str, float], Awaitable[None]],
                 probe_via: Callable[[int, str, str, float], Awaitable[None]],
                 sync: Callable[[str], None], hang_up: Callable[[ID], Awaitable[None]],
                 set_members: Callable[[dict[str, int]], None]) -> None:
        self.s = shared
        self._make_record, self._probe, self._probe_via = make_record, probe, probe_via
        self._sync, self._hang_up, self._set_members = sync, hang_up, set_members
        self._wake = trio.Event()
        self.publish_send, self.publish_recv = trio.open_memory_channel[bytes](math.inf)
        self._publishing = False  # a publish is between the channel and the peers' queues

    async def timers(self) -> None:
        while True:
            with trio.move_on_at(self.s.core.next_deadline()):  # type: ignore[union-attr]
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                self.s.core.handle_timeout(trio.current_time())  # type: ignore[union-attr]
                self.perform()
            except Exception as exc:  # a disk error, a bug: the swarm task must go on
                self.s.rejects.internal("internal", self.s.me, "timers", exc)
                await trio.sleep(INTERNAL_BACKOFF)

    def wake(self) -> None:
        self._wake.set()

    def input(self) -> None:
        """After feeding the core from outside the timer task: act, and let the timers re-arm."""
        self.perform()
        self._wake.set()

    def perform(self) -> None:
        s = self.s
        assert s.nursery is not None and s.core is not None
        for action in s.core.take_actions():
            match action:
                case PublishRecord(seq):
                    if (blob := self._make_record(seq)) is not None:
                        self.publish_send.send_nowait(blob)
                case PublishRumor(kind, about, inc):
                    swarm = s.swarm
                    assert swarm is not None  # the core exists only in a swarm
                    self.publish_send.send_nowait(make_rumor(
                        s.sign, kind=kind, swarm=swarm.swarm, sender=s.me, about=about,
                        incarnation=inc, issued=time.time(), cert=swarm.cert))
                case Probe(pid, peer, timeout):
                    s.nursery.start_soon(self._probe, pid, peer, timeout)
                case ProbeVia(pid, via, target, timeout):
                    s.nursery.start_soon(self._probe_via, pid, via, target, timeout)
                case Sync(peer):
                    self._sync(peer)
                case Changed(peer, old, new, reason):
                    s.changed()
                    log.info("member " + (new.value if new else "removed"), member=peer,
                             was=old.value if old else None, reason=reason)
                    gone = new in (State.DEAD, State.LEFT) or (new is None and reason != "forgotten")
                    if gone:
                        s.nursery.start_soon(self._hang_up, ID.from_base58(peer))
        self._set_members(s.core.counts())

    async def publisher(self, pubsub: Any) -> None:
        async for blob in self.publish_recv:
            self._publishing = True
            try:
                await pubsub.publish(self.s.topic, blob)
                self.s.traffic.carried("out", len(blob))
            except Exception as exc:
                log.warning("publish failed", error=f"{exc.__class__.__name__}: {exc}")
            finally:
                self._publishing = False

    async def flush(self, pubsub: Any, limit: float) -> None:
        """Wait (at most ``limit`` s) until what was published is handed to the network."""
        with trio.move_on_after(limit):
            while self._publishing or self.publish_recv.statistics().current_buffer_used or any(
                    len(q) for q in pubsub.peer_queues.values()):
                await trio.sleep(0.01)
            await trio.sleep(0.05)  # the writer task has popped the last RPC; let it write
