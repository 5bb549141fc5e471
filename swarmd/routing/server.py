"""The relay's side: members ask this node to forward a pair's WireGuard packets.

``handle`` serves ``/swarmd/relay/1.0.0`` (request.py): the requester's certificate first
(gate), then its signed request, checked (request.check) and judged by the relay core
(relay.py) with what only this side knows: the requester's IP is the one its libp2p
connection comes from (an end cannot aim the relay at an address it does not hold), its
WireGuard port the one its authenticated WireGuard packets last came from at that IP, as our
own WireGuard device saw them (``Routing.proven``; refused ``unproven`` without one: issue 23
finding 11, a record's port is the member's claim, and with it the relay would aim the other
end's datagrams at any port of whatever host the request came from), the pair's other end an
alive member of our view with a mesh side. A request over the overlay (a NATed member's
connections come in over the mesh once its WireGuard link is up: its connection's address is
its overlay address, no host the rules can aim at) is pinned by the proven endpoint alone:
its IP is the one the requester's WireGuard packets authenticated from (issue 25). An end
whose record says its NAT is symmetric (wg.nat ``edm``) is marked so (relay.End.edm: no flow
is aimed at its proven port). A member changing the rules too often (each change is one ``nft -f``
here) is refused ``rate_limited``, a release too (relay.py). The answer is ``{port, active,
expires_in}``, ``{released: true}`` or ``{error, reason}``; every refusal is counted in
``swarmd_rejected_total{subsystem="routing", reason}`` (p2p/rejects.py: logged once per
(reason, peer) an hour) and the stream closed, nothing else: one request cannot end
the read loop or the daemon.

The rules follow the core's active pairs: after any change the forwarder replaces the
nftables table (forwarder.py), at most once per ``APPLY_MIN_GAP``: changes meanwhile wait
for the next write, which writes the latest version, all of them at once. The per-member
limit (relay.py) bounds what one member makes this host do, not what k colluding members
do (k writes a second, plus lease expiries and pending timeouts, which cost nobody a
token); this gap bounds the whole relay: at most 1 / APPLY_MIN_GAP = 5 ``nft -f`` (each
with its conntrack flush) a second, however many members change pairs. An answer that
waits for its rules (``APPLY_WAIT``) waits at most APPLY_MIN_GAP longer for it. ``expire``
runs when the earliest lease ends, and members that left the view lose their pairs at each
view change.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import structlog
import trio
from libp2p.abc import INetStream

from ..gossip.membership import State
from ..p2p.host import remote_ip
from ..p2p.signed import Invalid
from ..p2p.streams import PeerError, close_quietly, read_frame, write_frame
from ..rpc.framing import FrameTooLarge
from . import request as rq
from .relay import End, Grant, Refused, Relay

log = structlog.get_logger("swarmd.routing")

# A suspect member keeps its pairs: any member can make another suspect for a moment, and the
# relay must not be a way to cut a pair's traffic; dead, left, revoked or gone ends it.
IN_SERVICE = (State.ALIVE, State.SUSPECT)
APPLY_WAIT = 3.0  # seconds an answer waits for the rules that make its pair active
# Seconds from the end of one write of the rules (an `nft -f` and a conntrack flush) to the start of
# the next, failed ones included: 5 a second at most for the whole relay. An honest pair's activation
# waits at most this much more (well inside APPLY_WAIT); a burst of changes becomes one write.
APPLY_MIN_GAP = 0.2

class RelayHub(Protocol):
    """What the relay's protocol reads of the routing driver (service.Routing is one)."""

    g: Any  # the gossip driver: check_member, swarm, me, view
    metrics_pairs: Any  # a prometheus Gauge

    def reject(self, reason: str, peer: str, detail: str) -> None: ...  # routing's refusals, counted and logged

    def own_ips(self) -> list[str]: ...

    def proven(self, peer: str) -> tuple[str, int] | None: ...

    async def proven_now(self, peer: str) -> tuple[str, int] | None: ...  # proven, else asked of the device now

    def in_overlay(self, ip: str) -> bool: ...  # an address inside the mesh's network


