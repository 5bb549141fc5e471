"""The relay's bookkeeping: which pairs of members this node forwards for, on which port (sans-IO).

A relay forwards the WireGuard packets of a pair of members {A, B} as they are, in the
kernel (routing/nft.py writes the rules, routing/forwarder.py applies them): A sends to
R:P, the kernel hands the datagram on to B's WireGuard port with R:P as its source, and
B's answers go back the same way. It never holds the pair's keys; what it grants is
bandwidth and a port. This module decides who gets them.

Rules (every value in an `End` came from a member, and a member may be hostile):
- A pair is forwarded only when *both* ends asked (each with a signed request, checked by
  the driver and request.py) and both leases are unexpired: one member cannot aim the
  relay at another that did not ask. `End.ip` is where the end's request came from (its
  libp2p connection's remote address), never a value it wrote, so an end cannot aim the
  relay at an address it does not hold; `End.wg_port` is the port its WireGuard packets
  were proven to come from at that address (server.py: the relay's own WireGuard device
  saw them authenticate, Routing.proven), never its record's, so the relay aims a pair's
  datagrams only at a socket holding the end's WireGuard key (or the NAT mapping in front
  of it), not at any port of the host the end asked from (issue 23 finding 11).
- Addresses: IPv4 only; an end's ip must be a unicast host address of another host (not
  loopback, link-local, multicast, broadcast, 0.0.0.0/8, 240.0.0.0/4, one of this node's
  own, nor inside `exclude`, the overlay), and `via_ip` one of this node's own addresses
  (`set_addresses`). An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`: how a dual-stack socket
  shows an IPv4 peer) is that IPv4 address; any other IPv6 address is refused (`ipv6`: the
  rules are an `ip` table). Two ends at one address cannot be told apart by the rules (they
  match on the source address): refused. Ports 1-65535.
- Nobody pairs with itself or with the relay; both ends must be members (`is_member`).
- Caps: a member holds at most `max_per_member` leases (a lease counts only for the member
  that asked, so nobody can use up another member's share by naming it), the relay at most
  `max_pairs` active pairs and never more than its port range.
- Pending pairs (one end asked, the other not yet) have caps of their own, small ones: a
  member may open at most `max_pending_per_member` of them and the relay holds at most
  `max_pending`, and a pending pair lasts `pending` seconds (15) from its first request,
  renewed or not, unless the other end asks. A few members naming arbitrary others cannot
  fill the relay (only active pairs count towards `max_pairs`), and a pair that falls back
  to one end (the other released or expired) is pending again, with the same limit.
- `End.edm`: the end's record says its NAT maps per destination (symmetric): the rules aim no
  flow at its proven port (nft.py); two such ends are paired by learning each one's port.
- `End.pinned`: the end is not behind a NAT (the driver sets it when the request's address is
  one of the end's record's endpoints), so its WireGuard packets come from `ip:wg_port`,
  and the rules accept nothing else from it (nft.py: no flow squatting from another port of
  its address).
- Rule changes are rate-limited per member: each request or release that changes `active()`
  (a pair activated, an end of an active pair that moved, an active pair released) costs the
  member that sent it a token (`change_burst` held, `change_rate` a second); without one it is
  refused (`rate_limited`) and nothing changes. Each change asks for an `nft -f` and a
  conntrack flush on this host, so two colluding members toggling their own pair could
  otherwise keep the relay busy rewriting its rules. This bounds each member only: k
  colluding members make k times as many changes, and expiries cost nobody a token; the
  driver bounds the whole relay (server.APPLY_MIN_GAP: changes within it go into one write).
  A renewal that changes nothing costs nothing and is never refused by it; nor is opening a
  pending pair (no rule changes). At most `MAX_LIMITED` members' buckets are kept (least
  recently used dropped: a dropped bucket comes back full, which only ever lets a member
  through).
- Leases last `lease` seconds from the last request (the driver renews every 20 s); their
  length is the relay's, never the requester's. An expired lease, a release, a member that
  is gone (`end_member`) or an address of ours that went away (`set_addresses`) takes the
  end out; a pair nobody holds frees its port.
- A pair keeps its port while anyone holds it (both ends send to the same R:P). A freed
  port goes to the back of the free list (least recently used first), so a port is not
  handed to a new pair while the old pair's conntrack entries may still be alive (the
  forward rules drop those anyway: they check the pair's addresses, nft.py).

Time is the driver's monotonic `now`, in seconds. `version` grows whenever `active()`
changes: the driver re-applies the rules then.
"""

