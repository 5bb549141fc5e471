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

Legs. The same request may carry ``legs``, a list of at most ``MAX_LEGS`` peer ids (strings
of 1 to ``MAX_ID_CHARS`` characters): the answer then adds ``legs: {id: ms}``, our recent RTT
to each of them that is a member offering to relay (its record says so, alive or suspect)
and that we measured (routing's own samples; nothing is measured on demand, so a request
cannot make us send anything but its answer). Only relays: they are all path choice asks
about (paths.AskLegs: relays their records do not carry, for ``Paths.legs_answered``, which
takes the answer only whole and only as asked; a dropped answer is counted as malformed
input), and our RTTs to other members are not anyone's to map (records publish only the
16 nearest). A member may ask for legs ``LEGS_BURST`` times at once, then once per
``1 / LEGS_RATE`` seconds: path choice asks one peer at most once per paths.ASK_INTERVAL_S
(300 s; a pair on a relay is asked first when due, not more often), so an honest asker is
never refused, and mapping our RTTs to 1,000 relays, 8 a request, takes about 20 minutes.
A refused ``legs`` (malformed: ``malformed``; too often: ``legs_rate``, like gossip's
``record_rate``) is counted (routing's refusals, p2p/rejects.py) and answered ``{coord,
error, reason}``: the coordinate is a member's to ask for at any time, so it is served
whatever becomes of the legs (an asker reads a reply without ``legs`` as legs unanswered,
``legs_failed``, and path choice asks that peer again after ASK_INTERVAL_S).
"""

from __future__ import annotations

from typing import Any, Protocol

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ..p2p.limits import TokenBuckets
from ..p2p.streams import PeerError, close_quietly, read_frame, request, write_frame
from ..rpc.framing import FrameTooLarge
from ..vivaldi import Coordinate

PROTOCOL = "/swarmd/coord/1.0.0"
FRESH = 10.0  # seconds: a record's coordinate older than this is asked for again after a probe
TIMEOUT = 2.0
MAX_LEGS = 8  # ids one request may ask legs for: paths.ASK_LEGS (not imported: keeps the wire's bound here)
MAX_ID_CHARS = 64  # a peer id as text: 52 characters for our Ed25519 keys; longer names no member
# Legs requests one member may make: path choice asks a peer at most once per paths.ASK_INTERVAL_S
# (300 s), so 4 at once (a restart's or a view flap's re-asking) and one per 10 s after that are 30x
# what an honest asker needs, and cost a prober 8 ids per 10 s.
LEGS_BURST = 4.0
LEGS_RATE = 0.1  # a second
MAX_ASKERS = 4096  # members whose buckets are kept (least recently used dropped: it comes back full)


class ExchangeHub(Protocol):
    """What the coordinate and legs exchange reads of the routing driver (service.Routing is one)."""

    g: Any  # the gossip driver: view, swarm
    transport: Any  # p2p.transport.Transport: the exchange's streams
    client: Any  # vivaldi.Client: our coordinate
    paths: Any  # paths.Paths: the legs asked and answered

    def reject(self, reason: str, peer: str, detail: str) -> None: ...  # routing's refusals, counted and logged

    def update_coordinate(self, peer: str, coord: Coordinate, rtt: float) -> None: ...

    def legs_for(self, peers: list[str]) -> dict[str, float]: ...


class Exchange:
    def __init__(self, routing: ExchangeHub) -> None:
        self.r = routing
        self.asked: dict[str, float] = {}  # peer -> when we last asked it (monotonic)
        self.fetched = 0
        self.failed = 0
        self.legs_asked = 0  # requests for legs sent
        self.legs_failed = 0  # of those, no answer with legs (none, an error, a timeout, an older peer)
        self.legs_served = 0  # requests for legs answered
        self.legs_refused = 0  # requests for legs refused (malformed, legs_rate)
        self._legs_limit = TokenBuckets(LEGS_RATE, LEGS_BURST, size=MAX_ASKERS)

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
                reply = await request(self.r.transport.host, ID.from_base58(peer), PROTOCOL,
                                      {"cert": g.swarm.cert.blob})
            except PeerError:
                pass
        try:
            coord = Coordinate.from_wire(reply.get("coord")) if isinstance(reply, dict) else None
        except ValueError as exc:
            self.r.reject("malformed", peer, f"coordinate answer: {exc}")
            coord = None
        if coord is None:
            self.failed += 1
            return
        self.fetched += 1
        if peer in g.view():  # one that left meanwhile was forgotten: no latency filter may come back for it
            self.r.update_coordinate(peer, coord, rtt)

    async def ask_legs(self, peer: str, relays: tuple[str, ...]) -> None:
        """Ask ``peer`` for its RTTs to ``relays`` (paths.AskLegs); the answer goes to path choice."""
        g = self.r.g
        self.legs_asked += 1
        reply = None
        with trio.move_on_after(TIMEOUT):
            try:
                reply = await request(self.r.transport.host, ID.from_base58(peer), PROTOCOL,
                                      {"cert": g.swarm.cert.blob, "legs": list(relays)})
            except PeerError:
                pass
        if not isinstance(reply, dict) or "legs" not in reply:
            self.legs_failed += 1
            return
        if peer not in g.view():
            return
        why = self.r.paths.legs_answered(trio.current_time(), peer, reply["legs"])
        if why is not None:
            self.r.reject("malformed", peer, f"legs answer: {why}")

    async def handle(self, stream: INetStream) -> None:
        g = self.r.g
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(10):
                req = await read_frame(stream, 4096)
                if await g.check_member(req, peer, stream):
                    answer: dict[str, Any] = {"coord": self.r.client.coordinate.to_wire()}
                    if "legs" in req:
                        answer.update(self._legs(str(peer), req["legs"]))
                    await write_frame(stream, answer)
        except FrameTooLarge as exc:
            self.r.reject("too_large", str(peer), f"coordinate request: {exc}")
        except (PeerError, trio.TooSlowError) as exc:
            self.r.reject("malformed", str(peer), f"coordinate request: {exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)

    def _legs(self, peer: str, legs: Any) -> dict[str, Any]:
        """The legs part of the answer to ``peer``: ``{legs}``, or ``{error, reason}`` (counted)."""
        why, reason = _legs_refused(legs), "malformed"
        if why is None and not self._legs_limit.allow(peer, trio.current_time()):
            why = f"legs: asked too often (at most {LEGS_BURST:g} at once, then one per {1 / LEGS_RATE:g} s)"
            reason = "legs_rate"
        if why is not None:
            self.legs_refused += 1
            self.r.reject(reason, peer, f"coordinate request: {why}")
            return {"error": why, "reason": reason}
        self.legs_served += 1
        return {"legs": self.r.legs_for(legs)}

    def forget(self, peer: str) -> None:
        self.asked.pop(peer, None)

    def status(self) -> dict[str, Any]:
        return {"fetched": self.fetched, "failed": self.failed}


def _legs_refused(legs: Any) -> str | None:
    """Why a request's ``legs`` is refused, or None."""
    if not isinstance(legs, list) or len(legs) > MAX_LEGS:
        return f"legs: expected a list of at most {MAX_LEGS} peer ids"
    if not all(isinstance(p, str) and 0 < len(p) <= MAX_ID_CHARS for p in legs):
        return f"legs: each a peer id of 1-{MAX_ID_CHARS} characters"
    return None