class RelayServer:
    def __init__(self, routing: RelayHub, relay: Relay, forwarder: Any) -> None:
        self.r = routing
        self.relay = relay
        self.forwarder = forwarder
        self.applied = -1  # the relay core's version last written to nftables
        self.error: str | None = None  # the last failure to apply the rules
        self.rejected: dict[str, int] = {}
        self.wake = trio.Event()
        self.applied_event = trio.Event()  # set (and replaced) whenever an attempt to write the rules ended

    def refuse(self, reason: str, peer: str, detail: str) -> dict[str, str]:
        self.r.reject(reason, peer, detail)
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        return {"error": detail, "reason": reason}

    async def handle(self, stream: INetStream) -> None:
        g = self.r.g
        peer = str(stream.muxed_conn.peer_id)
        try:
            with trio.fail_after(10):
                req = await read_frame(stream, rq.MAX_REQUEST + 4096)
                if not await g.check_member(req, stream.muxed_conn.peer_id, stream):  # counted by the gate
                    self.rejected["not_member"] = self.rejected.get("not_member", 0) + 1
                    return
                await write_frame(stream, await self.answer(req, peer, stream))
        except FrameTooLarge as exc:
            self.refuse("too_large", peer, f"relay request: {exc}")
        except (PeerError, trio.TooSlowError) as exc:
            log.debug("relay request stream failed", peer=peer, error=f"{exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)

    async def answer(self, req: Any, peer: str, stream: INetStream) -> dict[str, Any]:
        g = self.r.g
        assert g.swarm is not None
        try:
            r = rq.check(req.get("req"), swarm=g.swarm.swarm, me=g.me, sender=peer, now=time.time())
        except Invalid as exc:
            return self.refuse(exc.reason, peer, exc.detail)
        view = g.view()
        now = trio.current_time()
        if r.op == "release":
            released = self.relay.release(now, peer, r.other)
            if isinstance(released, Refused):  # rate_limited: its lease runs on
                return self.refuse(released.reason, peer, released.detail)
            self.wake.set()
            return {"released": True}
        if self.error is not None:
            return self.refuse("rules_failed", peer, "this relay cannot install its forwarding rules now")
        mine, theirs = view.get(peer), view.get(r.other)
        for who, m in (("requester", mine), ("other end", theirs)):
            if m is None or m.state not in IN_SERVICE or m.record.wg is None:
                return self.refuse("not_member", peer, f"the pair's {who} is not an alive member of the mesh here")
        ip = remote_ip(stream.muxed_conn)  # a dual-stack listener's ::ffff:a.b.c.d is a.b.c.d
        if ip is None:
            return self.refuse("bad_address", peer, "cannot tell the requester's address")
        # Its WireGuard endpoint as our own WireGuard proved it (Routing.proven), at the address
        # its connection comes from: the pair's packets go to that socket only, never to a port
        # its record names (a member's claim: any service of the host it asks from).
        proven = await self.r.proven_now(peer)
        if proven is not None and self.r.in_overlay(ip):
            ip = proven[0]  # asked over the mesh: the underlay address its WireGuard packets come from
        if proven is None or proven[0] != ip:
            return self.refuse("unproven", peer, f"no WireGuard packets of the requester's arrived here from {ip} "
                                                 "lately: the relay forwards only to an endpoint they came from")
        # pinned: it asks from an address its record lists, so no NAT rewrites its WireGuard port
        # (the rules then take only ip:port from it: no other socket of that host takes the pair).
        pinned = ip in mine.record.wg.endpoints
        edm = not pinned and getattr(mine.record.wg, "nat", None) == "edm"
        end = End(peer=peer, ip=ip, wg_port=proven[1], via_ip=r.via_ip, pinned=pinned, edm=edm)
        result = self.relay.request(now, end, r.other)
        if not isinstance(result, Grant):
            return self.refuse(result.reason, peer, result.detail)
        self.wake.set()
        needed = self.relay.version  # rules of this version or a later one hold the pair (others' changes
        # meanwhile must not keep it waiting: versions only grow, and the loop writes the latest)
        if result.active and self.applied < needed:  # the rules go in first: "active" means forwarded
            with trio.move_on_after(APPLY_WAIT):
                while self.applied < needed and self.error is None:
                    await self.applied_event.wait()
        active = result.active and self.applied >= needed
        return {"port": result.port, "active": active, "expires_in": round(result.expires - now, 1)}

    def view_changed(self) -> None:
        """Members no longer alive in the view lose their pairs; our own IPs may have changed."""
        view = self.r.g.view()
        gone = {p for pair in self.relay.active() for p in (pair.a.peer, pair.b.peer)
                if (m := view.get(p)) is None or m.state not in IN_SERVICE}
        for peer in gone:
            self.relay.end_member(peer)
        self.relay.set_addresses(self.r.own_ips())
        self.wake.set()

    async def run(self) -> None:
        """Keeps the kernel's rules equal to the core's active pairs, expiring leases on time."""
        written = trio.current_time() - APPLY_MIN_GAP  # when the last write of the rules ended
        try:
            while True:
                self.relay.expire(trio.current_time())
                if self.relay.version != self.applied:
                    await trio.sleep_until(written + APPLY_MIN_GAP)  # changes meanwhile: into this write
                    self.relay.expire(trio.current_time())
                    version = self.relay.version
                    try:
                        await self.forwarder.apply(self.relay.active())
                        self.applied, self.error = version, None
                        self.applied_event.set()
                        self.applied_event = trio.Event()
                    except Exception as exc:  # nft refused or vanished: say so, keep serving, retry
                        self.error = f"{exc.__class__.__name__}: {exc}"
                        log.error("cannot apply the relay's forwarding rules", error=self.error)
                        self.applied_event.set()  # answers waiting for these rules: not active, now
                        self.applied_event = trio.Event()
                    written = trio.current_time()
                    self.r.metrics_pairs.set(len(self.relay.active()))
                deadline = self.relay.next_deadline()
                wait = 5.0 if self.error else (60.0 if deadline is None else max(0.05, deadline - trio.current_time()))
                with trio.move_on_after(wait):
                    await self.wake.wait()
                self.wake = trio.Event()
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.forwarder.close()
                except Exception as exc:
                    log.error("cannot remove the relay's forwarding rules", error=f"{exc.__class__.__name__}: {exc}")

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        return {"pairs": len(self.relay.active()), "rows": self.relay.rows(now), "error": self.error,
                "rejected": dict(self.rejected)}
