"""How this node is reached, measured by other members (sans-IO): the reach protocol's core.

A node cannot tell from inside whether anyone can dial it: its addresses may be a home
router's private ones, a firewall may drop what comes in. So it asks members that are
themselves publicly reachable (observers) what they see of it, and believes only what
more than one of them agrees on:

- ``wg``: the endpoint its WireGuard packets arrive from at the observer (the observer's own
  WireGuard device authenticated them, so it is where this node's packets really come
  from: the reflexive endpoint, STUN's "mapped address" without a STUN server);
- ``ip``: the address its libp2p connection to the observer comes from;
- ``dial``: whether the observer could open a *fresh* TCP connection back to this node's
  libp2p port at that address (py-libp2p's AutoNAT v1 reuses the connection the request
  came on, so it calls every node public: DESIGN), and find a libp2p listener there.

The verdict (``Reach.verdict``), from the latest observation of each observer within
``window`` seconds, needs ``quorum`` (2) observers for anything but ``unknown``:
- ``public``: ``quorum`` observers dialled back;
- ``firewall``: no observer could dial back, and the WireGuard endpoints they see are this
  node's own addresses and port (nothing translates, something drops what comes in): that
  endpoint is its reflexive one, punched like a NAT's;
- ``eim``: behind a NAT whose mapping is endpoint-independent: the observers see the same
  reflexive endpoint (a home router, most cloud NAT gateways). Members punch it. The two
  newest observations agreeing decide, else ``quorum`` observations of one port (one liar
  naming another is outvoted). Newest is by when an observer's endpoint for us last changed,
  then by when it answered: after a NAT rebinds, observers behind port-filtering NATs never
  see the new mapping and keep naming the old one in fresh answers (outnumbering the public
  observers that saw the move, until the window ends), so two that saw us move decide;
- ``edm``: endpoint-dependent mapping (a symmetric NAT): the observers see one address
  but different ports. The last one seen is announced as a hint (an address-restricted NAT
  on the other side opens for the address), but a port-restricted or symmetric peer needs
  a relay.

What an observer sees it signs (``seal_seen``): the observed node puts two of these
attestations in its record next to its reflexive endpoint, and a member aims WireGuard at
a reflexive endpoint only when ``quorum`` attestations from distinct members (not the
subject) name it (``confirmed``): a member cannot send the swarm's handshakes to an address
it does not hold, and one lying observer cannot move anyone's endpoint either.

Time is the caller's wall clock (attestations cross hosts), in seconds.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .endpoint import format_endpoint, split_endpoint
from ..p2p.signed import Invalid, Signer, field, peer_bytes, peer_key, peer_str, seal, unseal

KINDS = ("public", "eim", "edm", "firewall")  # what a record may say; no field: unknown
LABELS = {"public": "public", "eim": "behind NAT (endpoint-independent)", "edm": "behind NAT (symmetric)",
          "firewall": "behind a firewall", "unknown": "unknown (not yet measured by two members)"}
QUORUM = 2  # observers that must agree: one member can lie
WINDOW = 180.0  # seconds an observation counts; a mapping that changed is seen anew well within it
SEEN_TTL = 600.0  # seconds an attestation is believed by others (records are reissued far more often)
MAX_SEEN = 4  # attestations a record may carry
MAX_SEEN_BYTES = 512  # each: a signed map of an endpoint, two peer ids and a key is ~250 bytes
SEEN_KIND = "seen"


@dataclass(frozen=True, slots=True, kw_only=True)
class Seen:
    """One observer's view of one node at one time (each field checked on the way in)."""

    observer: str
    about: str
    wg: str | None  # "IP:port" its WireGuard packets came from, None if none reached the observer
    ip: str | None  # where its libp2p connection came from (None: over the overlay)
    dial: bool | None  # a fresh connection back succeeded; None: not tried
    at: float
    blob: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    kind: str  # one of KINDS, or "unknown"
    reflexive: str | None  # the endpoint to announce (eim, edm: a hint), else None
    confirmed_by: tuple[str, ...]  # the observers whose observations decided it
    seen: tuple[bytes, ...]  # their attestations, for the record

    @property
    def label(self) -> str:
        return LABELS[self.kind]