from __future__ import annotations

import ipaddress
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..p2p.limits import TokenBuckets

PORTS = (51821, 52820)  # default relay_ports: one UDP port per relayed pair, above WireGuard's 51820
MAX_PAIRS = 64  # pairs at once; each is two nat rules and one forward rule
MAX_PER_MEMBER = 16  # leases one member may hold (paths.MAX_RELAYED: the relayed peers a node keeps)
MAX_PENDING = 16  # pending pairs (one end asked) the relay holds at once
MAX_PENDING_PER_MEMBER = 2  # pending pairs one member may open at once
PENDING = 15.0  # seconds a pending pair waits for its other end (sessions.PENDING_LIMIT: the end gives up then too)
LEASE = 60.0  # seconds; renewed every 20 s, so two lost renewals are survived
MAX_PEER_ID = 128  # characters; a libp2p peer id is about 52
# Rule changes one member may make (each is one `nft -f` here). An honest node changes a pair's
# rules when path choice moves it (3 rounds to switch, a 60 s hold-down after a failure) or its
# address changes; renewals (every 20 s) change nothing and cost nothing.
CHANGE_BURST = 32.0  # 2 x MAX_PER_MEMBER: all of a node's 16 pairs moved off this relay and back at once
CHANGE_RATE = 1.0  # a second after that: each of 16 pairs moved on and off every 32 s; a member toggling
# its pair makes at most one change a second (k members: k), and the server writes the rules at most
# once per server.APPLY_MIN_GAP whoever changes them: 5 `nft -f` a second for the whole relay
MAX_LIMITED = 1024  # members whose change buckets are kept (only members holding a lease here make changes)

REASONS = ("malformed", "not_member", "self_pair", "bad_address", "not_our_address", "same_address",
           "member_limit", "pending_limit", "full", "ipv6", "rate_limited")

_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")


@dataclass(frozen=True, slots=True, kw_only=True)
class End:
    """One end of a relayed pair, as the relay sees it."""

    peer: str  # its peer id (the request's signer)
    ip: str  # where its request came from: the connection's remote IPv4 address (or IPv4-mapped IPv6)
    wg_port: int  # the port its WireGuard packets come from at `ip`, as the relay's WireGuard proved it
    via_ip: str  # this relay's IPv4 address it sends to (one it announces; maybe not local: 1:1 NAT)
    pinned: bool = False  # not NATed: its packets come from ip:wg_port, and only those are relayed
    edm: bool = False  # behind a symmetric NAT (its record's wg.nat): a new port per destination, so its
    # packets to the relay port come from another port than wg_port (nft.py: no flow is aimed at wg_port)


@dataclass(frozen=True, slots=True)
class Pair:
    """An active pair: both ends asked. `a.peer < b.peer`."""

    port: int
    a: End
    b: End


@dataclass(frozen=True, slots=True)
class Grant:
    port: int  # the pair's port on the relay (at the end's via_ip)
    active: bool  # both ends hold a lease: the kernel forwards now
    expires: float  # when this end's lease ends unless renewed


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str  # one of REASONS: the metric label
    detail: str  # for the requester and the log


def ipv4_host(value: object, where: str) -> ipaddress.IPv4Address:
    """`value` as a unicast IPv4 address some host can hold; ValueError naming what is wrong."""
    ip = parse_ipv4(value, where)
    check_host(ip, where)
    return ip


def parse_ipv4(value: object, where: str) -> ipaddress.IPv4Address:
    if not isinstance(value, str) or len(value) > 15:
        raise ValueError(f"{where}: {value!r:.40} is not an IPv4 address")
    try:
        return ipaddress.IPv4Address(value)
    except ValueError:
        raise ValueError(f"{where}: {value!r:.40} is not an IPv4 address") from None


