"""This node's own record: what goes in it, and the check before it goes out.

The core decides when (``PublishRecord(seq)``: after a change, at most once per
publish_interval, and a refresh every refresh_interval); this module builds what: the
listen addresses, the resources (sampled every ``SAMPLE_INTERVAL``; a new sample is
advertised only when it differs significantly from the last one published), the labels,
the mesh's side (WireGuard key and address), the job slots, the lowest RTTs our probes
measured to alive members (others' placement and path choice read them), and routing's
fields (our network coordinate, whether we relay, the relays we chose: ``route_info``).

The record is checked as every member will check it before it is published. One that
would be refused is not published, and ``error`` says why (logged once per reason): our
certificate expired (the owner was unreachable for the whole renewal window), or anything
else the verifier refuses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
import trio

from ..p2p.signed import Invalid
from .capacity import Collector, Resources
from .membership import State
from .state import Shared
from .rtts import MAX_RTTS
from .wire import JobSlots, MeshInfo, Record, make_record

log = structlog.get_logger("swarmd.gossip")

SAMPLE_INTERVAL = 5.0  # capacity sampling; changes are advertised only when significant


class OwnRecord:
    """Wired by service.py: this node's ``addrs`` and ``labels``, the floors above's fields
    (``mesh_info``, ``job_slots``, ``route_info``, ``recent_rtts``, ``serve_info``: service.Above), and
    ``readvertise`` for a significant change of the resources."""

    def __init__(self, shared: Shared, collector: Collector, *, addrs: Callable[[], list[str]],
                 labels: Callable[[], dict[str, str]], mesh_info: Callable[[], MeshInfo | None],
                 job_slots: Callable[[], JobSlots | None], route_info: Callable[[], dict[str, Any]],
                 recent_rtts: Callable[[], dict[str, float] | None], readvertise: Callable[[], None],
                 serve_info: Callable[[], dict[str, Any]] = dict) -> None:
        self.s = shared
        self._addrs, self._labels, self._mesh_info, self._job_slots = addrs, labels, mesh_info, job_slots
        self._route_info, self._recent_rtts, self._readvertise = route_info, recent_rtts, readvertise
        self._serve_info = serve_info
        self.collector = collector
        self.resources: Resources = collector.sample()
        self.advertised: Resources = self.resources
        self.record: Record | None = None  # the newest one published, decoded
        self.error: str | None = None  # why our own record is not published, if it is not

    def make(self, seq: int) -> bytes | None:
        """Our record with ``seq``, signed; None (``error`` says why) when it would be refused."""
        s = self.s
        assert s.swarm is not None and s.core is not None and s.verifier is not None
        cert, now = s.swarm.cert, time.time()
        if cert.expires <= now:
            return self._none(f"this node's certificate expired at {round(cert.expires)}: not publishing "
                              f"records until it is renewed")
        wg = self._mesh_info()
        if wg is not None and cert.addr4 is not None and wg.addr4 != cert.addr4:
            # a renewal gave an older certificate an address: every member would refuse a record
            # with the mesh's old one. Published without the mesh side until the mesh moves to it
            # (woken here; it re-advertises once it has).
            wg = None
            s.changed()
        try:
            blob = make_record(s.sign, swarm=s.swarm.swarm, peer=s.me, seq=seq, issued=now,
                               ttl=s.core.record_ttl, addrs=self._addrs(), resources=self.resources,
                               labels=self._labels(), wg=wg, jobs=self._job_slots(), rtts=self.nearest_rtts(),
                               cert=cert, **self._route_info(), **self._serve_info())
            own = s.verifier.decode(blob, now)
        except (Invalid, ValueError) as exc:
            detail = f"{exc.reason}: {exc.detail}" if isinstance(exc, Invalid) else str(exc)
            return self._none(f"this node's own record would be refused ({detail}): not publishing it")
        self.advertised = self.resources
        self.record = own  # type: ignore[assignment]
        if self.error is not None:
            log.info("publishing records again", seq=seq)
        self.error = None
        return blob

    def _none(self, why: str) -> None:
        if why != self.error:
            log.error("own record not published", why=why)
        self.error = why
        return None

    def nearest_rtts(self) -> dict[str, float]:
        """This node's RTTs to its nearest alive members, in ms: routing's recent ones when it
        runs (they rise again when a path slows), else the lowest the probes ever measured."""
        view = self.s.view()
        recent = self._recent_rtts()
        if recent is not None:
            measured = sorted((ms, peer) for peer, ms in recent.items()
                              if (m := view.get(peer)) is not None and m.state is State.ALIVE)
            return {peer: round(ms, 2) for ms, peer in measured[:MAX_RTTS]}
        measured = sorted((m.rtt_min * 1000, m.peer) for m in view if m.rtt_min is not None and m.state is State.ALIVE)
        return {peer: round(ms, 2) for ms, peer in measured[:MAX_RTTS]}

    async def sample(self) -> None:
        """Sample the capacity forever; a significant change is re-advertised."""
        while True:
            await trio.sleep(SAMPLE_INTERVAL)
            self.resources = await trio.to_thread.run_sync(self.collector.sample)
            if self.resources.significant_change(self.advertised):
                self._readvertise()