UNKNOWN = Verdict(kind="unknown", reflexive=None, confirmed_by=(), seen=())


def seal_seen(sign: Signer, *, swarm: str, observer: str, about: str, wgpub: bytes, wg: str | None,
              ip: str | None, dial: bool | None, at: float) -> bytes:
    body = {"k": SEEN_KIND, "swarm": swarm, "peer": peer_bytes(observer), "about": peer_bytes(about),
            "wgpub": wgpub, "wg": wg, "ip": ip, "dial": dial, "at": at}
    return seal(body, sign)


def open_seen(blob: object, *, swarm: str, about: str, wgpub: bytes | None = None, now: float,
              ttl: float = SEEN_TTL) -> Seen:
    """An attestation checked: signed by its observer, about ``about`` (and its WireGuard key
    ``wgpub`` when given), for this swarm, no older than ``ttl`` and not from the future,
    every field in range. Invalid otherwise."""
    if not isinstance(blob, bytes) or len(blob) > MAX_SEEN_BYTES:
        raise Invalid("malformed", f"an attestation is at most {MAX_SEEN_BYTES} bytes")
    body, raw, sig = unseal(blob)
    if body.get("k") != SEEN_KIND or body.get("swarm") != swarm:
        raise Invalid("malformed", "not an attestation for this swarm")
    observer = field(body, "peer", bytes, "seen")
    unseal(blob, peer_key(observer))
    subject = field(body, "about", bytes, "seen")
    if peer_str(subject) != about:
        raise Invalid("mismatch", "the attestation is about another member")
    if observer == subject:
        raise Invalid("mismatch", "a member cannot attest itself")
    key = field(body, "wgpub", bytes, "seen")
    if wgpub is not None and key != wgpub:
        raise Invalid("mismatch", "the attestation names another WireGuard key")
    at = float(field(body, "at", (int, float), "seen"))
    if not math.isfinite(at) or at > now + 30 or at < now - ttl:
        raise Invalid("stale", "the attestation is too old or from the future")
    wg = body.get("wg")
    if wg is not None:
        wg = _endpoint(wg, "seen.wg")
    ip = body.get("ip")
    if ip is not None:
        ip = _ip(ip, "seen.ip")
    dial = body.get("dial")
    if dial is not None and not isinstance(dial, bool):
        raise Invalid("malformed", "seen.dial: expected a bool")
    return Seen(observer=peer_str(observer), about=about, wg=wg, ip=ip, dial=dial, at=at, blob=blob)


def confirmed(blobs: Iterable[bytes], reflexive: str, *, swarm: str, about: str, wgpub: bytes, now: float,
              is_member: Callable[[str], bool], quorum: int = QUORUM) -> bool:
    """Whether ``quorum`` valid attestations by distinct members other than ``about`` saw its
    WireGuard key's packets come from ``reflexive``'s address (the port too: a symmetric NAT's
    hint is one of the ports seen)."""
    try:
        ip, port = split_endpoint(reflexive)
    except ValueError:
        return False
    observers = set()
    seen_port = False
    for blob in list(blobs)[:MAX_SEEN]:
        try:
            s = open_seen(blob, swarm=swarm, about=about, wgpub=wgpub, now=now)
        except Invalid:
            continue
        if s.wg is None or not is_member(s.observer):
            continue
        s_ip, s_port = split_endpoint(s.wg)
        if s_ip == ip:
            observers.add(s.observer)
            seen_port |= s_port == port
    return len(observers) >= quorum and seen_port


