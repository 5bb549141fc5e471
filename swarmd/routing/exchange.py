"""Coordinates fresher than records: a member's current coordinate, asked for after a probe.

Serf's ping acks carry the coordinate, so each RTT sample meets the peer's coordinate of that
moment. Our probes are libp2p pings, and records refresh slowly in a large swarm (every 100 s
at 1,000 members), which left Vivaldi at 19 % median error after 120 s instead of 5 % (the
simulator, sim/coords.py). So after a probe measured an RTT to a member whose record's
coordinate is older than ``FRESH``, routing asks it for its current one on
``/swarmd/coord/1.0.0`` (``{cert}`` -> ``{coord}``) and updates with that and the RTT just
measured; at most once per member per ``FRESH``. With FRESH = 10 s nodes' estimates reach
8.4 % median error at 120 s on 1,000 nodes (30 s: 12 %); the cost is about one small
request per probe in a large swarm (records there are nearly always older than 10 s). Members only, both ways; the answer is
hostile like any coordinate (``Coordinate.from_wire`` checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ..gossip.streams import PeerError, close_quietly, read_frame, request, write_frame
from ..rpc.framing import FrameTooLarge
from .coordinates import Coordinate

if TYPE_CHECKING:
    from .service import Routing

PROTOCOL = "/swarmd/coord/1.0.0"
FRESH = 10.0  # seconds: a record's coordinate older than this is asked for again after a probe
TIMEOUT = 2.0


class Exchange:
    def __init__(self, routing: Routing) -> None:
        self.r = routing
        self.asked: dict[str, float] = {}  # peer -> when we last asked it (monotonic)
        self.fetched = 0
        self.failed = 0

    def due(self, peer: str, now: float) -> bool:
        last = self.asked.get(peer)
        return last is None or now - last >= FRESH

    async def fetch(self, peer: str, rtt: float) -> None:
        """Ask ``peer`` for its coordinate and update ours with it and ``rtt`` (seconds)."""
        g = self.r.g
        self.asked[peer] = trio.current_time()
        reply = None
        with trio.move_on_after(TIMEOUT):
            try:
                reply = await request(g.host, ID.from_base58(peer), PROTOCOL, {"cert": g.swarm.cert.blob})
            except PeerError:
                pass
        try:
            coord = Coordinate.from_wire(reply.get("coord")) if isinstance(reply, dict) else None
        except ValueError as exc:
            g.reject("malformed", peer, f"coordinate answer: {exc}")
            coord = None
        if coord is None:
            self.failed += 1
            return
        self.fetched += 1
        if peer in g.view():  # one that left meanwhile was forgotten: no latency filter may come back for it
            self.r.update_coordinate(peer, coord, rtt)

    async def handle(self, stream: INetStream) -> None:
        g = self.r.g
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(10):
                req = await read_frame(stream, 4096)
                if await g.check_member(req, peer, stream):
                    await write_frame(stream, {"coord": self.r.client.coordinate.to_wire()})
        except FrameTooLarge as exc:
            g.reject("too_large", str(peer), f"coordinate request: {exc}")
        except (PeerError, trio.TooSlowError) as exc:
            g.reject("malformed", str(peer), f"coordinate request: {exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)

    def forget(self, peer: str) -> None:
        self.asked.pop(peer, None)

    def status(self) -> dict[str, Any]:
        return {"fetched": self.fetched, "failed": self.failed}
