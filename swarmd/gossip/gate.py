"""Who may talk to us: a certificate of the swarm first, and a limit of streams per peer.

Nothing is given to a peer before it proves membership: a valid, unrevoked certificate of
the swarm for the stream's peer id, shown in a request's first frame (``check_member``; a
refused requester is told why), in a sync's hello either way (``hello_is_member``), or in a
record of the view (``is_member``). Excluded and revoked peers are refused all the same.

- A connected peer gets nothing from our pubsub (pubsub.GatedPubsub) until it is a member,
  and is disconnected and counted (``unchecked``) if it does not show it within
  ``GATE_TIMEOUT`` (the sync started when it connects is how a member does).
- A peer may hold at most ``STREAMS_PER_PEER`` inbound streams of each of our protocols at
  once; more are reset at once and counted (``too_many_streams``). An exception a handler
  did not expect is counted (``handler``), never passed to py-libp2p, which would take the
  whole host down.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ..p2p.signed import Invalid
from ..p2p.streams import close_quietly, reset_quietly, write_frame
from .cert import Cert, check_cert

if TYPE_CHECKING:
    from .service import Gossip

log = structlog.get_logger("swarmd.gossip")

STREAMS_PER_PEER = 8  # inbound syncs, probes, joins at once from one peer; honest ones need 1-2
STREAMS_PER_PEER_OTHER = 64  # a backstop for protocols that do not set their own (jobs stream output)
GATE_TIMEOUT = 5.0
GATE_POLL = 0.25


class Gate:
    def __init__(self, gossip: Gossip) -> None:
        self.g = gossip
        self.checked: dict[str, float] = {}  # connected peers that showed a certificate -> its expiry

    def guarded(self, handler: Callable[[INetStream], Any],
                per_peer: int = STREAMS_PER_PEER_OTHER) -> Callable[[INetStream], Any]:
        """``handler`` with at most ``per_peer`` running at once per peer, and no exception out."""
        active: collections.Counter[str] = collections.Counter()
        g = self.g

        async def guarded(stream: INetStream) -> None:
            peer = str(stream.muxed_conn.peer_id)
            if active[peer] >= per_peer:
                g.reject("too_many_streams", peer, f"{handler.__name__}: {per_peer} already open")
                await reset_quietly(stream)
                return
            active[peer] += 1
            try:
                await handler(stream)
            except Exception as exc:
                g.reject("handler", peer, f"{handler.__name__}: {exc.__class__.__name__}: {exc}")
                log.exception("stream handler failed", peer=peer, handler=handler.__name__)
                await close_quietly(stream)
            finally:
                active[peer] -= 1
                if active[peer] <= 0:
                    del active[peer]
        return guarded

    def is_member(self, peer: str) -> bool:
        g = self.g
        if peer in g.excluded or g.admission.refuses(peer) is not None:
            return False
        now = time.time()
        if self.checked.get(peer, 0.0) > now:
            return True
        m = g.view().get(peer)
        return m is not None and m.record.cert.expires > now

    def checked_member(self, peer: str, cert: Cert) -> None:
        g = self.g
        if peer in g.excluded or g.admission.refuses(peer) is not None:
            return
        self.checked[peer] = cert.expires
        if g.pubsub is not None:
            g.pubsub.admit(ID.from_base58(peer))

    async def check_member(self, req: Any, peer: ID, stream: INetStream) -> bool:
        g = self.g
        if g.swarm is None or g.core is None:
            await write_frame(stream, {"error": "this node is in no swarm"})
            return False
        if (why := g.admission.refuses(str(peer))) is not None:  # revoked: counted and told as such
            g.reject("revoked", str(peer), why)
            await write_frame(stream, {"error": why, "revoked": g.admission.proof_of_revocation(str(peer))})
            return False
        if str(peer) in g.excluded:
            g.reject("excluded", str(peer), g.excluded[str(peer)])
            await write_frame(stream, {"error": f"excluded from swarm {g.swarm.swarm}"})
            return False
        try:
            cert = check_cert(req.get("cert") if isinstance(req, dict) else None,
                              owner_public=g.swarm.owner_public, swarm=g.swarm.swarm, peer=peer.to_bytes(),
                              now=time.time())
            self.checked_member(str(peer), cert)
            return True
        except Invalid as exc:
            g.reject("not_member", str(peer), exc.detail)
            await write_frame(stream, {"error": f"not a member of swarm {g.swarm.swarm}: {exc.detail}"})
            return False

    async def watch(self, pid: ID, gated: set[ID]) -> None:
        """A new connection: pubsub for it once it is a member, else hung up on after GATE_TIMEOUT."""
        g, peer = self.g, str(pid)
        try:
            with trio.move_on_after(GATE_TIMEOUT):
                while not self.is_member(peer):
                    if pid not in g.host.get_connected_peers():
                        return
                    await trio.sleep(GATE_POLL)
                if g.pubsub is not None:
                    g.pubsub.admit(pid)
                return
            if pid in g.host.get_connected_peers():
                why = g.admission.refuses(peer) or g.excluded.get(peer)
                g.reject("unchecked", peer, why or f"no valid certificate of this swarm shown within "
                                                   f"{GATE_TIMEOUT:g} s; disconnected")
                await g.peers.hang_up(pid)
        finally:
            gated.discard(pid)

    def hello_is_member(self, hello: Any, peer: ID) -> bool:
        """A sync responder's first frame: its certificate, checked before we read its view."""
        g = self.g
        assert g.swarm is not None
        if isinstance(hello, dict) and "error" in hello:  # it does not take us for a member (expired?)
            g.admission.merge(hello.get("revoked"), str(peer))  # revoked while we were away: learn it
            if g.rejects.first(("refused", str(peer))):
                log.warning("sync refused", peer=str(peer), error=str(hello["error"])[:300])
            return False
        try:
            cert = check_cert(hello.get("cert") if isinstance(hello, dict) else None,
                              owner_public=g.swarm.owner_public, swarm=g.swarm.swarm, peer=peer.to_bytes(),
                              now=time.time())
        except Invalid as exc:
            g.reject("not_member", str(peer), f"sync answer: {exc.detail}")
            return False
        if (why := g.admission.refuses(str(peer))) is not None or str(peer) in g.excluded:
            g.reject("revoked", str(peer), why or g.excluded[str(peer)])
            return False
        self.checked_member(str(peer), cert)
        return True