class Reach:
    """The verdict from what observers reported (module header)."""

    def __init__(self, *, wg_port: int, local_ips: Iterable[str] = (), quorum: int = QUORUM,
                 window: float = WINDOW) -> None:
        self.wg_port = wg_port
        self.local_ips = {str(ipaddress.ip_address(ip)) for ip in local_ips}
        self.quorum = quorum
        self.window = window
        self._seen: dict[str, Seen] = {}  # observer -> its latest
        # observer -> when its endpoint for us last changed (0: never, in what we hold of it). An
        # observer behind a NAT that filters by port never sees a rebound mapping and keeps naming
        # the old one in fresh answers: the observers that saw us move are the newest news.
        self._moved: dict[str, float] = {}

    def set_local_ips(self, ips: Iterable[str]) -> None:
        self.local_ips = {str(ipaddress.ip_address(ip)) for ip in ips}

    def observed(self, seen: Seen) -> None:
        old = self._seen.get(seen.observer)
        if old is None or seen.at >= old.at:
            if old is not None and seen.wg is None and old.wg is not None:
                # the observer could not prove our endpoint this time (it just rewrote our peer):
                # what it last proved stands, until the window ends
                seen = dataclasses.replace(old, dial=old.dial if seen.dial is None else seen.dial)
            elif seen.dial is None and old is not None and old.dial is not None:
                seen = dataclasses.replace(seen, dial=old.dial)  # dial-backs are rationed: the last one stands
            if old is None:
                self._moved[seen.observer] = 0.0
            elif seen.wg is not None and old.wg is not None and seen.wg != old.wg:
                self._moved[seen.observer] = seen.at
            self._seen[seen.observer] = seen

    def forget(self, observer: str) -> None:
        self._seen.pop(observer, None)
        self._moved.pop(observer, None)

    def observations(self, now: float) -> list[Seen]:
        for observer in [o for o, s in self._seen.items() if now - s.at > self.window]:
            self.forget(observer)
        return sorted(self._seen.values(), key=lambda s: (-s.at, s.observer))

    def verdict(self, now: float) -> Verdict:
        seen = self.observations(now)
        dialled = [s for s in seen if s.dial]
        if len(dialled) >= self.quorum:
            return _verdict("public", None, dialled[:self.quorum])
        wg = [s for s in seen if s.wg is not None]
        if len(wg) < self.quorum:
            return UNKNOWN
        own = [s for s in wg if split_endpoint(s.wg)[0] in self.local_ips and split_endpoint(s.wg)[1] == self.wg_port]
        refused = [s for s in seen if s.dial is False]
        if len(own) >= self.quorum and len(refused) >= self.quorum:
            return _verdict("firewall", own[0].wg, own[:self.quorum])
        by_ip: dict[str, list[Seen]] = {}
        for s in wg:
            if s not in own:
                by_ip.setdefault(split_endpoint(s.wg)[0], []).append(s)
        if not by_ip:
            return UNKNOWN
        ip, agreeing = max(by_ip.items(), key=lambda item: (len(item[1]), max(s.at for s in item[1])))
        if len(agreeing) < self.quorum:
            return UNKNOWN
        ports: dict[int, list[Seen]] = {}
        for s in agreeing:  # newest first
            ports.setdefault(split_endpoint(s.wg)[1], []).append(s)
        moved = sorted(agreeing, key=lambda s: (-self._moved.get(s.observer, 0.0), -s.at, s.observer))
        newest = [split_endpoint(s.wg)[1] for s in moved[:self.quorum]]
        if len(set(newest)) == 1:
            return _verdict("eim", format_endpoint(ip, newest[0]), moved[:self.quorum])
        port, same = max(ports.items(), key=lambda item: (len(item[1]), max(s.at for s in item[1])))
        if len(same) >= self.quorum:
            return _verdict("eim", format_endpoint(ip, port), same[:self.quorum])
        newest = agreeing[0]  # observations() is newest first
        return _verdict("edm", newest.wg, agreeing[:self.quorum])


def _verdict(kind: str, reflexive: str | None, by: list[Seen]) -> Verdict:
    return Verdict(kind=kind, reflexive=reflexive, confirmed_by=tuple(s.observer for s in by),
                   seen=tuple(s.blob for s in by if s.blob))


def _endpoint(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > 64:
        raise Invalid("malformed", f"{where}: expected an endpoint")
    try:
        return format_endpoint(*split_endpoint(value))
    except ValueError as exc:
        raise Invalid("malformed", f"{where}: {exc}") from None


def _ip(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > 64:
        raise Invalid("malformed", f"{where}: expected an IP address")
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise Invalid("malformed", f"{where}: {value!r:.60} is not an IP address") from None
