"""The membership messages on the wire: capacity records and rumors, and their checks.

Every message is a signed blob (see signed.py) whose body has ``v`` (schema version), ``k``
(kind), ``swarm``, ``peer`` (the signer) and ``cert`` (the signer's membership certificate):

- ``record``: ``{seq, issued, ttl, addrs, res, labels, wg, jobs, rtt, coord, relay, via}`` — what
  a node is and offers (``rtt``: its RTTs to its nearest members, rtts.py; ``coord``: its
  Vivaldi coordinate; ``relay``: it forwards WireGuard packets for pairs of members; ``via``:
  the relay it chose for a pair it is the chooser of, routing/paths.py). The seq grows with
  every record a node issues, across restarts; it is also the node's SWIM incarnation number,
  so a newer record refutes a suspicion.
- ``suspect`` / ``dead``: ``{about, inc, issued}`` — the signer suspects ``about`` (or
  declares it dead) at incarnation ``inc``.
- ``left``: ``{inc, issued}`` — the signer is leaving on purpose.
- ``revoke``: signed by the owner, not a member (revocation.py); decoded on its own path.

A record's ``wg`` carries ``proof``: the WireGuard key's own signature (XEdDSA, wg/keys.py)
over (swarm, peer, key), so nobody can advertise a key it does not hold; and when the
signer's certificate names an overlay address, the record must advertise exactly it. Without
one (an older certificate) the IPv4 address must be a host of the overlay network. The IPv6
address, when given, is the one ``address.ula`` derives from the signer's peer id: nobody can
claim another member's (``addr_mismatch``).

Where a record tells others to send packets (WireGuard endpoints, the multiaddrs' IPs and
ports) it may not point at this host's own services or at nothing: loopback, link-local (the
cloud metadata service is 169.254.169.254), multicast, unspecified, broadcast, reserved and
the overlay networks themselves are refused (``bad_address``), as is port 0. Private ranges
stay allowed: providers on one LAN reach each other there. Loopback is allowed only to a
Verifier told so (``loopback=True``): a node whose own addresses are all loopback, i.e. daemons
sharing one machine (tests), where loopback is the only way to reach each other.

``Verifier.decode`` checks, in this order, before anything is believed: size, shape,
version, swarm id, the signature against the key inside the signer's peer id, the
certificate against the owner's key, freshness; then the fields. A failure raises
``Invalid`` whose ``reason`` is the metric label. Unknown fields are ignored.
"""

from __future__ import annotations

import ipaddress
import math
import re
import dataclasses
from dataclasses import dataclass
from typing import Any

from ..vivaldi import Coordinate
from ..wg.address import DEFAULT_NETWORK, ula, ula_prefix
from ..wg.reach import KINDS as REACH_KINDS, MAX_SEEN, MAX_SEEN_BYTES
from ..wg.endpoint import format_endpoint, split_endpoint
from ..wg.proof import verify_proof
from ..p2p import multiaddrs
from ..p2p.signed import Invalid, Signer, field, peer_bytes, peer_key, peer_str, seal, unseal, verify
from .capacity import Resources
from .cert import CLOCK_SKEW, Cert, check_cert
from .registry import (DemandEntry, ReplicaEntry, ServiceClaim, claims_from_wire, demand_from_wire,
                       replicas_from_wire)
from .membership import MAX_SEQ  # the one definition: the core refutes within it, the wire refuses above
from .revocation import Revocation, check_revocation, is_revocation
from .rtts import MAX_RTTS, Rtts, rtt_tag

VERSION = 1
MAX_MESSAGE = 64 * 1024  # a record with 64 GPUs is about 8 KiB
RUMOR_TTL = 60.0  # a rumor older than this is a replay, not news
MAX_LABELS = 32
MAX_ADDRS = 16
MAX_VIA = 16  # relayed paths a record announces (routing/paths.py MAX_RELAYED)
LABEL_KEY = re.compile(r"^[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?$")
MAX_LABEL_VALUE = 255
RUMOR_KINDS = ("suspect", "dead", "left")
MAX_RECORD_TTL = 86400.0  # ours: 120 s up to 300 members, stretched with the swarm (4,000 s at 10,000); a stopped member goes stale within a day
WG_PROOF_DOMAIN = b"swarmd wg key proof\0"
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")  # RFC 1122 "this network": not a destination


