"""Connections: their events, dialling members, and hanging up on those gone.

- A new connection is watched by the gate (gate.py: a member shows its certificate or is
  hung up on) and, if its peer is not in the view yet, synced with at once.
- A lost connection is a hint for the core: it probes the member at once.
- A member gone dead or left, or excluded, has our connections to it closed: were it only
  cut off, its TCP connection would sit in retransmit backoff and gossip after a heal would
  wait many seconds; a fresh dial gets through in one round trip. A revoked member still
  connected is told of its revocation first.
- Members are dialled at the addresses of their signed record (the authority on where a
  member listens); bootstrap addresses (from the invite) are dialled, and synced with, with
  a growing, jittered backoff until their peer is in the view.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
import trio
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from ..p2p.streams import PeerError
from .inbound import dial_addrs
from .join import JOIN_TIMEOUT
from .state import Shared

log = structlog.get_logger("swarmd.gossip")

DIAL_TIMEOUT = 10.0  # seconds a dial may take, whatever the deadline of the probe or sync that wanted it


class Notifee(INotifee):
    """py-libp2p's connection events, onto a channel the driver reads."""

    def __init__(self, send: trio.MemorySendChannel) -> None:
        self.send = send

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self.send.send_nowait(("connected", conn.muxed_conn.peer_id))

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self.send.send_nowait(("disconnected", conn.muxed_conn.peer_id))

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass


class _Dial:
    """One dial under way: its waiters read ``error`` once ``done`` is set."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: str | None = None
        self.scope = trio.CancelScope()  # hang_up cancels it: no dial outlives our hanging up


class Peers:
    """Wired by service.py: ``watch`` is the gate's watch of a new connection, ``lost`` what
    the others do when our last connection to a peer closes (the gate and pubsub forget it,
    the core probes it), ``busy`` and ``sync`` are sync.py's, ``forget_ping`` drops the
    peer's ping stream, and ``proof_of_revocation`` and ``tell_revoked`` tell a revoked member
    before we hang up."""

    def __init__(self, shared: Shared, *, watch: Callable[[ID, set[ID]], Awaitable[None]],
                 lost: Callable[[ID], None], busy: Callable[[str], bool], sync: Callable[[str], Awaitable[None]],
                 forget_ping: Callable[[ID], Awaitable[None]], proof_of_revocation: Callable[[str], list[bytes]],
                 tell_revoked: Callable[[ID, list[bytes]], Awaitable[None]]) -> None:
        self.s = shared
        self._watch, self._lost, self._busy, self._sync = watch, lost, busy, sync
        self._forget_ping, self._proof_of_revocation = forget_ping, proof_of_revocation
        self._tell_revoked = tell_revoked
        self._dialing: dict[ID, _Dial] = {}
        self.events_send, self._events_recv = trio.open_memory_channel[tuple[str, ID]](float("inf"))

    async def events(self) -> None:
        s = self.s
        gated: set[ID] = set()
        async for kind, pid in self._events_recv:
            peer = str(pid)
            if kind == "connected" and (dial := self._dialing.get(pid)) is not None:
                dial.done.set()  # it reached us first: whoever waits for our dial has a connection now
            if kind == "disconnected":
                if pid not in s.host.get_connected_peers():
                    self._lost(pid)
                continue
            if pid not in gated and s.nursery:
                gated.add(pid)
                s.nursery.start_soon(self._watch, pid, gated)
            if peer not in s.view() and not self._busy(peer) and peer not in s.excluded and s.nursery:
                s.nursery.start_soon(self._sync, peer)  # a new peer: exchange views at once

    async def hang_up(self, pid: ID) -> None:
        """Close what we hold to a member gone dead, left or excluded (or never checked), a
        dial to it under way included (it would connect us again)."""
        host = self.s.host
        if (dial := self._dialing.get(pid)) is not None:
            dial.error = "cannot connect (hung up on)"
            dial.scope.cancel()
        await self._forget_ping(pid)
        if pid in host.get_connected_peers() and (proof := self._proof_of_revocation(str(pid))):
            with trio.move_on_after(2):  # a revoked member learns it now, not when its syncs start failing
                await self._tell_revoked(pid, proof)
        if pid in host.get_connected_peers():
            with trio.move_on_after(1):
                try:
                    await host.disconnect(pid)
                except Exception as exc:
                    log.debug("disconnect failed", peer=str(pid), error=f"{exc.__class__.__name__}: {exc}")

    async def ensure_connected(self, peer: ID) -> None:
        """Connected to ``peer``, or PeerError. The dial runs apart from the caller (up to
        ``DIAL_TIMEOUT``) and callers wait for it within their own deadlines: a dial takes
        several round trips (TCP, multistream-select, Noise, the muxer), about 1.2 s to a
        member 243 ms away, more than a probe's timeout; cut off with each probe, it would
        start over at every one and that member would never be probed directly again."""
        s = self.s
        if peer in s.host.get_connected_peers():
            return
        if s.nursery is None:
            return await self._dial(peer)
        dial = self._dialing.get(peer)
        if dial is None:
            dial = self._dialing[peer] = _Dial()
            s.nursery.start_soon(self._dial_apart, peer, dial)
        await dial.done.wait()
        if peer not in s.host.get_connected_peers():
            raise PeerError(dial.error or "cannot connect (the connection closed at once)")

    async def _dial_apart(self, peer: ID, dial: _Dial) -> None:
        try:
            with dial.scope:
                dial.scope.deadline = trio.current_time() + DIAL_TIMEOUT
                await self._dial(peer)
            if dial.scope.cancelled_caught and dial.error is None:
                dial.error = f"cannot connect (no answer within {DIAL_TIMEOUT:g} s)"
        except Exception as exc:  # in gossip's nursery: nothing a dial raises may end gossip
            dial.error = str(exc) if isinstance(exc, PeerError) else f"cannot connect ({cause(exc)})"
        finally:
            del self._dialing[peer]
            dial.done.set()

    async def _dial(self, peer: ID) -> None:
        s = self.s
        m = s.view().get(str(peer))
        addrs = dial_addrs(m.record) if m else []
        if addrs:  # the signed record is the authority on where a member listens
            s.host.get_peerstore().clear_addrs(peer)
        try:
            await s.host.connect(PeerInfo(peer, addrs))
        except Exception as exc:
            raise PeerError(f"cannot connect ({cause(exc)})") from None

    async def dial_bootstrap(self, addr: str) -> None:
        s = self.s
        info = info_from_p2p_addr(Multiaddr(addr))
        delay = 0.5
        while str(info.peer_id) not in s.view():
            try:
                with trio.move_on_after(JOIN_TIMEOUT):
                    await s.host.connect(info)
                    await self._sync(str(info.peer_id))
            except Exception:
                pass
            if str(info.peer_id) in s.view():
                return
            await trio.sleep(s.rng.uniform(0, delay))
            delay = min(30.0, delay * 2)


def cause(exc: BaseException) -> str:
    """The innermost reason of a dial failure (py-libp2p wraps it in several layers, one of
    them a MultiError holding one error per address)."""
    seen: list[str] = []
    while exc is not None and len(seen) < 8:
        seen.append(f"{exc.__class__.__name__}: {exc}"[:120])
        errors = getattr(exc, "errors", None)
        exc = exc.__cause__ or exc.__context__ or (errors[0] if errors else None)
    return " <- ".join(seen)
