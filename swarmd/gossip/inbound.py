"""Gossip from the swarm topic: checked before it is passed on, then merged into the core.

Each message meets three steps, in py-libp2p pubsub's order:

1. ``quiet_drop``, before validation (pubsub.GatedPubsub.quiet_drop): what an honest relay
   may well forward because it depends on this node's own view is dropped, not passed on,
   and not held against the relay: a record over its publisher's rate (``RECORD_RATE``,
   ``RECORD_BURST``), a record this view refuses (a revoked signer, a WireGuard key another
   member holds here), a rumor about an incarnation of ours we never issued. Penalizing the
   relay (the validator's 10 points per message) would let one member's burst of lies make
   honest members graylist each other and split the gossip mesh.
2. ``validate``: what every node judges alike (a bad signature, a malformed body) fails
   validation, and costs the forwarder.
3. ``read``: each delivered message is merged (``accept``): a revocation goes to
   admission, a record or rumor to the core. A new record's addresses replace those its
   peer had in the peerstore. A failure here (a disk error saving a revocation, a bug) is
   counted and the next message is read.

Verifier.decode (its signature checks) runs once per message for all three steps: the
decoded message is kept by a digest of its bytes, the last ``DECODED_KEEP`` of them, for
``DECODED_FOR`` seconds (pubsub validates in its own task, and the subscription is read
later; the same bytes arriving again later, a replay, are checked afresh: a record may
have expired meanwhile). Every refusal is counted
under its reason (p2p/rejects.py); the core's refusals (``REFUSED``) too.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from ..p2p.limits import TokenBuckets
from ..p2p.signed import Invalid
from .membership import REFUSED, State
from .revocation import Revocation
from .state import Shared
from .wire import MeshInfo, Record, Rumor

ADDR_TTL = 3600
# Valid records per publisher: an honest member publishes on a change and its refresh; the
# burst covers a restart or a partition heal. The excess is dropped, not passed on, counted
# ``record_rate``, and not held against the member that relayed it.
RECORD_RATE, RECORD_BURST = 4.0, 20.0
DECODED_KEEP = 256  # messages decoded by the validator, kept until the subscription reads them
DECODED_FOR = 5.0  # seconds: from validation to the read is milliseconds; a replay is decoded again


class Inbound:
    """Wired by service.py: ``revoked`` takes a checked revocation (admission), ``refuse_record``
    says why a record must not enter the view (admission), ``acted`` lets the core act on what
    was merged (loop.input), ``mesh_info`` is this node's side of the mesh (its WireGuard key)."""

    def __init__(self, shared: Shared, *, revoked: Callable[[Revocation], None],
                 refuse_record: Callable[[Record, Iterable[tuple[str, bytes]]], tuple[str, str] | None],
                 acted: Callable[[], None], mesh_info: Callable[[], MeshInfo | None]) -> None:
        self.s = shared
        self._revoked, self._refuse_record, self._acted, self._mesh_info = revoked, refuse_record, acted, mesh_info
        self._record_rate = TokenBuckets(RECORD_RATE, RECORD_BURST)
        # digest of a message's bytes -> (decoded, when: time.monotonic())
        self._decoded: OrderedDict[bytes, tuple[Any, float]] = OrderedDict()

    def decode(self, data: bytes) -> Any:
        """Verifier.decode, once per message for quiet_drop, the validator and the read that
        follow it (protobuf hands out a new bytes each time: kept by a digest). A message that
        fails is not kept: the validator drops it, it is never read."""
        key = hashlib.blake2b(data, digest_size=16).digest()
        now = time.monotonic()
        if (kept := self._decoded.pop(key, None)) is not None and now - kept[1] <= DECODED_FOR:
            self._decoded[key] = kept
            return kept[0]
        decoded = self.s.verifier.decode(data, time.time())  # type: ignore[union-attr]
        self._decoded[key] = (decoded, now)
        if len(self._decoded) > DECODED_KEEP:
            self._decoded.popitem(last=False)
        return decoded

    def quiet_drop(self, forwarder: ID, msg: Any) -> bool:
        """Whether to drop ``msg`` before validation without counting it against ``forwarder``."""
        s = self.s
        try:
            decoded = self.decode(msg.data)
        except Invalid:
            return False  # the validator counts it
        if isinstance(decoded, Rumor):
            if s.core is not None and (why := s.core.screen(decoded)):
                s.reject(why, decoded.sender, f"{decoded.kind} rumor about this node at incarnation "
                                              f"{decoded.incarnation}")
                return True
            return False
        if not isinstance(decoded, Record) or decoded.peer == s.me:
            return False
        if self.refused(decoded):
            return True
        if self._record_rate.allow(decoded.peer, trio.current_time()):
            return False
        s.reject("record_rate", decoded.peer,
                 f"more than {RECORD_RATE:g} records/s (burst {RECORD_BURST:g}); record seq {decoded.seq} dropped")
        return True

    def validate(self, forwarder: ID, msg: Any) -> bool:
        try:
            self.decode(msg.data)
        except Invalid as exc:
            self.s.reject(exc.reason, str(forwarder), exc.detail)
            return False
        return True

    async def read(self, subscription: Any) -> None:
        while True:
            msg = await subscription.get()
            self.s.traffic.carried("in", len(msg.data))
            try:
                decoded = self.decode(msg.data)
            except Invalid:
                continue  # counted by the validator
            try:
                self.accept(decoded)
            except Exception as exc:  # a disk error saving a revocation, a bug: the next message is read
                sender = getattr(decoded, "peer", None) or getattr(decoded, "sender", "?")
                self.s.rejects.internal("handler", str(sender), f"gossip {decoded.__class__.__name__}", exc)

    def accept(self, msg: Record | Rumor | Revocation) -> str:
        """Merge a verified message; the core's result (or ``revocation``, ``refused``)."""
        s = self.s
        assert s.core is not None
        if isinstance(msg, Revocation):
            self._revoked(msg)
            return "revocation"
        if isinstance(msg, Record):
            if self.refused(msg):
                return "refused"
            result = s.core.receive_record(trio.current_time(), msg, time.time())
            self.merged(msg, result)
        else:
            result = s.core.receive_rumor(trio.current_time(), msg)
            if result in REFUSED:
                s.reject(result, msg.sender, f"{msg.kind} rumor about {msg.about} at incarnation {msg.incarnation}")
        self._acted()
        return result

    def refused(self, record: Record, keys: list[tuple[str, bytes]] | None = None) -> bool:
        """Whether admission refuses ``record`` (counted), given the WireGuard keys held (``keys``;
        by default those of this node and the view)."""
        if refused := self._refuse_record(record, self.wg_keys() if keys is None else keys):
            self.s.reject(refused[0], record.peer, refused[1])
            return True
        return False

    def merged(self, record: Record, result: str) -> None:
        """Count what the core said of ``record``; a newer record's addresses replace its old ones."""
        s = self.s
        if result == "old":  # a replay, or overtaken in flight
            s.rejects.count("old_seq")
        elif result in REFUSED:
            s.reject(result, record.peer, f"record seq {record.seq}")
        if result in ("new", "updated"):
            addrs = dial_addrs(record)
            if addrs and record.peer != s.me:  # the record's addresses replace the ones it replaces
                store, pid = s.host.get_peerstore(), ID.from_base58(record.peer)
                store.clear_addrs(pid)
                store.add_addrs(pid, addrs, ADDR_TTL)
            s.changed()

    def wg_keys(self) -> list[tuple[str, bytes]]:
        """(peer, WireGuard key) of this node and the members in the view that advertise one."""
        own = self._mesh_info()
        return [(m.peer, m.record.wg.public) for m in self.s.view()
                if m.record.wg is not None and m.state in (State.ALIVE, State.SUSPECT)] + \
            ([(self.s.me, own.public)] if own is not None else [])


def parses(addr: str) -> bool:
    try:
        Multiaddr(addr)
        return True
    except Exception:
        return False


def dial_addrs(record: Record) -> list[Multiaddr]:
    """Where to dial a member: the addresses its signed record announces; a member nobody
    can dial at its underlay (behind a NAT or a firewall, wg/reach.py) announces none and is
    dialled at its overlay address instead, which works once our WireGuard reaches it
    (punched or relayed)."""
    addrs = [Multiaddr(a) for a in record.addrs if parses(a)]
    wg = record.wg
    if not addrs and wg is not None and wg.tcp is not None:
        addrs = [Multiaddr(f"/ip4/{wg.addr4}/tcp/{wg.tcp}")]
    return addrs