def wg_proof_message(swarm: str, peer: str, public: bytes) -> bytes:
    """What a member's WireGuard key signs: this swarm, this identity, this key."""
    return WG_PROOF_DOMAIN + swarm.encode() + b"\0" + peer_bytes(peer) + public


@dataclass(frozen=True, slots=True, kw_only=True)
class MeshInfo:
    """A member's WireGuard side: its key (bound to the identity by the record's signature),
    overlay addresses, UDP port, and the underlay IPs a peer may try as endpoints."""

    public: bytes
    addr4: str
    addr6: str | None
    port: int
    endpoints: tuple[str, ...]
    proof: bytes | None = None  # wg_proof_message signed by the WireGuard key (keys.prove)
    # How the member is reached (wg/reach.py), once two members measured it: its class (one
    # of reach.KINDS), its reflexive endpoint ("IP:port", behind a NAT or a firewall) with
    # the observers' signed attestations of it, and, when nobody can dial its underlay (its
    # record then lists no addresses), the libp2p TCP port it listens on at its overlay address.
    nat: str | None = None
    reflexive: str | None = None
    seen: tuple[bytes, ...] = ()
    tcp: int | None = None

    def to_wire(self) -> dict[str, Any]:
        out = {"pub": self.public, "addr4": self.addr4, "addr6": self.addr6, "port": self.port,
               "endpoints": list(self.endpoints)}
        if self.proof is not None:
            out["proof"] = self.proof
        if self.nat is not None:
            out["nat"] = self.nat
        if self.reflexive is not None:
            out["reflexive"] = self.reflexive
        if self.seen:
            out["seen"] = list(self.seen)
        if self.tcp is not None:
            out["tcp"] = self.tcp
        return out

    @classmethod
    def from_wire(cls, data: Any) -> MeshInfo:
        if not isinstance(data, dict):
            raise Invalid("malformed", "record.wg: expected a map")
        public = data.get("pub")
        if not isinstance(public, bytes) or len(public) != 32:
            raise Invalid("malformed", "record.wg.pub: expected a 32-byte key")
        proof = data.get("proof")
        if proof is not None and not (isinstance(proof, bytes) and len(proof) == 64):
            raise Invalid("malformed", "record.wg.proof: expected a 64-byte signature")
        port = data.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise Invalid("malformed", f"record.wg.port: expected 1-65535, got {port!r}")
        endpoints = data.get("endpoints", [])
        if not isinstance(endpoints, list) or len(endpoints) > MAX_ADDRS:
            raise Invalid("malformed", f"record.wg.endpoints: expected a list of at most {MAX_ADDRS} IPs")
        try:
            addr4 = str(ipaddress.IPv4Address(data.get("addr4")))
            addr6 = None if data.get("addr6") is None else str(ipaddress.IPv6Address(data["addr6"]))
            endpoints = [str(ipaddress.ip_address(e)) for e in endpoints]
        except (ValueError, TypeError) as exc:
            raise Invalid("malformed", f"record.wg: {exc}") from None
        nat = data.get("nat")
        if nat is not None and nat not in REACH_KINDS:
            raise Invalid("malformed", f"record.wg.nat: expected one of {', '.join(REACH_KINDS)}, got {nat!r:.40}")
        reflexive = data.get("reflexive")
        if reflexive is not None:
            try:
                if not isinstance(reflexive, str) or len(reflexive) > 64:
                    raise ValueError("expected IPv4:port or [IPv6]:port")
                reflexive = format_endpoint(*split_endpoint(reflexive))
            except ValueError as exc:
                raise Invalid("malformed", f"record.wg.reflexive: {exc}") from None
        seen = data.get("seen", [])
        if not isinstance(seen, list) or len(seen) > MAX_SEEN \
                or not all(isinstance(b, bytes) and len(b) <= MAX_SEEN_BYTES for b in seen):
            raise Invalid("malformed", f"record.wg.seen: expected at most {MAX_SEEN} attestations of at most "
                          f"{MAX_SEEN_BYTES} bytes")
        tcp = data.get("tcp")
        if tcp is not None and (isinstance(tcp, bool) or not isinstance(tcp, int) or not 1 <= tcp <= 65535):
            raise Invalid("malformed", f"record.wg.tcp: expected 1-65535, got {tcp!r:.20}")
        return cls(public=public, addr4=addr4, addr6=addr6, port=port, endpoints=tuple(endpoints), proof=proof,
                   nat=nat, reflexive=reflexive, seen=tuple(seen), tcp=tcp)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSlots:
    """What a member offers to jobs: slots in all and free, GPUs not given to a job, and
    the ranks it runs now (its load, for placement)."""
    slots: int
    free: int
    gpus_free: int
    ranks: int

    def to_wire(self) -> dict[str, Any]:
        return {"slots": self.slots, "free": self.free, "gpus_free": self.gpus_free, "ranks": self.ranks}

    @classmethod
    def from_wire(cls, data: Any) -> JobSlots:
        if not isinstance(data, dict):
            raise Invalid("malformed", "record.jobs: expected a map")
        values = {}
        for name in ("slots", "free", "gpus_free", "ranks"):
            v = data.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**16:
                raise Invalid("malformed", f"record.jobs.{name}: expected 0-65535, got {v!r}")
            values[name] = v
        if values["free"] > values["slots"]:
            raise Invalid("malformed", "record.jobs: more slots free than there are")
        return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    swarm: str
    peer: str
    seq: int
    issued: float  # wall clock, seconds since the epoch
    ttl: float
    addrs: tuple[str, ...]
    resources: Resources
    labels: dict[str, str]
    wg: MeshInfo | None
    jobs: JobSlots | None = None
    rtts: Rtts = dataclasses.field(default_factory=Rtts)  # its RTTs to its nearest members (ms), by peer id
    coord: Coordinate | None = None  # its network coordinate (vivaldi/coordinates.py)
    relay: bool = False  # it offers to relay WireGuard packets between members
    via: dict[str, str] = dataclasses.field(default_factory=dict)  # peer -> the relay it chose for that pair
    services: tuple[ServiceClaim, ...] = ()  # the services it controls (registry.py)
    replicas: tuple[ReplicaEntry, ...] = ()  # the service replicas it runs (registry.py)
    demand: tuple[DemandEntry, ...] = ()  # the services' requests entering its gateway (registry.py)
    cert: Cert
    blob: bytes

    @property
    def expires(self) -> float:
        return self.issued + self.ttl

    @property
    def cert_expires(self) -> float:
        """When the signer's certificate runs out (wall clock): the membership core reads it."""
        return self.cert.expires


