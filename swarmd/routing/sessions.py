"""This node's side of relayed paths: one session per peer whose path goes through a relay.

A session asks the relay (request.py, ``op: relay``) until the relay says the pair is
active (the other end asked too), then renews its lease every ``RENEW`` seconds. Meanwhile
it pings the relay every ``PING_INTERVAL`` over libp2p (the relay's leg of our path); after
``FAIL_AFTER`` missed pings in a row the session is *failing*: path choice sends every pair
through that relay back to direct at its next evaluation (and holds the relay down), without
waiting for the failure detector. Only an active, not failing session gives the mesh an
endpoint (the relay's IP and the pair's port); until then the pair stays direct.

Once active, the session also checks end to end that the relayed path carries the pair's
packets: an ICMP echo to the peer's overlay address every second (icmp.py); ``BROKEN_AFTER``
unanswered in a row (after ``GRACE`` seconds for the switch) make it *broken*. While the
pair is busy (a bulk transfer: the driver's reading of WireGuard's counters) and the peer's
packets keep arriving from the relay's endpoint (``Routing.carried``), a lost ping or echo is
not counted (``forgiven``): the relay evidently forwards the pair, and its queues drop our
pings like any packet. Only for ``FORGIVE_FOR`` seconds since the last answered one, though:
a relay passing the peer's packets but none of ours is then caught like any other (an idle
pair is never forgiven: its own echoes would make it look carried). A relay that
refuses, a pair whose other end never asks (``PENDING_LIMIT``), and a broken path are held
down for that pair only (``refused``): the relay may serve our other pairs well.

A relay's answer is hostile like any peer's: a refusal, a malformed answer, or a grant whose
port is not one a relay could have been given (below ``MIN_PORT``: config refuses such
``relay_ports``; or the relay's own WireGuard port, from its record, which would aim our
packets at its WireGuard, not at a relayed pair) holds the pair down for that relay, and is
counted in ``Sessions.rejected`` (``refused``, ``malformed``, ``bad_port``). The port is one
on the relay's host: our own WireGuard port says nothing about it (a member listening on
51821 takes the grant of 51821, the first of the default relay range, like any other).
Records do not carry a relay's port range, so a port inside it cannot be checked here.

Ending a session tells the relay (``op: release``): at once when it failed, ``LINGER``
seconds later when path choice merely moved the pair (the other end follows the chooser's
record a moment later and may still send through the relay meanwhile).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Protocol

import structlog
import trio
from libp2p.peer.id import ID

from ..p2p.streams import PeerError, request
from ..wg.endpoint import format_endpoint
from . import icmp
from . import request as rq

log = structlog.get_logger("swarmd.routing")

PING_INTERVAL = 1.0  # seconds between pings of a relay in use
PING_TIMEOUT = 1.0
FAIL_AFTER = 2  # missed pings in a row: the relay's leg is down (≈ 2-3 s after a crash)
ASK_INTERVAL = 1.0  # while the relay has not activated the pair
RENEW = 20.0  # seconds between renewals of an active lease (the relay's lease is 60 s)
REQUEST_TIMEOUT = 5.0
PENDING_LIMIT = 15.0  # seconds a relay may wait for the pair's other end before we give up on it
INTRODUCE_FOR = 4.0  # seconds a relay may take to hear our WireGuard after an echo (a handshake: one RTT)
GRACE = 3.0  # seconds after activation before overlay echoes count (the other end switches too)
BROKEN_AFTER = 3  # overlay echoes unanswered in a row: the relayed path does not carry our packets
ECHO_TIMEOUT = 1.0
LINGER = 10.0  # a moved (not failed) pair is released this much later: make before break
FORGIVE_FOR = 10.0  # seconds without an answered ping (echo) after which losses count whatever else arrives
MIN_PORT = 1024  # a granted port below it is refused: privileged ports are other services' (config.relay_ports)


@dataclass(slots=True)
class Session:
    peer: str
    relay: str
    state: str = "requesting"  # requesting | active | failing | refused | broken
    port: int | None = None
    via_ip: str | None = None
    misses: int = 0
    echo_misses: int = 0
    active_since: float | None = None
    path_rtt: float | None = None  # seconds: the last overlay echo through the relay
    granted: bool = False  # the relay's last answer said the pair is active (both ends asked)
    error: str | None = None
    since: float = 0.0
    cancel: trio.CancelScope | None = None
    forgiven: int = 0  # pings or echoes lost while the peer's packets kept arriving through the relay
    pinged_at: float | None = None  # when the relay last answered a ping
    echoed_at: float | None = None  # when the peer last answered an echo through the relay
    introduced_at: float | None = None  # when the relay first said it had not heard our WireGuard

    @property
    def endpoint(self) -> str | None:
        if self.state != "active" or self.port is None or self.via_ip is None:
            return None
        return format_endpoint(self.via_ip, self.port)


class SessionsHub(Protocol):
    """What our relayed paths read of the routing driver (service.Routing is one)."""

    g: Any  # the gossip driver: view, ping, sign, swarm
    transport: Any  # p2p.transport.Transport: the relay requests' streams

    async def contained(self, fn: Callable[..., Any], *args: Any) -> None: ...

    def paths_changed(self) -> None: ...

    def overlay_address(self, peer: str) -> str | None: ...

    def carried(self, peer: str) -> str | None: ...

    def rtt_observed(self, peer: str, rtt: float, *, probe: bool = True) -> None: ...


class Sessions:
    def __init__(self, routing: SessionsHub) -> None:
        self.r = routing
        self.by_peer: dict[str, Session] = {}
        self.nursery: trio.Nursery | None = None
        self.unchecked: str | None = None  # why relayed paths cannot be echoed here (no raw socket)
        self.rejected: dict[str, int] = {}  # relays' answers that granted nothing: refused, malformed, bad_port
        self.unproven = 0  # relays that did not know our endpoint yet when asked: introduced, asked again

    def use(self, peer: str, relay: str | None) -> None:
        """Path choice changed ``peer``'s path: end its session, start one through ``relay``."""
        old = self.by_peer.get(peer)
        if old is not None and old.relay == relay:
            return
        if old is not None:
            self._end(old)
        if relay is not None and self.nursery is not None:
            # the scope exists before the task starts: a session ended in the same tick is cancelled
            # on entry instead of leaving a task that asks and pings its relay forever
            session = Session(peer=peer, relay=relay, since=trio.current_time(), cancel=trio.CancelScope())
            self.by_peer[peer] = session
            self.nursery.start_soon(self.r.contained, self._run, session)
        self.r.paths_changed()

    def endpoints(self) -> dict[str, str]:
        """peer -> the relay endpoint WireGuard should send its packets to."""
        return {p: e for p, s in self.by_peer.items() if (e := s.endpoint) is not None}

    def failing(self) -> frozenset[str]:
        """Relays this node cannot reach now: path choice moves all their pairs (and holds them down)."""
        return frozenset(s.relay for s in self.by_peer.values() if s.state == "failing")

    def refused(self) -> frozenset[tuple[str, str]]:
        """(peer, relay) pairs the relay refused, never activated, or did not carry: held down
        for that pair only."""
        return frozenset((s.peer, s.relay) for s in self.by_peer.values() if s.state in ("refused", "broken"))

    def row(self, peer: str) -> dict[str, Any] | None:
        s = self.by_peer.get(peer)
        if s is None:
            return None
        return {"relay": s.relay, "state": s.state, "port": s.port, "via_ip": s.via_ip, "misses": s.misses,
                "echo_misses": s.echo_misses, "path_rtt_ms": None if s.path_rtt is None else round(s.path_rtt * 1000, 2),
                "forgiven": s.forgiven, "error": s.error, "for_s": round(trio.current_time() - s.since, 1)}

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await trio.sleep_forever()

    def _end(self, s: Session) -> None:
        del self.by_peer[s.peer]
        if s.cancel is not None:
            s.cancel.cancel()
        if self.nursery is not None and s.port is not None:
            self.nursery.start_soon(self.r.contained, self._release, s,
                                    0.0 if s.state in ("failing", "refused", "broken") else LINGER)

    async def _release(self, s: Session, after: float) -> None:
        await trio.sleep(after)
        current = self.by_peer.get(s.peer)
        if current is None or current.relay != s.relay:  # not asked again through the same relay meanwhile
            await self._ask(s, "release")

    async def _run(self, s: Session) -> None:
        assert s.cancel is not None
        with s.cancel:
            renew_at = 0.0
            while True:
                now = trio.current_time()
                if s.state == "requesting" and now - s.since > PENDING_LIMIT:
                    self._set(s, "refused", error="the pair's other end did not ask the relay")
                if s.state in ("requesting", "refused") or now >= renew_at:
                    reply = await self._ask(s, "relay")
                    if reply is not None:
                        renew_at = now + (RENEW if s.state == "active" else ASK_INTERVAL)
                async with trio.open_nursery() as checks:
                    checks.start_soon(self._ping, s)
                    if s.state == "active":
                        checks.start_soon(self._echo, s)
                await trio.sleep_until(now + PING_INTERVAL)

    async def _ask(self, s: Session, op: str) -> dict[str, Any] | None:
        r = self.r
        g = r.g
        if g.swarm is None:
            return None
        via_ip = r.relay_ip(s.relay)
        if via_ip is None:
            self._set(s, "refused", error="no IPv4 endpoint of the relay is known")
            return None
        blob = rq.make(g.sign, swarm=g.swarm.swarm, peer=g.me, relay=s.relay, other=s.peer, via_ip=via_ip,
                       op=op, issued=time.time())
        reply = None
        with trio.move_on_after(REQUEST_TIMEOUT):
            try:
                reply = await request(self.r.transport.host, ID.from_base58(s.relay), rq.PROTOCOL,
                                      {"cert": g.swarm.cert.blob, "req": blob})
            except PeerError as exc:
                s.error = str(exc)
        if op == "release" or self.by_peer.get(s.peer) is not s:
            return None
        if not isinstance(reply, dict):
            return None  # no answer: the pings decide whether the relay is gone
        port, active = reply.get("port"), reply.get("active")
        if reply.get("reason") == "pending_limit" and s.state == "requesting":
            return None  # our other pairs there are still pending: ask again (PENDING_LIMIT bounds it)
        if reply.get("reason") == "unproven" and s.state == "requesting" and s.relay not in self.by_peer and (
                s.introduced_at is None or trio.current_time() - s.introduced_at < INTRODUCE_FOR):
            # our WireGuard has not spoken to the relay lately (a young mesh: handshakes come with
            # traffic), so it cannot tell where to forward to. One echo over the overlay makes the
            # handshake, and an ask within INTRODUCE_FOR finds us proven. Not when we reach the
            # relay itself through another relay: our packets never arrive from our endpoint there
            s.error = str(reply.get("error"))[:200]
            self.unproven += 1
            if s.introduced_at is None:
                s.introduced_at = trio.current_time()
                if self.nursery is not None:
                    self.nursery.start_soon(self._introduce, s.relay)
            return None
        bad = self._bad_answer(s, reply, port)
        if bad is not None:
            kind, error = bad
            self.rejected[kind] = self.rejected.get(kind, 0) + 1
            s.granted = False
            self._set(s, "refused", error=error[:200])
            return None
        s.port, s.via_ip, s.granted = port, via_ip, active is True
        if active is True and s.state not in ("failing", "broken"):  # the relay's word cannot undo our echoes
            self._set(s, "active", error=None)
        elif active is not True and s.state == "active":  # the other end let go: direct until it asks again
            s.since = trio.current_time()
            self._set(s, "requesting")
        return reply

    def _bad_answer(self, s: Session, reply: dict[str, Any], port: Any) -> tuple[str, str] | None:
        """Why the relay's answer grants us nothing: (what it counts as, the session's error), or None."""
        if "error" in reply:
            return "refused", str(reply["error"])
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            return "malformed", "a malformed answer"
        if port < MIN_PORT:
            return "bad_port", f"the relay granted port {port}: relay ports are {MIN_PORT} and above"
        m = self.r.g.view().get(s.relay)
        if m is not None and m.record.wg is not None and port == m.record.wg.port:
            return "bad_port", f"the relay granted port {port}, its WireGuard listen port, not a relay port"
        return None

    async def _introduce(self, relay: str) -> None:
        """One overlay echo to ``relay``: our WireGuard's handshake with it proves our endpoint there."""
        address = self.r.overlay_address(relay)
        if address is None:
            return
        try:
            await icmp.echo(address, ECHO_TIMEOUT)
        except icmp.Unavailable:
            pass  # then only the mesh's own traffic and keepalives prove it, within PENDING_LIMIT or not

    async def _ping(self, s: Session) -> None:
        rtt = await self.r.g.ping(s.relay, PING_TIMEOUT)
        if self.by_peer.get(s.peer) is not s:
            return
        if rtt is not None:
            self.r.rtt_observed(s.relay, rtt, probe=False)
            s.misses, s.pinged_at = 0, trio.current_time()
            if s.state == "failing":  # active again only if the relay's last word was that the pair is
                if not s.granted:
                    s.since = trio.current_time()
                self._set(s, "active" if s.granted else "requesting")
        elif self._forgiven(s, s.pinged_at):  # the relay forwards the busy pair: lost to its queues
            s.forgiven += 1
        else:
            s.misses += 1
            if s.misses >= FAIL_AFTER and s.state != "failing":
                log.warning("relay unreachable: the path goes direct", peer=s.peer, relay=s.relay, misses=s.misses)
                self._set(s, "failing")

    async def _echo(self, s: Session) -> None:
        """One overlay echo to the peer, through the relay (the mesh sends it there)."""
        address = self.r.overlay_address(s.peer)
        if address is None or s.active_since is None or trio.current_time() - s.active_since < GRACE \
                or self.unchecked is not None:
            return
        try:
            rtt = await icmp.echo(address, ECHO_TIMEOUT)
        except icmp.Unavailable as exc:  # cannot check is not broken: every relayed path would go direct
            self.unchecked = str(exc)
            log.warning("relayed paths are not checked end to end here (needs CAP_NET_RAW)", error=self.unchecked)
            return
        if self.by_peer.get(s.peer) is not s or s.state != "active":
            return
        if rtt is not None:
            s.echo_misses, s.path_rtt, s.echoed_at = 0, rtt, trio.current_time()
            return
        if self._forgiven(s, s.echoed_at if s.echoed_at is not None else s.active_since):
            s.forgiven += 1
            return
        s.echo_misses += 1
        if s.echo_misses >= BROKEN_AFTER:
            log.warning("the relayed path does not carry our packets: the pair goes direct", peer=s.peer,
                        relay=s.relay, unanswered=s.echo_misses)
            self._set(s, "broken", error=f"{s.echo_misses} overlay echoes through the relay unanswered")

    def _forgiven(self, s: Session, answered_at: float | None) -> bool:
        """A lost ping or echo is not a miss while the busy pair's packets keep arriving from this
        relay's endpoint (``Routing.carried``), for at most ``FORGIVE_FOR`` seconds since the last
        one answered: a relay that passes the peer's packets but none of ours is caught then."""
        return (s.endpoint is not None and self.r.carried(s.peer) == s.endpoint
                and trio.current_time() - (answered_at if answered_at is not None else s.since) < FORGIVE_FOR)

    def _set(self, s: Session, state: str, *, error: str | None = None) -> None:
        if state == s.state and error == s.error:
            return
        if state == "active" and s.state != "active":
            s.active_since, s.echo_misses = trio.current_time(), 0
        if state != s.state:
            log.info("relayed path", peer=s.peer, relay=s.relay, state=state, port=s.port,
                     **({"error": error} if error else {}))
        s.state, s.error = state, error
        self.r.paths_changed()
