"""The trio driver of membership: ``Gossip``, the one object the rest of the daemon holds.

The sans-IO core (membership.py) decides; the driver only feeds it and performs what it
returns, one module per concern. Each helper reads the state they share (state.py) and is
given, here and only here, the few callables it needs of the others: no helper holds
another, or this object.

- state.py     what the helpers share: host, swarm, core, verifier, exclusions, nursery
- loop.py      the core's clock and actions (publish, probe, sync, changed members)
- records.py   this node's own record, its capacity samples
- inbound.py   gossip from the swarm topic: screened, validated, merged
- probes.py    direct and indirect probes, and the helper's side
- sync.py      push-pull sync: the protocol, the payload checks, the merge through the core
- gate.py      who may talk to us: certificates first, streams per peer
- peers.py     connections: their events, dialling, hanging up
- join.py      joining a swarm with an invite
- admission.py the owner's side of joins, renewals, revocations

Inputs: verified gossipsub messages, probe and sync answers, libp2p connection events,
capacity samples and label changes, and the core's own deadlines. Outputs: signed records
and rumors on the swarm topic, pings, indirect probes, push-pull syncs. Every request on our
protocols carries the sender's certificate; anything that fails a check is dropped, counted
in ``swarmd_rejected_total{subsystem="gossip", reason}`` (p2p/rejects.py) and logged once
per (reason, peer).

Everyone else (mesh, placement, the control API) reads the membership through ``view()``,
an immutable snapshot (membership.View); ``exclude_peer`` removes a member (a revocation, an
expired certificate) until ``readmit_peer``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from ..p2p.rejects import Refusals, Rejects
from ..p2p.signed import Signer
from ..p2p.streams import Pinger, count_pings
from ..p2p.transport import guarded
from . import pubsub as ps
from .admission import Admission
from .capacity import Collector, Resources
from .cert import Token
from .gate import STREAMS_PER_PEER, Gate
from .inbound import Inbound
from .join import JoinError, join
from .loop import Loop
from .membership import Membership, Timing, View
from .peers import Notifee, Peers
from .probes import Probes
from .protocols import JOIN_PROTOCOL, PROBE_PROTOCOL, SYNC_PROTOCOL
from .records import OwnRecord
from .state import Shared, Traffic
from .swarmstate import SwarmMembership
from .sync import Syncs
from .wire import JobSlots, MeshInfo, Record, Verifier

log = structlog.get_logger("swarmd.gossip")

LEAVE_FLUSH = 1.0
__all__ = ["Above", "Gossip", "JoinError"]


@dataclass(frozen=True)
class Above:
    """What the floors above gossip put into this node's record and take from its probes:
    callables that node.py (the composition root) wires once, at construction, and that
    gossip calls while it runs (never before `Gossip.run`). Each defaults to "nothing": a
    node without a mesh, jobs or routing advertises none."""

    mesh_info: Callable[[], MeshInfo | None] = lambda: None  # the mesh, while it is up
    job_slots: Callable[[], JobSlots | None] = lambda: None  # the job service's ledger
    route_info: Callable[[], dict[str, Any]] = dict  # routing: coordinate, relay, chosen relays
    recent_rtts: Callable[[], dict[str, float] | None] = lambda: None  # routing: peer -> ms
    rtt_observed: Callable[[str, float], None] = lambda peer, rtt: None  # each RTT a probe measured
    serve_info: Callable[[], dict[str, Any]] = dict  # services: the claims it controls, the replicas it runs


class Gossip:
    def __init__(self, *, host: IHost, sign: Signer, peer: str, swarm: SwarmMembership | None,
                 timing: Timing, labels: dict[str, str], addrs: Callable[[], list[str]], seq: int,
                 metrics: Any, rng: Any, collector: Collector | None = None, above: Above = Above(),
                 refusals: Refusals | None = None) -> None:
        self.timing = timing
        self.labels = dict(labels)
        self.addrs = addrs
        self.metrics = metrics
        self.seq = seq
        # what gossip refuses (its side of the node's one counter: node.py hands it; a test gets its own)
        self.rejects = refusals or Rejects(metrics).of("gossip")
        self.traffic = Traffic(metrics)
        # the metrics' values, kept here too for `swarmctl status` (no metrics port needed)
        self.rejected = self.rejects.rejected
        self.shared = s = Shared(host=host, sign=sign, me=peer, swarm=swarm, rng=rng, rejects=self.rejects,
                                 traffic=self.traffic)
        self.pinger = Pinger(host)
        self.joined = trio.Event()
        if swarm is not None:
            self.joined.set()
        self.mesh_info = above.mesh_info  # what admission and our own record read of the mesh

        # the helpers, each given what it needs of the others (and nothing else)
        self.own = OwnRecord(s, collector or Collector(), addrs=addrs, labels=lambda: self.labels,
                             mesh_info=above.mesh_info, job_slots=above.job_slots, route_info=above.route_info,
                             serve_info=above.serve_info,
                             recent_rtts=above.recent_rtts, readvertise=self.readvertise)
        self.admission = Admission(s, exclude=self.exclude_peer, publish=self.publish,  # joins, renewals, revocations
                                   readvertise=self.readvertise, mesh_info=above.mesh_info)
        self.peers = Peers(s, watch=self._watch, lost=self._lost, busy=self._sync_busy, sync=self._sync,
                           forget_ping=self.pinger.forget, proof_of_revocation=self.admission.proof_of_revocation,
                           tell_revoked=self._tell_revoked)
        self.gate = Gate(s, refuses=self.admission.refuses, proof_of_revocation=self.admission.proof_of_revocation,
                         merge_revocations=self.admission.merge, hang_up=self.peers.hang_up)
        self.loop = Loop(s, make_record=self.own.make, probe=self._probe, probe_via=self._probe_via,
                         sync=self._request_sync, hang_up=self.peers.hang_up, set_members=metrics.set_members)
        self.inbound = Inbound(s, revoked=self.admission.received, refuse_record=self.admission.refuse_record,
                               acted=self.loop.input, mesh_info=above.mesh_info)
        self.probes = Probes(s, connect=self.peers.ensure_connected, ping=self.pinger.ping, acted=self.loop.input,
                             rtt_observed=above.rtt_observed, check_member=self.gate.check_member)
        self.syncs = Syncs(s, merge=self.inbound, connect=self.peers.ensure_connected, own_record=self._own_record,
                           acted=self.loop.input, check_member=self.gate.check_member,
                           hello_is_member=self.gate.hello_is_member, revocations=self.admission.for_sync,
                           merge_revocations=self.admission.merge)

    # --- callbacks between helpers: they call each other in circles (a probe's answer makes
    # the loop act, the loop starts probes), so these forward to the helper at call time ---

    def _own_record(self) -> Record | None:
        return self.own.record

    async def _watch(self, pid: ID, gated: set[ID]) -> None:
        await self.gate.watch(pid, gated)

    def _lost(self, pid: ID) -> None:
        """Our last connection to ``pid`` closed: it shows its certificate again, pubsub drops
        it, and the core probes it at once."""
        self.gate.forget(str(pid))
        if self.shared.pubsub is not None:
            self.shared.pubsub.forget(pid)
        if self.shared.core is not None:
            self.shared.core.connection_lost(trio.current_time(), str(pid))
            self.loop.input()

    def _sync_busy(self, peer: str) -> bool:
        return self.syncs.busy(peer)

    async def _sync(self, peer: str) -> None:
        await self.syncs.sync(peer)

    def _request_sync(self, peer: str) -> None:
        self.syncs.request(peer)

    async def _tell_revoked(self, pid: ID, proof: list[bytes]) -> None:
        await self.syncs.tell_revoked(pid, proof)

    async def _probe(self, probe_id: int, peer: str, timeout: float) -> None:
        await self.probes.probe(probe_id, peer, timeout)

    async def _probe_via(self, probe_id: int, via: str, target: str, timeout: float) -> None:
        await self.probes.probe_via(probe_id, via, target, timeout)

    # --- the shared state, as the rest of the daemon (and tests) read it ----------------

    @property
    def host(self) -> IHost:
        return self.shared.host

    @property
    def me(self) -> str:
        return self.shared.me

    @property
    def sign(self) -> Signer:
        """This node's identity key (routing signs its relay requests with it)."""
        return self.shared.sign

    @property
    def swarm(self) -> SwarmMembership | None:
        return self.shared.swarm

    @swarm.setter
    def swarm(self, swarm: SwarmMembership | None) -> None:
        self.shared.swarm = swarm

    @property
    def core(self) -> Membership | None:
        return self.shared.core

    @core.setter
    def core(self, core: Membership | None) -> None:
        self.shared.core = core

    @property
    def verifier(self) -> Verifier | None:
        return self.shared.verifier

    @verifier.setter
    def verifier(self, verifier: Verifier | None) -> None:
        self.shared.verifier = verifier

    @property
    def nursery(self) -> trio.Nursery | None:
        return self.shared.nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery | None) -> None:
        self.shared.nursery = nursery

    @property
    def excluded(self) -> dict[str, str]:
        return self.shared.excluded

    @property
    def pubsub(self) -> Any:
        return self.shared.pubsub

    @property
    def view_changed(self) -> trio.Event:
        """Set, and replaced, whenever a member or its record changes."""
        return self.shared.view_changed

    # --- what others read ---------------------------------------------------------------

    @property
    def own_record(self) -> Record | None:
        return self.own.record

    @property
    def record_error(self) -> str | None:
        """Why our own record is not published, if it is not."""
        return self.own.error

    @property
    def resources(self) -> Resources:
        return self.own.resources

    def view(self) -> View:
        """The membership as an immutable snapshot (the same object until something changes);
        what the mesh, placement and the control API read, from any thread."""
        return self.shared.view()

    def reject(self, reason: str, peer: str, detail: str) -> None:
        self.shared.reject(reason, peer, detail)

    async def ping(self, peer: str, timeout: float) -> float | None:
        """The RTT to ``peer`` in seconds (dialled if need be), None without an answer within
        ``timeout``: what routing measures its legs with."""
        return await self.probes.ping(peer, timeout)

    def _probe_bytes(self, size: int) -> None:
        self.traffic.received("probes", size)

    def is_member(self, peer: str) -> bool:
        """Whether ``peer`` (authenticated by its connection) showed a valid certificate of the
        swarm: in a sync's hello, or in a record of the view; not revoked nor excluded."""
        return self.gate.is_member(peer)

    async def check_member(self, req: Any, peer: ID, stream: INetStream) -> bool:
        """Whether the requester holds a certificate of this swarm; if not, it is told why."""
        return await self.gate.check_member(req, peer, stream)

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        for protocol, handler in ((PROBE_PROTOCOL, self.probes.handle_probe), (SYNC_PROTOCOL, self.syncs.handle_sync),
                                  (JOIN_PROTOCOL, self.admission.handle_join)):
            self.host.set_stream_handler(protocol, guarded(handler, reject=self.rejects.reject,
                                                           per_peer=STREAMS_PER_PEER))
        self.host.get_network().register_notifee(Notifee(self.peers.events_send))
        ps.count_drops(self.traffic.dropped)
        self.pinger.received = self._probe_bytes
        count_pings(self.host, self._probe_bytes)
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self.pinger.start(nursery)
            nursery.start_soon(self.own.sample)
            task_status.started()
            await self.joined.wait()
            await self._run_swarm()

    async def _run_swarm(self) -> None:
        from libp2p.tools.anyio_service import background_trio_service

        assert self.swarm is not None and self.nursery is not None
        self.verifier = Verifier(self.swarm.swarm, self.swarm.owner_public, network=self.admission.network,
                                 local_addrs=self.addrs())
        self.admission.start()
        self.core = Membership(self.me, self.seq, self.timing, self.shared.rng, trio.current_time())
        for peer, reason in self.excluded.items():
            self.core.exclude(trio.current_time(), peer, reason)
        topic = self.shared.topic = ps.topic(self.swarm.swarm)
        pubsub, router = ps.make_pubsub(self.host)
        pubsub.set_topic_validator(topic, self.inbound.validate, False)
        pubsub.quiet_drop = self.inbound.quiet_drop
        pubsub.received = self.traffic.received
        self.shared.pubsub = pubsub
        async with background_trio_service(pubsub), background_trio_service(router):
            await pubsub.wait_until_ready()
            subscription = await pubsub.subscribe(topic)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.loop.timers)
                nursery.start_soon(self.inbound.read, subscription)
                nursery.start_soon(self.loop.publisher, pubsub)
                nursery.start_soon(self.peers.events)
                nursery.start_soon(self.admission.run)
                for addr in self.swarm.bootstrap:
                    nursery.start_soon(self.peers.dial_bootstrap, addr)
                log.info("in swarm", swarm=self.swarm.swarm, owner=self.swarm.is_owner,
                         expires=round(self.swarm.cert.expires))
                await trio.sleep_forever()

    async def leave(self) -> None:
        """Announce a graceful stop; returns once the rumor is handed to the network."""
        if self.pubsub is None or self.core is None:
            return
        self.core.leave(trio.current_time())
        self.loop.perform()
        await self.loop.flush(self.pubsub, LEAVE_FLUSH)

    # --- swarm admission ----------------------------------------------------------------

    def adopt(self, swarm: SwarmMembership) -> None:
        """Start gossiping in ``swarm`` (after `swarm init` or a join)."""
        self.swarm = swarm
        self.joined.set()

    async def join(self, token: Token, state_dir: Path) -> SwarmMembership:
        """Join the swarm of an invite (``JoinError`` says why not), and start gossiping in it."""
        swarm = await join(self.host, self.me, token, state_dir)
        self.adopt(swarm)
        return swarm

    def publish(self, blob: bytes) -> None:
        """Put a signed blob (a revocation) on the swarm topic."""
        self.loop.publish_send.send_nowait(blob)

    def exclude_peer(self, peer: str, reason: str) -> None:
        """Remove ``peer`` from the view at once (a revocation, an expired certificate), close
        our connections to it, and refuse its records, rumors and streams until
        ``readmit_peer``."""
        if peer == self.me:
            return
        self.excluded[peer] = reason
        self.gate.forget(peer)
        if self.pubsub is not None:
            self.pubsub.forget(ID.from_base58(peer))
        if self.core is not None:
            self.core.exclude(trio.current_time(), peer, reason)
            self.loop.input()
        if self.nursery is not None:  # also when it was not in the view: it may be connected
            self.nursery.start_soon(self.peers.hang_up, ID.from_base58(peer))
        self.changed()

    def readmit_peer(self, peer: str) -> None:
        self.excluded.pop(peer, None)
        if self.core is not None:
            self.core.readmit(peer)

    # --- changes of this node and of the view -------------------------------------------

    def changed(self) -> None:
        """Wake whoever waits on ``view_changed``."""
        self.shared.changed()

    def readvertise(self) -> None:
        """Something in this node's record changed (labels, mesh key or address): publish it."""
        if self.core is not None:
            self.core.local_change(trio.current_time())
            self.loop.input()

    def set_labels(self, labels: dict[str, str]) -> None:
        self.labels = dict(labels)
        self.readvertise()