def check_host(ip: ipaddress.IPv4Address, where: str) -> None:
    """Private addresses are fine (a LAN swarm, the lab); loopback, link-local, multicast,
    broadcast, "this network" and reserved ones are no host's to relay to
    (gossip/wire.Verifier.check_ip's idea)."""
    why = ("loopback" if ip.is_loopback else
           "link-local" if ip.is_link_local else
           "multicast" if ip.is_multicast else
           "unspecified" if ip in _THIS_NETWORK else
           "broadcast or reserved" if ip.is_reserved or ip == ipaddress.IPv4Address("255.255.255.255") else None)
    if why is not None:
        raise ValueError(f"{where}: {ip} is {why}")


def unmap(value: object) -> object:
    """An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`, how a dual-stack socket shows an IPv4
    peer) as the IPv4 address it is; anything else as it is."""
    if isinstance(value, str) and ":" in value and len(value) <= 64:
        try:
            mapped = ipaddress.IPv6Address(value).ipv4_mapped
        except ValueError:
            return value
        if mapped is not None:
            return str(mapped)
    return value


def is_ipv6(value: object) -> bool:
    if not isinstance(value, str) or len(value) > 64:
        return False
    try:
        ipaddress.IPv6Address(value)
    except ValueError:
        return False
    return True


