"""A relay request on the wire: an end of a pair asks a member to relay the pair's packets.

The request is a signed blob (p2p/signed.py), like a record: ``{v, k: "relay", swarm, peer,
relay, other, via_ip, op, issued}``, where ``peer`` is the signer (one end of the pair),
``relay`` the member asked, ``other`` the pair's other end, ``via_ip`` the relay's IP this end
sends to, ``op`` ``"relay"`` (ask or renew) or ``"release"`` (this end stopped using it). It
travels on ``/swarmd/relay/1.0.0`` beside the signer's certificate: ``{cert, req}`` ->
``{port, active, expires_in}`` or ``{error, reason}``.

``check`` refuses, with ``Invalid(reason, detail)``, a blob that is not exactly that: another
swarm, a signer that is not the stream's peer, a relay that is not this node, a pair of a
member with itself or with the relay, an IP that is not a plain IPv4 host address, or a
request issued outside ``FRESH`` seconds of now (a replay). What the relay then does with a
valid request (the pair's other end must ask too, caps, leases) is routing/relay.py's.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from typing import Any

from ..p2p.signed import Invalid, Signer, field, peer_bytes, peer_key, peer_str, seal, unseal, verify

VERSION = 1
PROTOCOL = "/swarmd/relay/1.0.0"
FRESH = 60.0  # seconds either side of now a request may have been issued
OPS = ("relay", "release")
MAX_REQUEST = 4096
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")  # "this host on this network" (RFC 1122): no host's address


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    peer: str  # the signer: one end of the pair
    relay: str
    other: str  # the pair's other end
    via_ip: str  # the relay's IPv4 address this end sends to
    op: str
    issued: float


def make(sign: Signer, *, swarm: str, peer: str, relay: str, other: str, via_ip: str, op: str,
         issued: float) -> bytes:
    return seal({"v": VERSION, "k": "relay", "swarm": swarm, "peer": peer_bytes(peer), "relay": peer_bytes(relay),
                 "other": peer_bytes(other), "via_ip": via_ip, "op": op, "issued": issued}, sign)


def check(blob: Any, *, swarm: str, me: str, sender: str, now: float) -> Request:
    """The request in ``blob``, sent by ``sender`` (the peer Noise authenticated) to ``me``."""
    if not isinstance(blob, bytes) or len(blob) > MAX_REQUEST:
        raise Invalid("malformed", f"relay request: expected a signed blob of at most {MAX_REQUEST} bytes")
    body, raw, sig = unseal(blob)
    if body.get("v") != VERSION or body.get("k") != "relay":
        raise Invalid("malformed", f"relay request: version {body.get('v')!r} kind {body.get('k')!r}")
    if body.get("swarm") != swarm:
        raise Invalid("swarm", f"relay request for swarm {body.get('swarm')!r}")
    signer = field(body, "peer", bytes, "relay request")
    verify(peer_key(signer), raw, sig)
    peer = peer_str(signer)
    if peer != sender:
        raise Invalid("malformed", "relay request: signed by another peer than the one sending it")
    relay, other = (peer_str(_peer(body, name)) for name in ("relay", "other"))
    if relay != me:
        raise Invalid("malformed", "relay request: addressed to another relay")
    if other in (peer, me):
        raise Invalid("malformed", "relay request: a pair of a member with itself or with the relay")
    op = body.get("op")
    if op not in OPS:
        raise Invalid("malformed", f"relay request: op must be one of {', '.join(OPS)}, got {op!r:.40}")
    issued = field(body, "issued", (int, float), "relay request")
    if isinstance(issued, bool) or not math.isfinite(issued) or abs(issued - now) > FRESH:
        raise Invalid("stale", f"relay request issued {issued!r:.20} is not within {FRESH:g} s of now")
    return Request(peer=peer, relay=relay, other=other, via_ip=ipv4_host(body.get("via_ip"), "via_ip"),
                   op=op, issued=float(issued))


def _peer(body: dict[str, Any], name: str) -> bytes:
    value = field(body, name, bytes, "relay request")
    peer_key(value)
    return value


def ipv4_host(value: Any, where: str) -> str:
    """A unicast IPv4 address a host can hold, canonical; Invalid otherwise."""
    try:
        ip = ipaddress.IPv4Address(value) if isinstance(value, str) and len(value) <= 15 else None
    except ValueError:
        ip = None
    if ip is None or ip.is_multicast or ip in _THIS_NETWORK or ip.is_reserved or ip.is_loopback \
            or ip.is_link_local or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise Invalid("bad_address", f"relay request: {where} {value!r:.40} is not a unicast IPv4 host address")
    return str(ip)