@dataclass(frozen=True, slots=True, kw_only=True)
class Rumor:
    kind: str  # suspect | dead | left
    swarm: str
    sender: str
    about: str
    incarnation: int
    issued: float
    blob: bytes


def check_labels(labels: Any, where: str = "labels") -> dict[str, str]:
    if not isinstance(labels, dict) or len(labels) > MAX_LABELS:
        raise Invalid("malformed", f"{where}: expected a map of at most {MAX_LABELS} labels")
    for k, v in labels.items():
        if not isinstance(k, str) or not LABEL_KEY.match(k):
            raise Invalid("malformed", f"{where}: key {k!r} must be 1-63 of a-z 0-9 . _ / - "
                                       "starting and ending with a letter or digit")
        if not isinstance(v, str) or len(v) > MAX_LABEL_VALUE or not v.isprintable():
            raise Invalid("malformed", f"{where}.{k}: value must be printable text of at most {MAX_LABEL_VALUE} "
                                       "characters (no control characters)")
    return dict(labels)


def make_record(sign: Signer, *, swarm: str, peer: str, seq: int, issued: float, ttl: float,
                addrs: list[str], resources: Resources, labels: dict[str, str],
                wg: MeshInfo | None, cert: Cert, jobs: JobSlots | None = None,
                rtts: dict[str, float] | None = None, coord: Coordinate | None = None, relay: bool = False,
                via: dict[str, str] | None = None, services: tuple[ServiceClaim, ...] = (),
                replicas: tuple[ReplicaEntry, ...] = (), demand: tuple[DemandEntry, ...] = ()) -> bytes:
    body = {"v": VERSION, "k": "record", "swarm": swarm, "peer": peer_bytes(peer), "seq": seq,
            "issued": issued, "ttl": ttl, "addrs": addrs, "res": resources.to_wire(),
            "labels": labels, "wg": None if wg is None else wg.to_wire(),
            "jobs": None if jobs is None else jobs.to_wire(),
            "cert": cert.blob}
    if rtts:
        body["rtt"] = Rtts.of(rtts).to_wire()
    if coord is not None:
        body["coord"] = coord.to_wire()
    if relay:
        body["relay"] = True
    if via:
        body["via"] = [[peer_bytes(p), peer_bytes(r)] for p, r in via.items()]
    if services:
        body["services"] = [c.to_wire() for c in services]
    if replicas:
        body["replicas"] = [r.to_wire() for r in replicas]
    if demand:
        body["demand"] = [d.to_wire() for d in demand]
    return seal(body, sign)


def make_rumor(sign: Signer, *, kind: str, swarm: str, sender: str, about: str, incarnation: int,
               issued: float, cert: Cert) -> bytes:
    assert kind in RUMOR_KINDS
    return seal({"v": VERSION, "k": kind, "swarm": swarm, "peer": peer_bytes(sender),
                 "about": peer_bytes(about), "inc": incarnation, "issued": issued, "cert": cert.blob}, sign)


def only_loopback(addrs: Any) -> bool:
    """True when every one of these multiaddrs is on a loopback IP (and there is one)."""
    addrs = list(addrs)
    try:
        ips = [multiaddrs.parts(a)[0] for a in addrs]
    except ValueError:
        return False
    return bool(ips) and all(ip is not None and _unmapped(ip).is_loopback for ip in ips)


def _unmapped(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip


class Verifier:
    """Checks messages for one swarm; ``now`` is wall-clock time (certificates expire).

    ``network`` is the IPv4 overlay (config ``mesh_network``); ``local_addrs``, this node's own
    multiaddrs: when all are loopback, loopback addresses in records are allowed (daemons that
    share one machine: see the module header)."""

    def __init__(self, swarm: str, owner_public: bytes, *, network: Any = DEFAULT_NETWORK,
                 local_addrs: Any = ()) -> None:
        self.swarm = swarm
        self.owner_public = owner_public
        self.network = ipaddress.IPv4Network(network)
        self.loopback = only_loopback(list(local_addrs))
        self._ula = ula_prefix(swarm)
        self.revoked: set[str] = set()  # peer ids whose messages are refused (reason "revoked")

    def check_ip(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address, where: str) -> None:
        """Refuse an IP a record tells others to send to that is not a remote host's (module header)."""
        ip = _unmapped(ip)
        why = ("loopback" if ip.is_loopback and not self.loopback else
               "link-local" if ip.is_link_local else
               "multicast" if ip.is_multicast else
               "unspecified" if ip.is_unspecified or (ip.version == 4 and ip in _THIS_NETWORK) else
               "broadcast or reserved" if ip.is_reserved else
               "inside the overlay" if ip in self.network or ip in self._ula else None)
        if why is not None:
            raise Invalid("bad_address", f"{where}: {ip} is {why}")

    def decode(self, blob: bytes, now: float) -> Record | Rumor | Revocation:
        if len(blob) > MAX_MESSAGE:
            raise Invalid("too_large", f"{len(blob)} bytes, the limit is {MAX_MESSAGE}")
        body, raw, sig = unseal(blob)
        if body.get("v") != VERSION:
            raise Invalid("version", f"schema version {body.get('v')!r}, this node reads {VERSION}")
        if is_revocation(body):  # the owner's, not a member's: no certificate, no peer signature
            return check_revocation(blob, owner_public=self.owner_public, swarm=self.swarm, now=now)
        kind = body.get("k")
        if kind != "record" and kind not in RUMOR_KINDS:
            raise Invalid("malformed", f"unknown kind {kind!r}")
        if body.get("swarm") != self.swarm:
            raise Invalid("swarm", f"message for swarm {body.get('swarm')!r}")
        signer = field(body, "peer", bytes, kind)
        verify(peer_key(signer), raw, sig)
        cert = check_cert(body.get("cert"), owner_public=self.owner_public, swarm=self.swarm,
                          peer=signer, now=now)
        if cert.peer in self.revoked:
            raise Invalid("revoked", f"{cert.peer} is revoked by the swarm's owner")
        issued = float(field(body, "issued", (int, float), kind))
        if not math.isfinite(issued):  # NaN compares false: it would pass every freshness check below
            raise Invalid("malformed", f"{kind}.issued: {issued} is not a time")
        if issued > now + CLOCK_SKEW:
            raise Invalid("future", f"issued {issued - now:.0f} s in the future")
        if kind == "record":
            return self._record(body, blob, cert, issued, now)
        if issued + RUMOR_TTL < now:
            raise Invalid("stale", f"{kind} rumor issued {now - issued:.0f} s ago")
        about = field(body, "about", bytes, kind) if kind != "left" else signer
        peer_key(about)
        return Rumor(kind=kind, swarm=self.swarm, sender=cert.peer, about=peer_str(about),
                     incarnation=_uint(body, "inc", kind), issued=issued, blob=blob)

    def _record(self, body: dict[str, Any], blob: bytes, cert: Cert, issued: float, now: float) -> Record:
        ttl = float(field(body, "ttl", (int, float), "record"))
        if not math.isfinite(ttl) or ttl > MAX_RECORD_TTL:  # a record that never expires outlives its node
            raise Invalid("malformed", f"record.ttl: {ttl} is not a duration of at most {MAX_RECORD_TTL:g} s")
        if issued + ttl < now:
            raise Invalid("stale", f"record expired {now - issued - ttl:.0f} s ago")
        addrs = field(body, "addrs", list, "record")
        if len(addrs) > MAX_ADDRS or not all(isinstance(a, str) and len(a) <= 256 for a in addrs):
            raise Invalid("malformed", f"record.addrs: at most {MAX_ADDRS} multiaddr strings")
        for addr in addrs:
            try:
                ip, ports = multiaddrs.parts(addr)
            except ValueError as exc:
                raise Invalid("malformed", f"record.addrs: {exc}") from None
            if ip is not None:
                self.check_ip(ip, "record.addrs")
            if not all(multiaddrs.is_port(p) for p in ports):
                raise Invalid("bad_address", f"record.addrs: {addr!r} has a port outside 1-65535")
        try:
            resources = Resources.from_wire(body.get("res"))
        except ValueError as exc:
            raise Invalid("malformed", f"record.{exc}") from None
        wg = None if body.get("wg") is None else MeshInfo.from_wire(body["wg"])
        if wg is not None:
            if cert.addr4 is not None and wg.addr4 != cert.addr4:
                raise Invalid("addr_mismatch", f"record.wg.addr4 {wg.addr4} is not the certificate's {cert.addr4}")
            addr4 = ipaddress.IPv4Address(wg.addr4)
            if cert.addr4 is None and (addr4 not in self.network or addr4 in (self.network.network_address,
                                                                             self.network.broadcast_address)):
                raise Invalid("bad_address", f"record.wg.addr4 {addr4} is not a host of the overlay {self.network}")
            if wg.addr6 is not None and wg.addr6 != str(ula(self.swarm, cert.peer.encode())):
                raise Invalid("addr_mismatch", f"record.wg.addr6 {wg.addr6} is not the one derived from the "
                                               f"signer's id, {ula(self.swarm, cert.peer.encode())}")
            for endpoint in wg.endpoints:
                self.check_ip(ipaddress.ip_address(endpoint), "record.wg.endpoints")
            if wg.reflexive is not None:
                self.check_ip(ipaddress.ip_address(split_endpoint(wg.reflexive)[0]), "record.wg.reflexive")
            if wg.proof is None or not verify_proof(wg.public, wg_proof_message(self.swarm, cert.peer, wg.public),
                                                    wg.proof):
                raise Invalid("wg_proof", "record.wg.proof: the WireGuard key's holder did not sign it")
        jobs = None if body.get("jobs") is None else JobSlots.from_wire(body["jobs"])
        return Record(swarm=self.swarm, peer=cert.peer, seq=_uint(body, "seq", "record"), issued=issued,
                      ttl=ttl, addrs=tuple(addrs), resources=resources,
                      labels=check_labels(body.get("labels", {}), "record.labels"), wg=wg, jobs=jobs,
                      rtts=Rtts.from_wire(body["rtt"]) if "rtt" in body else _rtts(body.get("rtts", [])),
                      coord=_coord(body.get("coord")),
                      relay=_flag(body.get("relay", False), "record.relay"), via=_via(body.get("via", []), cert.peer),
                      services=claims_from_wire(body.get("services", [])),
                      replicas=replicas_from_wire(body.get("replicas", [])),
                      demand=demand_from_wire(body.get("demand", [])), cert=cert, blob=blob)


def _rtts(data: Any) -> Rtts:
    """An older daemon's RTTs: [[peer id, ms], ...]."""
    if not isinstance(data, list) or len(data) > MAX_RTTS:
        raise Invalid("malformed", f"record.rtts: expected a list of at most {MAX_RTTS} [peer, ms] pairs")
    out = {}
    for item in data:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes)
                and isinstance(item[1], (int, float)) and not isinstance(item[1], bool)
                and 0 <= item[1] < 60_000):
            raise Invalid("malformed", "record.rtts: each entry is [peer id bytes, 0-60000 ms]")
        peer_key(item[0])
        out[rtt_tag(peer_str(item[0]))] = float(item[1])
    return Rtts(out)


