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

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ..rpc.framing import FrameTooLarge
from ..p2p.signed import Invalid, peer_bytes, peer_str
from ..p2p.streams import PeerError, close_quietly, read_frame, request, write_frame
from .protocols import PROBE_PROTOCOL
from .state import Shared


class Probes:
    """Wired by service.py: ``connect`` dials a peer if need be (peers.py), ``ping`` is one
    round trip on the ping stream (p2p.streams.Pinger), ``acted`` lets the core act on a
    result (loop.input), ``rtt_observed`` hands each RTT to routing, ``check_member`` is the
    gate's check of a request's certificate."""

    def __init__(self, shared: Shared, *, connect: Callable[[ID], Awaitable[None]],
                 ping: Callable[[ID], Awaitable[float]], acted: Callable[[], None],
                 rtt_observed: Callable[[str, float], None],
                 check_member: Callable[[Any, ID, INetStream], Awaitable[bool]]) -> None:
        self.s = shared
        self._connect, self._ping, self._acted = connect, ping, acted
        self._rtt_observed, self._check_member = rtt_observed, check_member

    def _counted(self, size: int) -> None:
        self.s.traffic.received("probes", size)

    async def ping(self, peer: str, timeout: float) -> float | None:
        """The RTT to ``peer`` in seconds, or None if it did not answer within ``timeout``."""
        pid = ID.from_base58(peer)
        with trio.move_on_after(timeout):
            try:
                await self._connect(pid)
                return await self._ping(pid)
            except PeerError:
                return None
        return None

    async def probe(self, probe_id: int, peer: str, timeout: float) -> None:
        rtt = await self.ping(peer, timeout)
        self.s.core.probe_result(trio.current_time(), probe_id, rtt is not None, rtt)  # type: ignore[union-attr]
        self._acted()
        if rtt is not None:
            self._rtt_observed(peer, rtt)

    async def probe_via(self, probe_id: int, via: str, target: str, timeout: float) -> None:
        s = self.s
        assert s.swarm is not None and s.core is not None
        ack = None
        with trio.move_on_after(timeout * 1.5 + 0.5):
            try:
                pid = ID.from_base58(via)
                await self._connect(pid)
                reply = await request(s.host, pid, PROBE_PROTOCOL, {
                    "cert": s.swarm.cert.blob, "target": peer_bytes(target), "timeout": timeout},
                    counted=self._counted)
                ack = bool(reply.get("ack")) if isinstance(reply, dict) else None
            except PeerError:
                pass
        if ack is not None:
            s.core.via_result(trio.current_time(), probe_id, via, ack)
            self._acted()

    async def handle_probe(self, stream: INetStream) -> None:
        s = self.s
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(10):
                req = await read_frame(stream, 4096, self._counted)
                if not await self._check_member(req, peer, stream):
                    return
                target = peer_str(req["target"])
                timeout = min(5.0, max(0.05, float(req.get("timeout", 1.0))))
                if target not in s.view():  # members only: a probe must not make us dial just anyone
                    await write_frame(stream, {"ack": False})
                    return
                rtt = await self.ping(target, timeout)
                await write_frame(stream, {"ack": rtt is not None})
        except FrameTooLarge as exc:
            s.reject("too_large", str(peer), f"probe request: {exc}")
        except (PeerError, Invalid, KeyError, TypeError, ValueError, trio.TooSlowError) as exc:
            s.reject("malformed", str(peer), f"probe request: {exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)