def port_number(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise ValueError(f"{where}: {value!r:.20} is not a port (1-65535)")
    return value


@dataclass(slots=True)
class _Slot:
    port: int
    ends: dict[str, tuple[End, float]] = field(default_factory=dict)  # peer -> (its End, lease expiry)
    pending_until: float | None = None  # with one end: when the pair goes unless the other end asked


class Relay:
    """Pairs this node relays for, their ports and leases."""

    def __init__(self, me: str, *, is_member: Callable[[str], bool], addresses: Iterable[str] = (),
                 exclude: Iterable[str] = (), ports: tuple[int, int] = PORTS, max_pairs: int = MAX_PAIRS,
                 max_per_member: int = MAX_PER_MEMBER, lease: float = LEASE, max_pending: int = MAX_PENDING,
                 max_pending_per_member: int = MAX_PENDING_PER_MEMBER, pending: float = PENDING,
                 change_burst: float = CHANGE_BURST, change_rate: float = CHANGE_RATE) -> None:
        low, high = ports
        port_number(low, "ports")
        port_number(high, "ports")
        if low > high:
            raise ValueError(f"ports: {low}-{high} is empty")
        if not (max_pairs >= 1 and max_per_member >= 1 and lease > 0 and max_pending >= 1
                and max_pending_per_member >= 1 and pending > 0 and change_burst >= 1 and change_rate > 0):
            raise ValueError("max_pairs, max_per_member, lease, the pending limits and the change rate must be "
                             "positive")
        self.me = me
        self.is_member = is_member
        self.exclude = tuple(ipaddress.IPv4Network(n, strict=False) for n in exclude)
        self.max_pairs = max_pairs
        self.max_per_member = max_per_member
        self.lease = lease
        self.max_pending = max_pending
        self.max_pending_per_member = max_pending_per_member
        self.pending_for = pending
        self._changes = TokenBuckets(change_rate, change_burst, size=MAX_LIMITED)  # per member: rule changes
        self.version = 0
        self._now = float("-inf")  # the latest time seen (end_member, set_addresses have none)
        self._addresses: frozenset[ipaddress.IPv4Address] = frozenset()
        self._free: deque[int] = deque(range(low, high + 1))
        self._slots: dict[frozenset[str], _Slot] = {}
        self.set_addresses(addresses)

    # --- what the driver reads -------------------------------------------------------------

    @property
    def pairs(self) -> int:
        """Pairs holding a port (pending ones, with one end, included)."""
        return len(self._slots)

    @property
    def pending(self) -> int:
        """Pairs with one end: waiting for the other."""
        return sum(len(slot.ends) == 1 for slot in self._slots.values())

    @property
    def ports_free(self) -> int:
        return len(self._free)

    def active(self) -> tuple[Pair, ...]:
        """The pairs both ends hold, by port: what the kernel forwards."""
        out = []
        for slot in self._slots.values():
            if len(slot.ends) == 2:
                a, b = sorted((end for end, _ in slot.ends.values()), key=lambda e: e.peer)
                out.append(Pair(slot.port, a, b))
        return tuple(sorted(out, key=lambda p: p.port))

    def next_deadline(self) -> float | None:
        return min([expires for slot in self._slots.values() for _, expires in slot.ends.values()]
                   + [s.pending_until for s in self._slots.values() if s.pending_until is not None], default=None)

    def rows(self, now: float) -> list[dict]:
        rows = []
        for key, slot in sorted(self._slots.items(), key=lambda kv: kv[1].port):
            a, b = sorted(key)
            row = {"port": slot.port, "a": a, "b": b, "active": len(slot.ends) == 2}
            for name, peer in (("a", a), ("b", b)):
                end, expires = slot.ends.get(peer, (None, None))
                row[f"{name}_ip"] = end.ip if end else None
                row[f"{name}_expires_in"] = round(expires - now, 1) if expires is not None else None
            rows.append(row)
        return rows

    # --- events ----------------------------------------------------------------------------

    def set_addresses(self, ips: Iterable[str]) -> bool:
        """This node's own IPv4 addresses (the ones ends may send to). An end whose via_ip is
        no longer one of them loses its lease. True if `active()` changed."""
        self._addresses = frozenset(ipv4_host(ip, "own address") for ip in ips)
        return self._drop(lambda end, expires: ipaddress.IPv4Address(end.via_ip) not in self._addresses)

    def request(self, now: float, end: End, other: str) -> Grant | Refused:
        """`end` asks (or renews) relaying between itself and `other`."""
        self.expire(now)
        try:
            ip, via = self._check(end, other)
        except _Refuse as why:
            return Refused(why.reason, why.detail)
        key = frozenset((end.peer, other))
        slot = self._slots.get(key)
        if slot is not None and other in slot.ends and slot.ends[other][0].ip == str(ip):
            return Refused("same_address", f"{end.peer} and {other} are both at {ip}: the relay tells ends apart "
                                           "by their address")
        if slot is None or end.peer not in slot.ends:
            held = sum(end.peer in s.ends for s in self._slots.values())
            if held >= self.max_per_member:
                return Refused("member_limit", f"{end.peer} already holds {held} relayed pairs here, the limit "
                                               f"is {self.max_per_member}")
        if slot is None:
            if self.pending >= self.max_pending or not self._free:
                return Refused("full", f"this relay holds {self.pending} pairs waiting for their other end and "
                                       f"{len(self._free)} free ports")
            opened = sum(list(s.ends) == [end.peer] for s in self._slots.values())
            if opened >= self.max_pending_per_member:
                return Refused("pending_limit", f"{end.peer} already has {opened} pairs here whose other end has "
                                                f"not asked, the limit is {self.max_pending_per_member}")
            slot = self._slots[key] = _Slot(self._free.popleft())
        elif end.peer not in slot.ends and len(self.active()) >= self.max_pairs:
            return Refused("full", f"this relay forwards for {len(self.active())} pairs, its limit")
        new = End(peer=end.peer, ip=str(ip), wg_port=end.wg_port, via_ip=str(via), pinned=end.pinned, edm=end.edm)
        held = slot.ends.get(end.peer)
        if other in slot.ends and (held is None or held[0] != new) and not self._changes.allow(end.peer, now):
            return self._rate_limited(end.peer)  # (a slot made just now has no `other`: none is left behind)
        before = self.active()
        expires = now + self.lease
        slot.ends[end.peer] = (new, expires)
        self._settle()
        self._changed(before)
        if slot.pending_until is not None:
            expires = min(expires, slot.pending_until)
        return Grant(slot.port, len(slot.ends) == 2, expires)

    def release(self, now: float, peer: str, other: str) -> bool | Refused:
        """`peer` stopped using its pair with `other`. True if `active()` changed; Refused
        (`rate_limited`) when it would end an active pair and `peer` has made too many changes:
        its lease then runs on."""
        changed = self.expire(now)
        slot = self._slots.get(frozenset((peer, other)))
        if slot is None or peer not in slot.ends:
            return changed
        if len(slot.ends) == 2 and not self._changes.allow(peer, now):
            return self._rate_limited(peer)
        before = self.active()
        del slot.ends[peer]
        self._settle()
        return self._changed(before) or changed

    def end_member(self, peer: str) -> bool:
        """`peer` is no member any more (dead, left, revoked): every pair with it goes."""
        before = self.active()
        for key in [key for key in self._slots if peer in key]:
            self._slots[key].ends.clear()
        self._settle()
        return self._changed(before)

    def expire(self, now: float) -> bool:
        """Leases that ended by `now` go, and pending pairs whose other end did not ask in time.
        True if `active()` changed."""
        self._now = max(self._now, now)
        for slot in self._slots.values():
            if slot.pending_until is not None and slot.pending_until <= now:
                slot.ends.clear()
        return self._drop(lambda end, expires: expires <= now)

    # --- inside ----------------------------------------------------------------------------

    def _rate_limited(self, peer: str) -> Refused:
        return Refused("rate_limited", f"{peer} changes this relay's forwarding rules too often: at most "
                                       f"{self._changes.burst:g} changes at once, then {self._changes.rate:g} a "
                                       "second (renewals that change nothing are free)")

    def _check(self, end: End, other: str) -> tuple[ipaddress.IPv4Address, ipaddress.IPv4Address]:
        if not isinstance(end, End):
            raise _Refuse("malformed", "not an End")
        for name, peer in (("peer", end.peer), ("other", other)):
            if not isinstance(peer, str) or not 0 < len(peer) <= MAX_PEER_ID:
                raise _Refuse("malformed", f"{name}: {peer!r:.40} is not a peer id")
        if end.peer == other or self.me in (end.peer, other):
            raise _Refuse("self_pair", "a pair of a member with itself or with the relay")
        try:
            port_number(end.wg_port, "wg_port")
            if not isinstance(end.pinned, bool) or not isinstance(end.edm, bool):
                raise ValueError(f"pinned, edm: {end.pinned!r:.20}, {end.edm!r:.20} are not bools")
            if end.pinned and end.edm:
                raise ValueError("pinned and edm: an end asking from an address of its record is not NATed")
            address = unmap(end.ip)
            if is_ipv6(address):
                raise _Refuse("ipv6", f"the requester's address {address} is IPv6: relays forward IPv4 only")
            ip = parse_ipv4(address, "the requester's address")
            via = parse_ipv4(end.via_ip, "via_ip")
        except ValueError as exc:
            raise _Refuse("malformed", str(exc)) from None
        try:
            check_host(ip, "the requester's address")
            check_host(via, "via_ip")
        except ValueError as exc:
            raise _Refuse("bad_address", str(exc)) from None
        if ip in self._addresses:
            raise _Refuse("bad_address", f"the requester's address {ip} is this relay's own")
        for net in self.exclude:
            if ip in net:
                raise _Refuse("bad_address", f"the requester's address {ip} is inside {net}")
        if via not in self._addresses:
            raise _Refuse("not_our_address", f"via_ip {via} is not an address of this relay")
        for peer in (end.peer, other):
            if not self.is_member(peer):
                raise _Refuse("not_member", f"{peer} is not a member")
        return ip, via

    def _drop(self, gone: Callable[[End, float], bool]) -> bool:
        before = self.active()
        for slot in self._slots.values():
            for peer in [peer for peer, (end, expires) in slot.ends.items() if gone(end, expires)]:
                del slot.ends[peer]
        self._settle()
        return self._changed(before)

    def _settle(self) -> None:
        """A pair with one end is pending from now (its clock starts when it becomes so); a pair
        nobody holds frees its port."""
        for slot in self._slots.values():
            if len(slot.ends) == 2:
                slot.pending_until = None
            elif slot.pending_until is None:
                slot.pending_until = self._now + self.pending_for
        for key in [key for key, slot in self._slots.items() if not slot.ends]:
            self._free.append(self._slots.pop(key).port)  # to the back: least recently used first

    def _changed(self, before: tuple[Pair, ...]) -> bool:
        if self.active() == before:
            return False
        self.version += 1
        return True


class _Refuse(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail
