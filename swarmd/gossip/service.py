"""The trio driver of membership: feeds the sans-IO core and performs its actions.

Inputs: verified gossipsub messages, probe and sync answers, libp2p connection events,
capacity samples and label changes, and the core's own deadlines. Outputs: signed
records and rumors on the swarm topic, pings, indirect probes, push-pull syncs. Every
request on our protocols carries the sender's certificate; anything that fails a check
is dropped, counted in ``swarmd_gossip_rejected_total{reason}`` and logged once per
(reason, peer).

Nothing is given to a peer before it proves membership, and nothing large is read from
it before that: every first frame is read with a small limit and must hold a valid
certificate for the stream's peer id. A sync (protocol 2) goes:

    requester -> responder  {cert}                  (read with a 64 KiB limit)
    responder -> requester  {cert}                  (or {error}; 64 KiB limit)
    responder -> requester  {records, claims}       (16 MiB; sent only after the check)
    requester -> responder  {records, claims}       (16 MiB; read only after the check)

A peer may hold at most ``STREAMS_PER_PEER`` inbound streams of each protocol at once;
more are reset at once and counted (``too_many_streams``).

Everyone else (mesh, placement, the control API) reads the membership through
``view()``, an immutable snapshot (membership.View); ``exclude_peer`` removes a member
(a revocation, an expired certificate) until ``readmit_peer``.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from typing import Any

import structlog
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from ..rpc.framing import FrameTooLarge
from . import pubsub as ps
from .admission import Admission
from .capacity import Collector, Resources
from .cert import Cert, Token, check_cert
from .limits import Recent, TokenBuckets
from .membership import (REFUSED, Changed, Membership, Probe, ProbeVia, PublishRecord, PublishRumor, State,
                         Sync, Timing, View)
from .signed import Invalid, Signer, peer_bytes, peer_str
from .streams import (JOIN_PROTOCOL, MAX_SMALL_FRAME, MAX_SYNC_FRAME, PROBE_PROTOCOL, SYNC_PROTOCOL, PeerError,
                      Pinger, close_quietly, open_stream, read_frame, request, reset_quietly, write_frame)
from .swarmstate import SwarmMembership, save_joined
from .syncmerge import max_records, select_sync_records
from .revocation import Revocation
from .wire import MAX_RTTS, JobSlots, MeshInfo, Record, Rumor, Verifier, make_record, make_rumor

log = structlog.get_logger("swarmd.gossip")

SAMPLE_INTERVAL = 5.0  # capacity sampling; changes are advertised only when significant
SYNC_TIMEOUT = 5.0
JOIN_TIMEOUT = 10.0
LEAVE_FLUSH = 1.0
ADDR_TTL = 3600
STREAMS_PER_PEER = 8  # inbound syncs, probes, joins at once from one peer; honest ones need 1-2
STREAMS_PER_PEER_OTHER = 64  # a backstop for protocols that do not set their own (jobs stream output)
MAX_CLAIMS = 100_000
# A connected peer must show a valid, unrevoked certificate of the swarm (a sync's hello either
# way proves it; a record in the view does too) within this long, or it is disconnected and
# counted (``unchecked``). Until then pubsub gives it nothing (pubsub.GatedPubsub).
GATE_TIMEOUT = 5.0
GATE_POLL = 0.25
# Valid records per publisher: an honest member publishes on a change and its refresh; the
# burst covers a restart or a partition heal. The excess is dropped, not passed on, counted
# ``record_rate``, and not held against the member that relayed it.
RECORD_RATE, RECORD_BURST = 4.0, 20.0
INTERNAL_BACKOFF = 0.1  # after an unexpected error in the action loop: never a busy loop


class JoinError(Exception):
    pass


class _Notifee(INotifee):
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


class Gossip:
    def __init__(self, *, host: IHost, sign: Signer, peer: str, swarm: SwarmMembership | None,
                 timing: Timing, labels: dict[str, str], addrs: Callable[[], list[str]], seq: int,
                 metrics: Any, rng: Any, collector: Collector | None = None) -> None:
        self.host = host
        self.sign = sign
        self.me = peer
        self.swarm = swarm
        self.timing = timing
        self.labels = dict(labels)
        self.addrs = addrs
        self.metrics = metrics
        self.rng = rng
        self.collector = collector or Collector()
        self.resources: Resources = self.collector.sample()
        self.advertised: Resources = self.resources
        self.seq = seq
        self.core: Membership | None = None  # made when this node is in a swarm
        self.verifier: Verifier | None = None
        self.own_record: Record | None = None
        self.pinger = Pinger(host)
        self.joined = trio.Event()
        if swarm is not None:
            self.joined.set()
        self.mesh_info: Callable[[], MeshInfo | None] = lambda: None  # set by the mesh when it runs
        self.job_slots: Callable[[], JobSlots | None] = lambda: None  # set by the job service
        self.view_changed = trio.Event()  # set, and replaced, whenever a member or its record changes
        self._wake = trio.Event()
        self._publish_send, self._publish_recv = trio.open_memory_channel[bytes](math.inf)
        self._events_send, self._events_recv = trio.open_memory_channel[tuple[str, ID]](math.inf)
        self._syncing: set[str] = set()
        self._excluded: dict[str, str] = {}  # kept here too: applied to the core once it exists
        self._publishing = False  # a publish is between the channel and the peers' queues
        # the metrics' values, kept here too for `swarmctl status` (no metrics port needed)
        self.traffic: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        self._logged = Recent(size=10_000, window=3600.0)  # (reason, peer) logged within the hour
        self._checked: dict[str, float] = {}  # connected peers that showed a certificate -> its expiry
        self._record_rate = TokenBuckets(RECORD_RATE, RECORD_BURST)
        self._decoded: tuple[bytes, Any] | None = None  # the last message decoded before validation
        self.record_error: str | None = None  # why our own record is not published, if it is not
        self._nursery: trio.Nursery | None = None
        self._pubsub = None
        self.topic = ""
        self.admission = Admission(self)  # joins, renewals, revocations: admission.py

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        for protocol, handler in ((PROBE_PROTOCOL, self._handle_probe), (SYNC_PROTOCOL, self._handle_sync),
                                  (JOIN_PROTOCOL, self._handle_join)):
            self.host.set_stream_handler(protocol, self.guarded(handler, per_peer=STREAMS_PER_PEER))
        self.host.get_network().register_notifee(_Notifee(self._events_send))
        ps.count_drops(self._dropped)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._sample_capacity)
            task_status.started()
            await self.joined.wait()
            await self._run_swarm()

    def guarded(self, handler: Callable[[INetStream], Any],
                per_peer: int = STREAMS_PER_PEER_OTHER) -> Callable[[INetStream], Any]:
        """py-libp2p lets an exception from a stream handler take the whole host down: no
        request a peer can send may do that. The handlers catch what they expect; this is
        the backstop for what they did not. A peer gets at most ``per_peer`` of these
        handlers at once: 500 streams from one peer cost 500 resets, not 500 tasks."""
        active: collections.Counter[str] = collections.Counter()

        async def guarded(stream: INetStream) -> None:
            peer = str(stream.muxed_conn.peer_id)
            if active[peer] >= per_peer:
                self.reject("too_many_streams", peer, f"{handler.__name__}: {per_peer} already open")
                await reset_quietly(stream)
                return
            active[peer] += 1
            try:
                await handler(stream)
            except Exception as exc:
                self.reject("handler", peer, f"{handler.__name__}: {exc.__class__.__name__}: {exc}")
                log.exception("stream handler failed", peer=peer, handler=handler.__name__)
                await close_quietly(stream)
            finally:
                active[peer] -= 1
                if active[peer] <= 0:
                    del active[peer]
        return guarded

    async def _run_swarm(self) -> None:
        from libp2p.tools.anyio_service import background_trio_service

        assert self.swarm is not None and self._nursery is not None
        self.verifier = Verifier(self.swarm.swarm, self.swarm.owner_public, network=self.admission.network, local_addrs=self.addrs())
        self.admission.start()
        self.core = Membership(self.me, self.seq, self.timing, self.rng, trio.current_time())
        for peer, reason in self._excluded.items():
            self.core.exclude(trio.current_time(), peer, reason)
        self.topic = ps.topic(self.swarm.swarm)
        pubsub, router = ps.make_pubsub(self.host)
        pubsub.set_topic_validator(self.topic, self._validate, False)
        pubsub.quiet_drop = self._quiet_drop
        self._pubsub = pubsub
        async with background_trio_service(pubsub), background_trio_service(router):
            await pubsub.wait_until_ready()
            subscription = await pubsub.subscribe(self.topic)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._timers)
                nursery.start_soon(self._read, subscription)
                nursery.start_soon(self._publisher, pubsub)
                nursery.start_soon(self._connection_events)
                nursery.start_soon(self.admission.run)
                for addr in self.swarm.bootstrap:
                    nursery.start_soon(self._dial_bootstrap, addr)
                log.info("in swarm", swarm=self.swarm.swarm, owner=self.swarm.is_owner,
                         expires=round(self.swarm.cert.expires))
                await trio.sleep_forever()

    async def leave(self) -> None:
        """Announce a graceful stop; returns once the rumor is handed to the network."""
        if self._pubsub is None or self.core is None:
            return
        self.core.leave(trio.current_time())
        self._perform()
        with trio.move_on_after(LEAVE_FLUSH):
            while self._publishing or self._publish_recv.statistics().current_buffer_used or any(
                    len(q) for q in self._pubsub.peer_queues.values()):
                await trio.sleep(0.01)
            await trio.sleep(0.05)  # the writer task has popped the last RPC; let it write

    # --- swarm admission ----------------------------------------------------------------

    def adopt(self, swarm: SwarmMembership) -> None:
        """Start gossiping in ``swarm`` (after `swarm init` or a join)."""
        self.swarm = swarm
        self.joined.set()

    async def join(self, token: Token, state_dir) -> SwarmMembership:
        errors = []
        for addr in token.addrs:
            try:
                info = info_from_p2p_addr(Multiaddr(addr))
                with trio.fail_after(JOIN_TIMEOUT):
                    await self.host.connect(info)
                    reply = await request(self.host, info.peer_id, JOIN_PROTOCOL, {"ticket": token.ticket})
            except Exception as exc:  # any dial or protocol failure
                errors.append(f"{addr}: {exc.__class__.__name__}: {exc}")
                continue
            if not isinstance(reply, dict) or "cert" not in reply:
                reason = reply.get("error") if isinstance(reply, dict) else "a malformed answer"
                raise JoinError(f"{addr} refused: {reason}")
            try:
                cert = check_cert(reply["cert"], owner_public=token.owner_public, swarm=token.swarm,
                                  peer=peer_bytes(self.me), now=time.time())
            except Invalid as exc:
                raise JoinError(f"{addr} sent a bad certificate: {exc.detail}") from None
            swarm = save_joined(state_dir, token.owner_public, cert, token.addrs)
            self.adopt(swarm)
            log.info("joined swarm", swarm=swarm.swarm, via=addr)
            return swarm
        raise JoinError("no inviting node answered: " + "; ".join(errors))

    async def _handle_join(self, stream: INetStream) -> None:
        await self.admission.handle_join(stream)  # joins and renewals, on the owner's node

    def publish(self, blob: bytes) -> None:
        """Put a signed blob (a revocation) on the swarm topic."""
        self._publish_send.send_nowait(blob)

    # --- the core's clock and actions ---------------------------------------------------

    async def _timers(self) -> None:
        while True:
            with trio.move_on_at(self.core.next_deadline()):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                self.core.handle_timeout(trio.current_time())
                self._perform()
            except Exception as exc:  # a disk error, a bug: the swarm task must go on
                self._internal("internal", self.me, "timers", exc)
                await trio.sleep(INTERNAL_BACKOFF)

    def _perform(self) -> None:
        assert self._nursery is not None
        for action in self.core.take_actions():
            match action:
                case PublishRecord(seq):
                    if (blob := self._make_record(seq)) is not None:
                        self._publish_send.send_nowait(blob)
                case PublishRumor(kind, about, inc):
                    self._publish_send.send_nowait(make_rumor(
                        self.sign, kind=kind, swarm=self.swarm.swarm, sender=self.me, about=about,
                        incarnation=inc, issued=time.time(), cert=self.swarm.cert))
                case Probe(pid, peer, timeout):
                    self._nursery.start_soon(self._probe, pid, peer, timeout)
                case ProbeVia(pid, via, target, timeout):
                    self._nursery.start_soon(self._probe_via, pid, via, target, timeout)
                case Sync(peer):
                    if peer not in self._syncing:
                        self._nursery.start_soon(self._sync, peer)
                case Changed(peer, old, new, reason):
                    self._view_changed()
                    log.info("member " + (new.value if new else "removed"), member=peer,
                             was=old.value if old else None, reason=reason)
                    gone = new in (State.DEAD, State.LEFT) or (new is None and reason != "forgotten")
                    if gone and self._nursery is not None:
                        self._nursery.start_soon(self._hang_up, ID.from_base58(peer))
        self.metrics.set_members(self.core.counts())

    def _input(self) -> None:
        """After feeding the core from outside the timer task: act, and let the timers re-arm."""
        self._perform()
        self._wake.set()

    def _make_record(self, seq: int) -> bytes | None:
        """Our record, checked as every member will check it; None (and ``record_error`` says
        why, logged once) when it would be refused: our certificate expired (the owner was
        unreachable for the whole renewal window), or anything else the verifier refuses."""
        assert self.swarm is not None
        cert, now = self.swarm.cert, time.time()
        if cert.expires <= now:
            return self._no_record(f"this node's certificate expired at {round(cert.expires)}: not publishing "
                                   f"records until it is renewed")
        wg = self.mesh_info()
        if wg is not None and cert.addr4 is not None and wg.addr4 != cert.addr4:
            # a renewal gave an older certificate an address: every member would refuse a record
            # with the mesh's old one. Published without the mesh side until the mesh moves to it
            # (woken here; it re-advertises once it has).
            wg = None
            self._view_changed()
        try:
            blob = make_record(self.sign, swarm=self.swarm.swarm, peer=self.me, seq=seq, issued=now,
                               ttl=self.timing.record_ttl, addrs=self.addrs(), resources=self.resources,
                               labels=self.labels, wg=wg, jobs=self.job_slots(),
                               rtts=self._nearest_rtts(), cert=cert)
            own = self.verifier.decode(blob, now)  # type: ignore[union-attr]
        except (Invalid, ValueError) as exc:
            detail = f"{exc.reason}: {exc.detail}" if isinstance(exc, Invalid) else str(exc)
            return self._no_record(f"this node's own record would be refused ({detail}): not publishing it")
        self.advertised = self.resources
        self.own_record = own  # type: ignore[assignment]
        if self.record_error is not None:
            log.info("publishing records again", seq=seq)
        self.record_error = None
        return blob

    def _no_record(self, why: str) -> None:
        if why != self.record_error:
            log.error("own record not published", why=why)
        self.record_error = why
        return None

    def view(self) -> View:
        """The membership as an immutable snapshot (the same object until something changes);
        what the mesh, placement and the control API read, from any thread."""
        return self.core.view() if self.core is not None else View.empty(self.me)

    def exclude_peer(self, peer: str, reason: str) -> None:
        """Remove ``peer`` from the view at once (a revocation, an expired certificate), close
        our connections to it, and refuse its records, rumors and streams until
        ``readmit_peer``."""
        if peer == self.me:
            return
        self._excluded[peer] = reason
        self._checked.pop(peer, None)
        if self._pubsub is not None:
            self._pubsub.forget(ID.from_base58(peer))
        if self.core is not None:
            self.core.exclude(trio.current_time(), peer, reason)
            self._input()
        if self._nursery is not None:  # also when it was not in the view: it may be connected
            self._nursery.start_soon(self._hang_up, ID.from_base58(peer))
        self._view_changed()

    def readmit_peer(self, peer: str) -> None:
        self._excluded.pop(peer, None)
        if self.core is not None:
            self.core.readmit(peer)

    def _nearest_rtts(self) -> dict[str, float]:
        """This node's lowest RTTs to alive members, in ms: others' placement reads them."""
        measured = sorted((m.rtt_min, m.peer) for m in self.view()
                          if m.rtt_min is not None and m.state is State.ALIVE)
        return {peer: round(rtt * 1000, 2) for rtt, peer in measured[:MAX_RTTS]}

    async def _publisher(self, pubsub) -> None:
        async for blob in self._publish_recv:
            self._publishing = True
            try:
                await pubsub.publish(self.topic, blob)
                self._count("out", len(blob))
            except Exception as exc:
                log.warning("publish failed", error=f"{exc.__class__.__name__}: {exc}")
            finally:
                self._publishing = False

    # --- inbound gossip -----------------------------------------------------------------

    def _decode(self, data: bytes) -> Any:
        """Verifier.decode, once per message for quiet_drop and the validator that follows it."""
        if self._decoded is not None and self._decoded[0] == data:  # protobuf hands out a new bytes each read
            return self._decoded[1]
        decoded = self.verifier.decode(data, time.time())  # type: ignore[union-attr]
        self._decoded = (data, decoded)
        return decoded

    def _quiet_drop(self, forwarder: ID, msg) -> bool:
        """Before validation: drop, without passing it on and without counting it against
        ``forwarder`` (pubsub.GatedPubsub.quiet_drop), what an honest relay may well forward
        because it depends on this node's own view: a record over its publisher's rate, a
        record this view refuses (a revoked signer, a WireGuard key another member holds here),
        a rumor about an incarnation of ours we never issued. Penalizing the relay (the
        validator's 10 points per message) would let one member's burst of lies make honest
        members graylist each other and split the gossip mesh. What every node judges alike
        (a bad signature, a malformed body) is the validator's, and costs the forwarder."""
        try:
            decoded = self._decode(msg.data)
        except Invalid:
            return False  # the validator counts it
        if isinstance(decoded, Rumor):
            if self.core is not None and (why := self.core.screen(decoded)):
                self.reject(why, decoded.sender, f"{decoded.kind} rumor about this node at incarnation "
                                                 f"{decoded.incarnation}")
                return True
            return False
        if not isinstance(decoded, Record) or decoded.peer == self.me:
            return False
        if refused := self.admission.refuse_record(decoded, self._wg_keys()):
            self.reject(refused[0], decoded.peer, refused[1])
            return True
        if self._record_rate.allow(decoded.peer, trio.current_time()):
            return False
        self.reject("record_rate", decoded.peer,
                    f"more than {RECORD_RATE:g} records/s (burst {RECORD_BURST:g}); record seq {decoded.seq} dropped")
        return True

    def _validate(self, forwarder: ID, msg) -> bool:
        try:
            self._decode(msg.data)
        except Invalid as exc:
            self.reject(exc.reason, str(forwarder), exc.detail)
            return False
        return True

    async def _read(self, subscription) -> None:
        while True:
            msg = await subscription.get()
            self._count("in", len(msg.data))
            try:
                decoded = self.verifier.decode(msg.data, time.time())  # type: ignore[union-attr]
            except Invalid:
                continue  # counted by the validator
            try:
                self._accept(decoded)
            except Exception as exc:  # a disk error saving a revocation, a bug: the next message is read
                sender = getattr(decoded, "peer", None) or getattr(decoded, "sender", "?")
                self._internal("handler", str(sender), f"gossip {decoded.__class__.__name__}", exc)

    def _internal(self, reason: str, peer: str, where: str, exc: Exception) -> None:
        """An unexpected exception in a loop that must go on: counted, logged with its stack
        once an hour per (where, error type)."""
        self.rejected[reason] += 1
        self.metrics.gossip_rejected.labels(reason).inc()
        if self._logged.first((reason, where, exc.__class__.__name__), time.monotonic()):
            log.exception("unexpected error; carrying on", where=where, peer=peer, exc_info=exc)

    def _accept(self, msg: Record | Rumor | Revocation) -> str:
        if isinstance(msg, Revocation):
            self.admission.received(msg)
            return "revocation"
        if isinstance(msg, Record) and (refused := self.admission.refuse_record(msg, self._wg_keys())):
            self.reject(refused[0], msg.peer, refused[1])
            return "refused"
        result = self.core.receive(trio.current_time(), msg, time.time())
        if result == "old" and isinstance(msg, Record):  # a replay, or overtaken in flight
            self.rejected["old_seq"] += 1
            self.metrics.gossip_rejected.labels("old_seq").inc()
        elif result in REFUSED:
            sender = msg.peer if isinstance(msg, Record) else msg.sender
            what = (f"record seq {msg.seq}" if isinstance(msg, Record)
                    else f"{msg.kind} rumor about {msg.about} at incarnation {msg.incarnation}")
            self.reject(result, sender, what)
        if isinstance(msg, Record) and result in ("new", "updated"):
            addrs = [Multiaddr(a) for a in msg.addrs if _parses(a)]
            if addrs and msg.peer != self.me:  # the record's addresses replace the ones it replaces
                store, pid = self.host.get_peerstore(), ID.from_base58(msg.peer)
                store.clear_addrs(pid)
                store.add_addrs(pid, addrs, ADDR_TTL)
            self._view_changed()
        self._input()
        return result

    def _wg_keys(self) -> list[tuple[str, bytes]]:
        """(peer, WireGuard key) of this node and the members in the view that advertise one."""
        own = self.mesh_info()
        return [(m.peer, m.record.wg.public) for m in self.view()
                if m.record.wg is not None and m.state in (State.ALIVE, State.SUSPECT)] + \
            ([(self.me, own.public)] if own is not None else [])

    def _count(self, direction: str, size: int) -> None:
        self.traffic[f"messages_{direction}"] += 1
        self.traffic[f"bytes_{direction}"] += size
        self.metrics.gossip_messages.labels(direction).inc()
        self.metrics.gossip_bytes.labels(direction).inc(size)

    def _dropped(self, peer: ID) -> None:
        self.traffic["dropped"] += 1
        self.metrics.gossip_dropped.inc()

    def reject(self, reason: str, peer: str, detail: str) -> None:
        self.rejected[reason] += 1
        self.metrics.gossip_rejected.labels(reason).inc()
        if self._logged.first((reason, peer), time.monotonic()):
            log.warning("rejected input", reason=reason, peer=peer, detail=detail)

    # --- probes -------------------------------------------------------------------------

    async def _ensure_connected(self, peer: ID) -> None:
        if peer in self.host.get_connected_peers():
            return
        m = self.view().get(str(peer))
        addrs = [Multiaddr(a) for a in (m.record.addrs if m else ()) if _parses(a)]
        if addrs:  # the signed record is the authority on where a member listens
            self.host.get_peerstore().clear_addrs(peer)
        try:
            await self.host.connect(PeerInfo(peer, addrs))
        except Exception as exc:
            raise PeerError(f"cannot connect ({_cause(exc)})") from None

    async def _ping(self, peer: str, timeout: float) -> float | None:
        pid = ID.from_base58(peer)
        with trio.move_on_after(timeout):
            try:
                await self._ensure_connected(pid)
                return await self.pinger.ping(pid)
            except PeerError:
                return None
        return None

    async def _probe(self, probe_id: int, peer: str, timeout: float) -> None:
        rtt = await self._ping(peer, timeout)
        self.core.probe_result(trio.current_time(), probe_id, rtt is not None, rtt)
        self._input()

    async def _probe_via(self, probe_id: int, via: str, target: str, timeout: float) -> None:
        ack = None
        with trio.move_on_after(timeout * 1.5 + 0.5):
            try:
                pid = ID.from_base58(via)
                await self._ensure_connected(pid)
                reply = await request(self.host, pid, PROBE_PROTOCOL, {
                    "cert": self.swarm.cert.blob, "target": peer_bytes(target), "timeout": timeout})
                ack = bool(reply.get("ack")) if isinstance(reply, dict) else None
            except PeerError:
                pass
        if ack is not None:
            self.core.via_result(trio.current_time(), probe_id, via, ack)
            self._input()

    async def check_member(self, req: Any, peer: ID, stream: INetStream) -> bool:
        """Whether the requester holds a certificate of this swarm; if not, it is told why."""
        if self.swarm is None or self.core is None:
            await write_frame(stream, {"error": "this node is in no swarm"})
            return False
        if (why := self.admission.refuses(str(peer))) is not None:  # revoked: counted and told as such
            self.reject("revoked", str(peer), why)
            await write_frame(stream, {"error": why, "revoked": self.admission.proof_of_revocation(str(peer))})
            return False
        if str(peer) in self._excluded:
            self.reject("excluded", str(peer), self._excluded[str(peer)])
            await write_frame(stream, {"error": f"excluded from swarm {self.swarm.swarm}"})
            return False
        try:
            cert = check_cert(req.get("cert") if isinstance(req, dict) else None,
                              owner_public=self.swarm.owner_public, swarm=self.swarm.swarm, peer=peer.to_bytes(),
                              now=time.time())
            self._checked_member(str(peer), cert)
            return True
        except Invalid as exc:
            self.reject("not_member", str(peer), exc.detail)
            await write_frame(stream, {"error": f"not a member of swarm {self.swarm.swarm}: {exc.detail}"})
            return False

    async def _handle_probe(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(10):
                req = await read_frame(stream, 4096)
                if not await self.check_member(req, peer, stream):
                    return
                target = peer_str(req["target"])
                timeout = min(5.0, max(0.05, float(req.get("timeout", 1.0))))
                if target not in self.view():  # members only: a probe must not make us dial just anyone
                    await write_frame(stream, {"ack": False})
                    return
                rtt = await self._ping(target, timeout)
                await write_frame(stream, {"ack": rtt is not None})
        except FrameTooLarge as exc:
            self.reject("too_large", str(peer), f"probe request: {exc}")
        except (PeerError, Invalid, KeyError, TypeError, ValueError, trio.TooSlowError) as exc:
            self.reject("malformed", str(peer), f"probe request: {exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)

    # --- push-pull sync -----------------------------------------------------------------

    def _sync_payload(self) -> dict[str, Any]:
        """What a sync sends once the other side proved membership: every record we hold, our
        claims about members down, and the revocations we know."""
        view = self.view()
        records = [m.record.blob for m in view]
        if self.own_record is not None:
            records.append(self.own_record.blob)
        return {"records": records, "claims": self.core.down_claims(), "revoked": self.admission.for_sync()}

    def _apply_sync(self, payload: Any, peer: ID) -> bool:
        """Merge a member's sync payload; True when it made us refute (the peer holds us suspect
        or dead, so it should get our new record at once rather than by gossip it may not be
        part of yet)."""
        if not isinstance(payload, dict) or not isinstance(payload.get("records", []), list) \
                or not isinstance(payload.get("claims", []), list):
            self.reject("malformed", str(peer), "sync payload: expected {records: [...], claims: [...]}")
            return False
        seq = self.core.seq
        self.admission.merge(payload.get("revoked"), str(peer))
        view = self.view()
        known = {m.record.blob for m in view} | ({self.own_record.blob} if self.own_record is not None else set())
        records = payload.get("records", [])
        chosen = select_sync_records(records, known, len(view))
        if len(records) > max_records(len(view)) and len(chosen) >= max_records(len(view)):
            self.reject("sync_records", str(peer), f"sync payload: {len(records)} records for a view of {len(view)}; "
                                                   f"{len(chosen)} read")
        for blob in chosen:
            try:
                msg = self.verifier.decode(blob, time.time())  # type: ignore[union-attr]
            except Invalid as exc:
                self.reject(exc.reason, str(peer), exc.detail)
                continue
            self._accept(msg)
        mine = []
        for c in payload.get("claims", [])[:MAX_CLAIMS]:
            if not (isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and isinstance(c[1], str)
                    and isinstance(c[2], int) and not isinstance(c[2], bool)):
                self.reject("malformed", str(peer), f"sync claim {str(c)[:100]}: expected [peer, state, inc]")
                continue
            if c[0] == self.me:
                mine.append((c[0], c[1], c[2]))
        for (_, state, inc), result in zip(mine, self.core.claims(trio.current_time(), mine, by=str(peer))):
            if result in REFUSED:
                self.reject(result, str(peer), f"sync claim: this node {state} at incarnation {inc}")
        self._input()
        return self.core.seq != seq

    def _peer_is_member(self, hello: Any, peer: ID) -> bool:
        """The sync responder's first frame: its certificate, checked before we read its view."""
        if isinstance(hello, dict) and "error" in hello:  # it does not take us for a member (expired?)
            self.admission.merge(hello.get("revoked"), str(peer))  # revoked while we were away: learn it
            if self._logged.first(("refused", str(peer)), time.monotonic()):
                log.warning("sync refused", peer=str(peer), error=str(hello["error"])[:300])
            return False
        try:
            cert = check_cert(hello.get("cert") if isinstance(hello, dict) else None,
                              owner_public=self.swarm.owner_public, swarm=self.swarm.swarm, peer=peer.to_bytes(),
                              now=time.time())
        except Invalid as exc:
            self.reject("not_member", str(peer), f"sync answer: {exc.detail}")
            return False
        if (why := self.admission.refuses(str(peer))) is not None or str(peer) in self._excluded:
            self.reject("revoked", str(peer), why or self._excluded[str(peer)])
            return False
        self._checked_member(str(peer), cert)
        return True

    async def _sync_once(self, pid: ID) -> str:
        stream = await open_stream(self.host, pid, SYNC_PROTOCOL)
        try:
            await write_frame(stream, {"cert": self.swarm.cert.blob})
            if not self._peer_is_member(await read_frame(stream, MAX_SMALL_FRAME), pid):
                return "refused"
            theirs = await read_frame(stream, MAX_SYNC_FRAME)
            await write_frame(stream, self._sync_payload())
        finally:
            await close_quietly(stream)
        return "refuted" if self._apply_sync(theirs, pid) else "done"

    async def _sync(self, peer: str) -> None:
        if peer in self._excluded:
            return
        self._syncing.add(peer)
        pid = ID.from_base58(peer)
        started, outcome = trio.current_time(), "timeout"
        try:
            with trio.move_on_after(SYNC_TIMEOUT):
                await self._ensure_connected(pid)
                for _ in range(2):  # once more if we had to refute: the peer still holds us down
                    outcome = await self._sync_once(pid)
                    if outcome != "refuted":
                        break
        except PeerError as exc:
            outcome = str(exc)
        except Exception as exc:  # a frame too large, a bad answer
            outcome = "rejected"
            self.reject("sync", peer, f"{exc.__class__.__name__}: {exc}")
        finally:
            self._syncing.discard(peer)
            log.debug("sync", peer=peer, outcome=outcome, s=round(trio.current_time() - started, 3))

    async def _hang_up(self, pid: ID) -> None:
        """Close what we hold to a member gone dead or left. Were it only cut off, its TCP
        connection would be stuck in retransmit backoff, and gossip and syncs sent on it after a
        heal would wait many seconds; a fresh dial gets through in one round trip."""
        await self.pinger.forget(pid)
        if pid in self.host.get_connected_peers() and (proof := self.admission.proof_of_revocation(str(pid))):
            with trio.move_on_after(2):  # a revoked member learns it now, not when its syncs start failing
                await self._tell_revoked(pid, proof)
        if pid in self.host.get_connected_peers():
            with trio.move_on_after(1):
                try:
                    await self.host.disconnect(pid)
                except Exception as exc:
                    log.debug("disconnect failed", peer=str(pid), error=f"{exc.__class__.__name__}: {exc}")

    async def _tell_revoked(self, pid: ID, proof: list[bytes]) -> None:
        """A sync hello that carries the peer's own revocation and ends there (``bye``)."""
        assert self.swarm is not None
        try:
            stream = await open_stream(self.host, pid, SYNC_PROTOCOL)
        except PeerError:
            return
        try:
            await write_frame(stream, {"cert": self.swarm.cert.blob, "revoked": proof, "bye": True})
        except PeerError:
            pass
        finally:
            await close_quietly(stream)

    async def _handle_sync(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(SYNC_TIMEOUT * 2):
                hello = await read_frame(stream, MAX_SMALL_FRAME)  # nothing large before the certificate
                if not await self.check_member(hello, peer, stream):
                    return
                if hello.get("bye") is True:  # a member that just revoked us tells us so, and goes
                    self.admission.merge(hello.get("revoked"), str(peer))
                    return
                await write_frame(stream, {"cert": self.swarm.cert.blob})
                await write_frame(stream, self._sync_payload())
                theirs = await read_frame(stream, MAX_SYNC_FRAME)
                if self._apply_sync(theirs, peer) and str(peer) not in self._syncing and self._nursery:
                    self._nursery.start_soon(self._sync, str(peer))  # our answer carried the record it refuted
        except FrameTooLarge as exc:
            self.reject("too_large", str(peer), f"sync request: {exc}")
        except Exception as exc:
            self.reject("sync", str(peer), f"sync request: {exc.__class__.__name__}: {exc}")
        finally:
            await close_quietly(stream)

    # --- connections, bootstrap, capacity -----------------------------------------------

    async def _connection_events(self) -> None:
        assert self.core is not None
        gated: set[ID] = set()
        async for kind, pid in self._events_recv:
            peer = str(pid)
            if kind == "disconnected":
                if pid not in self.host.get_connected_peers():
                    self._checked.pop(peer, None)
                    if self._pubsub is not None:
                        self._pubsub.forget(pid)
                    self.core.connection_lost(trio.current_time(), peer)
                    self._input()
                continue
            if pid not in gated and self._nursery:
                gated.add(pid)
                self._nursery.start_soon(self._gate, pid, gated)
            if peer not in self.view() and peer not in self._syncing and peer not in self._excluded \
                    and self._nursery:
                self._nursery.start_soon(self._sync, peer)  # a new peer: exchange views at once

    def is_member(self, peer: str) -> bool:
        """Whether ``peer`` (authenticated by its connection) showed a valid certificate of the
        swarm: in a sync's hello, or in a record of the view; not revoked nor excluded."""
        if peer in self._excluded or self.admission.refuses(peer) is not None:
            return False
        now = time.time()
        if self._checked.get(peer, 0.0) > now:
            return True
        m = self.view().get(peer)
        return m is not None and m.record.cert.expires > now

    def _checked_member(self, peer: str, cert: Cert) -> None:
        if peer in self._excluded or self.admission.refuses(peer) is not None:
            return
        self._checked[peer] = cert.expires
        if self._pubsub is not None:
            self._pubsub.admit(ID.from_base58(peer))

    async def _gate(self, pid: ID, gated: set[ID]) -> None:
        """A connected peer gets pubsub from us once it is a member, and is disconnected if it
        does not show it within GATE_TIMEOUT (the sync started on connect is how a member does)."""
        peer = str(pid)
        try:
            with trio.move_on_after(GATE_TIMEOUT):
                while not self.is_member(peer):
                    if pid not in self.host.get_connected_peers():
                        return
                    await trio.sleep(GATE_POLL)
                if self._pubsub is not None:
                    self._pubsub.admit(pid)
                return
            if pid in self.host.get_connected_peers():
                why = self.admission.refuses(peer) or self._excluded.get(peer)
                self.reject("unchecked", peer, why or f"no valid certificate of this swarm shown within "
                                                      f"{GATE_TIMEOUT:g} s; disconnected")
                await self._hang_up(pid)
        finally:
            gated.discard(pid)

    async def _dial_bootstrap(self, addr: str) -> None:
        info = info_from_p2p_addr(Multiaddr(addr))
        delay = 0.5
        while str(info.peer_id) not in self.view():
            try:
                with trio.move_on_after(JOIN_TIMEOUT):
                    await self.host.connect(info)
                    await self._sync(str(info.peer_id))
            except Exception:
                pass
            if str(info.peer_id) in self.view():
                return
            await trio.sleep(self.rng.uniform(0, delay))
            delay = min(30.0, delay * 2)

    async def _sample_capacity(self) -> None:
        while True:
            await trio.sleep(SAMPLE_INTERVAL)
            self.resources = await trio.to_thread.run_sync(self.collector.sample)
            if self.resources.significant_change(self.advertised) and self.core is not None:
                self.core.local_change(trio.current_time())
                self._input()

    def _view_changed(self) -> None:
        self.view_changed.set()
        self.view_changed = trio.Event()

    def readvertise(self) -> None:
        """Something in this node's record changed (labels, mesh key or address): publish it."""
        if self.core is not None:
            self.core.local_change(trio.current_time())
            self._input()

    def set_labels(self, labels: dict[str, str]) -> None:
        self.labels = dict(labels)
        self.readvertise()


def _parses(addr: str) -> bool:
    try:
        Multiaddr(addr)
        return True
    except Exception:
        return False


def _cause(exc: BaseException) -> str:
    """The innermost reason of a dial failure (py-libp2p wraps it in several layers, one of
    them a MultiError holding one error per address)."""
    seen: list[str] = []
    while exc is not None and len(seen) < 8:
        seen.append(f"{exc.__class__.__name__}: {exc}"[:120])
        errors = getattr(exc, "errors", None)
        exc = exc.__cause__ or exc.__context__ or (errors[0] if errors else None)
    return " <- ".join(seen)
