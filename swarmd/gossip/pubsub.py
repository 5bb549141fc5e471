"""Gossipsub v1.1, configured deliberately (py-libp2p's defaults are wrong for us, see DESIGN).

- Heartbeat 1 s, not 120 s: the mesh repairs within a second of a peer coming or going.
- Spam protection is off in the router: its fixed 10 messages/s per forwarder dropped 183 of
  200 messages in a measurement here, our own publishes included. Flooding is instead
  bounded by what we publish (rate-limited records, rare rumors) and by peer scoring.
- Peer scoring: every message that fails our validator (no certificate, forged signature,
  wrong swarm, oversize, stale) costs its forwarder 10 points, decaying by 3 % a second.
  Below -20 a peer gets no gossip from us, below -50 we ignore its publishes, below -100 it
  is graylisted. Ten bad messages in a row graylist a peer for about half a minute.
- py-libp2p drops an RPC silently when a peer's 32-slot outbound queue is full; we count
  those drops (swarmd_gossip_dropped_total) and log the first.
- Gated to members (``GatedPubsub``, ``GatedGossipSub``): py-libp2p opens a pubsub stream to
  every connected peer, sends it a hello listing our topics, and puts whoever subscribes in
  the topic's peers, so an outsider that connected and subscribed got every record. Here a
  peer gets no pubsub stream from us (no hello, no messages, no IHAVE, no IWANT answers),
  its subscriptions are held back and its control messages (GRAFT puts a peer in the mesh)
  ignored until ``admit(peer)``: the driver admits a peer once it showed a valid, unrevoked
  certificate of the swarm (service.py), and ``forget(peer)`` undoes it.
- ``quiet_drop(forwarder, msg)``: a hook run before validation that may drop a message
  without counting it against the forwarder (a publisher over its rate: the honest members
  that relayed it did nothing wrong; a failed validator would cost each of them 10 points).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from libp2p.abc import IHost
from libp2p.pubsub import gossipsub as gossipsub_mod
from libp2p.pubsub import pubsub as pubsub_mod
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.score import ScoreParams, TopicScoreParams

log = structlog.get_logger("swarmd.gossip")

HEARTBEAT = 1
INVALID_WEIGHT = 10.0
MAX_HELD_SUBSCRIPTIONS = 16  # per unadmitted peer; we have one topic


def topic(swarm: str) -> str:
    return f"/swarmd/{swarm}/members/1"


def score_params() -> ScoreParams:
    return ScoreParams(
        p4_invalid_messages=TopicScoreParams(weight=INVALID_WEIGHT, cap=100.0, decay=0.97),
        gossip_threshold=-20.0, publish_threshold=-50.0, graylist_threshold=-100.0,
        accept_px_threshold=1e9,  # we take peers from records, never from peer exchange
    )


class GatedPubsub(Pubsub):
    """py-libp2p's Pubsub that serves only admitted peers (see the module header)."""

    def __init__(self, *args, gated: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gated = gated  # False: py-libp2p's behaviour (the lab's intruder plays an attacker with it)
        self.admitted: set[ID] = set()
        self.quiet_drop: Callable[[ID, rpc_pb2.Message], bool] | None = None
        self.received: Callable[[str, int], None] = lambda kind, size: None  # state.Traffic.received
        self._waiting: set[ID] = set()  # connected, no pubsub stream opened to them yet
        self._held: dict[ID, set[str]] = {}  # their subscriptions, applied on admission

    def admit(self, peer: ID) -> None:
        if peer in self.admitted:
            return
        self.admitted.add(peer)
        for topic in sorted(self._held.pop(peer, ())):
            super().handle_subscription(peer, rpc_pb2.RPC.SubOpts(subscribe=True, topicid=topic))
        self._waiting.discard(peer)
        # also a peer connected before this pubsub started (a join's connection): py-libp2p only
        # opens streams on new connections. A no-op when one is open; gives up if not connected.
        if peer not in self.peers and self.manager.is_running:
            self.manager.run_task(self._handle_new_peer_with_retry, peer)

    def forget(self, peer: ID) -> None:
        """Not admitted any more (gone, or revoked: the driver also hangs up on it)."""
        self.admitted.discard(peer)
        self._waiting.discard(peer)
        self._held.pop(peer, None)
        self._forget_all_subscriptions(peer)

    def is_admitted(self, peer: ID) -> bool:
        return not self.gated or peer in self.admitted

    async def _handle_new_peer_with_retry(self, peer_id: ID, timeout: float | None = None) -> None:
        if not self.is_admitted(peer_id):
            self._waiting.add(peer_id)  # no stream, no hello before it proves membership
            return
        await super()._handle_new_peer_with_retry(peer_id, timeout)

    def handle_subscription(self, origin_id: ID, sub_message: rpc_pb2.RPC.SubOpts) -> None:
        if self.is_admitted(origin_id):
            super().handle_subscription(origin_id, sub_message)
            return
        held = self._held.setdefault(origin_id, set())
        if not sub_message.subscribe:
            held.discard(sub_message.topicid)
        elif len(held) < MAX_HELD_SUBSCRIPTIONS:
            held.add(sub_message.topicid)

    def _handle_dead_peer(self, peer_id: ID) -> None:
        super()._handle_dead_peer(peer_id)
        if not self._peer_is_connected(peer_id):
            self._waiting.discard(peer_id)
            self._held.pop(peer_id, None)

    async def stream_handler(self, stream) -> None:
        # py-libp2p's read loop hands each message to this service's task nursery, checking only
        # is_running; while the service stops, that nursery is already closed and trio's
        # RuntimeError would escape through the host's connection task and end the host.
        try:
            await super().stream_handler(stream)
        except RuntimeError:
            if not (self.manager.is_cancelled or self.manager.is_finished):
                raise

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        seen = self._is_msg_seen(msg)
        if msg_forwarder != self.my_id:  # a copy from a peer, not our own publish
            self.received("duplicates" if seen else "gossip", len(msg.data))
        if self.quiet_drop is not None and not seen and self.quiet_drop(msg_forwarder, msg):
            return
        await super().push_msg(msg_forwarder, msg)


class GatedGossipSub(GossipSub):
    """GossipSub that takes no control message (GRAFT, IHAVE, IWANT, ...) from a peer the
    pubsub has not admitted: a GRAFT would put it in the topic's mesh."""

    async def handle_rpc(self, rpc: rpc_pb2.RPC, sender_peer_id: ID) -> None:
        if isinstance(self.pubsub, GatedPubsub):
            if not self.pubsub.is_admitted(sender_peer_id):
                return
            if rpc.control.ihave:
                self.pubsub.received("ihave", sum(ihave.ByteSize() for ihave in rpc.control.ihave))
        await super().handle_rpc(rpc, sender_peer_id)


def make_pubsub(host: IHost, gated: bool = True) -> tuple[GatedPubsub, GatedGossipSub]:
    router = GatedGossipSub(
        protocols=[PROTOCOL_ID_V11], degree=6, degree_low=4, degree_high=12,
        heartbeat_interval=HEARTBEAT, heartbeat_initial_delay=0.1,
        score_params=score_params(), spam_protection_enabled=False,
        eclipse_protection_enabled=False,  # lab hosts share a /24; real providers are diverse anyway
    )
    return GatedPubsub(host, router, strict_signing=True, gated=gated), router


def count_drops(on_drop) -> None:
    """Route py-libp2p's outbound-queue drops to ``on_drop(peer_id)``; idempotent."""
    original = getattr(pubsub_mod.drop_rpc, "__wrapped__", pubsub_mod.drop_rpc)

    def drop_rpc(peer_id, rpc) -> None:
        on_drop(peer_id)
        original(peer_id, rpc)

    drop_rpc.__wrapped__ = original  # type: ignore[attr-defined]
    pubsub_mod.drop_rpc = drop_rpc
    gossipsub_mod.drop_rpc = drop_rpc
