"""Who may talk to us: a certificate of the swarm first.

Nothing is given to a peer before it proves membership: a valid, unrevoked certificate of
the swarm for the stream's peer id, shown in a request's first frame (``check_member``; a
refused requester is told why), in a sync's hello either way (``hello_is_member``), or in a
record of the view (``is_member``). Excluded and revoked peers are refused all the same.

- A connected peer gets nothing from our pubsub (pubsub.GatedPubsub) until it is a member,
  and is disconnected and counted (``unchecked``) if it does not show it within
  ``GATE_TIMEOUT`` (the sync started when it connects is how a member does).
- Every protocol's handler runs guarded (p2p/transport.py: streams per peer, no exception
  out); gossip's own at most ``STREAMS_PER_PEER`` at once per peer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from ..p2p.signed import Invalid
from ..p2p.streams import write_frame
from .cert import Cert, check_cert
from .state import Shared

log = structlog.get_logger("swarmd.gossip")

STREAMS_PER_PEER = 8  # inbound syncs, probes, joins at once from one peer; honest ones need 1-2
GATE_TIMEOUT = 5.0
GATE_POLL = 0.25


class Gate:
    """Wired by service.py: admission's ``refuses`` (why a revoked peer is refused),
    ``proof_of_revocation`` (sent with that refusal) and ``merge_revocations`` (what a
    refusing responder sends us), and ``hang_up`` (peers.py) for a peer that never showed a
    certificate."""

    def __init__(self, shared: Shared, *, refuses: Callable[[str], str | None],
                 proof_of_revocation: Callable[[str], list[bytes]], merge_revocations: Callable[[Any, str], None],
                 hang_up: Callable[[ID], Awaitable[None]]) -> None:
        self.s = shared
        self._refuses, self._proof_of_revocation = refuses, proof_of_revocation
        self._merge_revocations, self._hang_up = merge_revocations, hang_up
        self.checked: dict[str, float] = {}  # connected peers that showed a certificate -> its expiry

    def forget(self, peer: str) -> None:
        """``peer`` disconnected or was excluded: it shows its certificate again."""
        self.checked.pop(peer, None)

    def is_member(self, peer: str) -> bool:
        s = self.s
        if peer in s.excluded or self._refuses(peer) is not None:
            return False
        now = time.time()
        if self.checked.get(peer, 0.0) > now:
            return True
        m = s.view().get(peer)
        return m is not None and m.record.cert.expires > now

    def checked_member(self, peer: str, cert: Cert) -> None:
        s = self.s
        if peer in s.excluded or self._refuses(peer) is not None:
            return
        self.checked[peer] = cert.expires
        if s.pubsub is not None:
            s.pubsub.admit(ID.from_base58(peer))

    async def check_member(self, req: Any, peer: ID, stream: INetStream) -> bool:
        s = self.s
        if s.swarm is None or s.core is None:
            await write_frame(stream, {"error": "this node is in no swarm"})
            return False
        if (why := self._refuses(str(peer))) is not None:  # revoked: counted and told as such
            s.reject("revoked", str(peer), why)
            await write_frame(stream, {"error": why, "revoked": self._proof_of_revocation(str(peer))})
            return False
        if str(peer) in s.excluded:
            s.reject("excluded", str(peer), s.excluded[str(peer)])
            await write_frame(stream, {"error": f"excluded from swarm {s.swarm.swarm}"})
            return False
        try:
            cert = check_cert(req.get("cert") if isinstance(req, dict) else None,
                              owner_public=s.swarm.owner_public, swarm=s.swarm.swarm, peer=peer.to_bytes(),
                              now=time.time())
            self.checked_member(str(peer), cert)
            return True
        except Invalid as exc:
            s.reject("not_member", str(peer), exc.detail)
            await write_frame(stream, {"error": f"not a member of swarm {s.swarm.swarm}: {exc.detail}"})
            return False

    async def watch(self, pid: ID, gated: set[ID]) -> None:
        """A new connection: pubsub for it once it is a member, else hung up on after GATE_TIMEOUT."""
        s, peer = self.s, str(pid)
        try:
            with trio.move_on_after(GATE_TIMEOUT):
                while not self.is_member(peer):
                    if pid not in s.host.get_connected_peers():
                        return
                    await trio.sleep(GATE_POLL)
                if s.pubsub is not None:
                    s.pubsub.admit(pid)
                return
            if pid in s.host.get_connected_peers():
                why = self._refuses(peer) or s.excluded.get(peer)
                s.reject("unchecked", peer, why or f"no valid certificate of this swarm shown within "
                                                   f"{GATE_TIMEOUT:g} s; disconnected")
                await self._hang_up(pid)
        finally:
            gated.discard(pid)

    def hello_is_member(self, hello: Any, peer: ID) -> bool:
        """A sync responder's first frame: its certificate, checked before we read its view."""
        s = self.s
        assert s.swarm is not None
        if isinstance(hello, dict) and "error" in hello:  # it does not take us for a member (expired?)
            self._merge_revocations(hello.get("revoked"), str(peer))  # revoked while we were away: learn it
            if s.rejects.first(("refused", str(peer))):
                log.warning("sync refused", peer=str(peer), error=str(hello["error"])[:300])
            return False
        try:
            cert = check_cert(hello.get("cert") if isinstance(hello, dict) else None,
                              owner_public=s.swarm.owner_public, swarm=s.swarm.swarm, peer=peer.to_bytes(),
                              now=time.time())
        except Invalid as exc:
            s.reject("not_member", str(peer), f"sync answer: {exc.detail}")
            return False
        if (why := self._refuses(str(peer))) is not None or str(peer) in s.excluded:
            s.reject("revoked", str(peer), why or s.excluded[str(peer)])
            return False
        self.checked_member(str(peer), cert)
        return True