def _coord(data: Any) -> Coordinate | None:
    if data is None:
        return None
    try:
        return Coordinate.from_wire(data)
    except ValueError as exc:
        raise Invalid("malformed", f"record.coord: {exc}") from None


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise Invalid("malformed", f"{where}: expected true or false, got {value!r:.40}")
    return value


def _via(data: Any, signer: str) -> dict[str, str]:
    """The chooser's relays: [[peer, relay], ...]; neither may be the signer, nor the two the same."""
    if not isinstance(data, list) or len(data) > MAX_VIA:
        raise Invalid("malformed", f"record.via: expected a list of at most {MAX_VIA} [peer, relay] pairs")
    out: dict[str, str] = {}
    for item in data:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, bytes) for x in item)):
            raise Invalid("malformed", "record.via: each entry is [peer id bytes, relay peer id bytes]")
        peer_key(item[0])
        peer_key(item[1])
        peer, relay = peer_str(item[0]), peer_str(item[1])
        if signer in (peer, relay) or peer == relay or peer in out:
            raise Invalid("malformed", "record.via: a pair names the signer, the same peer twice, or a peer twice")
        out[peer] = relay
    return out


def _uint(body: dict[str, Any], name: str, where: str) -> int:
    value = field(body, name, int, where)
    if not 0 <= value < MAX_SEQ:
        raise Invalid("malformed", f"{where}.{name}: {value} is outside 0..2^63")
    return value
