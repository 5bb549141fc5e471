"""The transport every subsystem's protocol between daemons runs on: ``Transport``.

What a stream here is, and every protocol of gossip, routing and compute relies on exactly
this: reliable and ordered (yamux over TCP, Noise-encrypted); its remote peer is the one
Noise authenticated (``stream.muxed_conn.peer_id``: never a claim inside a frame), and the
address it came from is ``host.remote_ip`` of it; a frame is a 4-byte length and msgpack
(streams.py), its length checked against the reader's limit before its body is read; a
peer that stops reading or sending is the caller's to time out. Nothing here knows of
swarms, certificates or members: that is the gossip floor's gate (``check_member``), which
every handler calls on the request's first frame.

- ``serve(protocol, handler, reject=, per_peer=)``: ``handler`` runs once per inbound
  stream of ``protocol``, at most ``per_peer`` at once per peer (more are reset at once and
  counted ``too_many_streams``); an exception it did not expect is counted (``handler``),
  logged once, and its stream closed, never passed to py-libp2p, which would take the whole
  host down. ``reject`` is the serving subsystem's refusal counter (rejects.Refusals.reject).
- ``open``, ``request``: outbound streams (streams.py), their failures one ``PeerError``.
- ``remote_ips(peer)``: where our live connections to ``peer`` come from.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from .host import remote_ips
from .limits import Streams
from .streams import MAX_SMALL_FRAME, close_quietly, open_stream, request, reset_quietly

log = structlog.get_logger("swarmd.p2p")

STREAMS_PER_PEER = 64  # a backstop for protocols that do not set their own (jobs stream output)

Handler = Callable[[INetStream], Awaitable[None]]
Reject = Callable[[str, str, str], None]  # (reason, peer, detail): a subsystem's refusal counter


class Transport:
    def __init__(self, host: IHost) -> None:
        self.host = host  # what the gossip floor also needs of libp2p itself: pubsub, ping, dialling

    def serve(self, protocol: str, handler: Handler, *, reject: Reject, per_peer: int = STREAMS_PER_PEER) -> None:
        self.host.set_stream_handler(protocol, guarded(handler, reject=reject, per_peer=per_peer))

    async def open(self, peer: ID, protocol: str) -> INetStream:
        return await open_stream(self.host, peer, protocol)

    async def request(self, peer: ID, protocol: str, obj: Any, limit: int = MAX_SMALL_FRAME) -> Any:
        return await request(self.host, peer, protocol, obj, limit)

    def remote_ips(self, peer: str) -> list[str]:
        return remote_ips(self.host, peer)


def guarded(handler: Handler, *, reject: Reject, per_peer: int = STREAMS_PER_PEER) -> Handler:
    """``handler`` with at most ``per_peer`` running at once per peer, and no exception out."""
    active = Streams(per_peer)

    async def guarded(stream: INetStream) -> None:
        peer = str(stream.muxed_conn.peer_id)
        if (busy := active.acquire(peer)) is not None:
            reject("too_many_streams", peer, f"{handler.__name__}: {busy}")
            await reset_quietly(stream)
            return
        try:
            await handler(stream)
        except Exception as exc:
            reject("handler", peer, f"{handler.__name__}: {exc.__class__.__name__}: {exc}")
            log.exception("stream handler failed", peer=peer, handler=handler.__name__)
            await close_quietly(stream)
        finally:
            active.release(peer)
    return guarded
