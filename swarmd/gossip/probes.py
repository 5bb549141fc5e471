"""Probes: the driver's side of SWIM's failure detector (the rules are the core's).

- ``probe`` (the core's ``Probe``): a libp2p ping to the member within the core's timeout,
  dialling its record's addresses if we hold no connection; the answer and its RTT, or a
  failure, go back to the core (``probe_result``).
- ``probe_via`` (``ProbeVia``): asks a helper member, on the probe protocol, to ping the
  target for us: ``{cert, target, timeout}`` -> ``{ack: bool}``. A helper that does not
  answer in time reports nothing (the core's deadline decides); an answer goes to the
  core (``via_result``).
- ``handle_probe``: the helper's side. The requester must show a valid certificate (first frame,
  4 KiB at most); the target must be in our view (a probe must not make us dial just
  anyone); the timeout asked is clamped to 0.05..5 s. A malformed request is counted and
  the stream closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ..rpc.framing import FrameTooLarge
from ..p2p.signed import Invalid, peer_bytes, peer_str
from ..p2p.streams import PROBE_PROTOCOL, PeerError, close_quietly, read_frame, request, write_frame

if TYPE_CHECKING:
    from .service import Gossip


class Probes:
    def __init__(self, gossip: Gossip) -> None:
        self.g = gossip

    async def ping(self, peer: str, timeout: float) -> float | None:
        """The RTT to ``peer`` in seconds, or None if it did not answer within ``timeout``."""
        pid = ID.from_base58(peer)
        with trio.move_on_after(timeout):
            try:
                await self.g.peers.ensure_connected(pid)
                return await self.g.pinger.ping(pid)
            except PeerError:
                return None
        return None

    async def probe(self, probe_id: int, peer: str, timeout: float) -> None:
        rtt = await self.ping(peer, timeout)
        self.g.core.probe_result(trio.current_time(), probe_id, rtt is not None, rtt)
        self.g.loop.input()
        if rtt is not None:
            self.g.rtt_observed(peer, rtt)

    async def probe_via(self, probe_id: int, via: str, target: str, timeout: float) -> None:
        g = self.g
        assert g.swarm is not None
        ack = None
        with trio.move_on_after(timeout * 1.5 + 0.5):
            try:
                pid = ID.from_base58(via)
                await g.peers.ensure_connected(pid)
                reply = await request(g.host, pid, PROBE_PROTOCOL, {
                    "cert": g.swarm.cert.blob, "target": peer_bytes(target), "timeout": timeout})
                ack = bool(reply.get("ack")) if isinstance(reply, dict) else None
            except PeerError:
                pass
        if ack is not None:
            g.core.via_result(trio.current_time(), probe_id, via, ack)
            g.loop.input()

    async def handle_probe(self, stream: INetStream) -> None:
        g = self.g
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(10):
                req = await read_frame(stream, 4096)
                if not await g.check_member(req, peer, stream):
                    return
                target = peer_str(req["target"])
                timeout = min(5.0, max(0.05, float(req.get("timeout", 1.0))))
                if target not in g.view():  # members only: a probe must not make us dial just anyone
                    await write_frame(stream, {"ack": False})
                    return
                rtt = await self.ping(target, timeout)
                await write_frame(stream, {"ack": rtt is not None})
        except FrameTooLarge as exc:
            g.reject("too_large", str(peer), f"probe request: {exc}")
        except (PeerError, Invalid, KeyError, TypeError, ValueError, trio.TooSlowError) as exc:
            g.reject("malformed", str(peer), f"probe request: {exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)
